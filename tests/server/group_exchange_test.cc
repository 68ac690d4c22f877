// What a group's ranks exchange over their collectives (server/src/group/exchange.h): packed
// strings and statuses survive the trip whole (a mesh's verdicts keep their code, reason and
// message; a start's listings keep every name), bytes that are not packed strings are refused,
// never half-read, and the hash replicas compare sees every byte and the order. AllGatherStrings
// itself runs in the multi-process tests (tests/python/test_mesh.py, test_mesh_state.py).
#include <gtest/gtest.h>

#include <cmath>

#include "group/exchange.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::server {
namespace {

TEST(GroupExchange, PackedStringsComeBackWhole) {
  const std::vector<std::vector<std::string>> cases = {
      {}, {""}, {"a", "", "bc"}, {std::string("\0\t,x", 4), std::string(5000, 'z')}};
  for (const auto& strings : cases) {
    const auto unpacked = UnpackStrings(PackStrings(strings));
    ASSERT_TRUE(unpacked.ok()) << unpacked.status();
    EXPECT_EQ(*unpacked, strings);
  }
}

TEST(GroupExchange, BytesThatAreNotPackedAreRefused) {
  const std::string packed = PackStrings({"abc", "de"});
  const size_t first = sizeof(uint64_t) + 3;  // where "abc" ends: a whole packing of {"abc"}
  for (size_t keep = 1; keep < packed.size(); ++keep) {
    const auto unpacked = UnpackStrings(packed.substr(0, keep));
    if (keep == first) {
      EXPECT_EQ(*unpacked, std::vector<std::string>{"abc"});
    } else {
      EXPECT_EQ(unpacked.status().code(), absl::StatusCode::kInternal) << keep;
    }
  }
}

TEST(GroupExchange, AStatusKeepsItsCodeReasonAndMessage) {
  const absl::Status refused = core::WithReason(
      absl::InvalidArgumentError("replica 1 disagrees with replica 0: adamw.lr: 0.1 vs 0.2"),
      core::reason::kRanksDisagree, {{"replica", "1"}});
  for (const absl::Status& status :
       {absl::OkStatus(), refused, absl::DataLossError(std::string(3000, 'm'))}) {
    const absl::Status back = DecodeStatus(EncodeStatus(status));
    EXPECT_EQ(back.code(), status.code());
    EXPECT_EQ(back.message(), status.message());
    EXPECT_EQ(core::SerializeReason(back), core::SerializeReason(status));
  }
  EXPECT_EQ(DecodeStatus("garbage").code(), absl::StatusCode::kInternal);
  EXPECT_EQ(DecodeStatus(PackStrings({"99", "", "x"})).code(), absl::StatusCode::kInternal);
}

TEST(GroupExchangeTest, HashTensorsSeesEveryByteAndTheOrder) {
  const torch::Tensor w = torch::arange(40, torch::kFloat).reshape({8, 5}) / 7;
  const torch::Tensor b = torch::linspace(-1, 1, 8);
  torch::Tensor odd = w.clone();
  float* x = odd.data_ptr<float>() + 17;
  *x = std::nextafter(*x, 100.0f);  // one element one ulp away
  EXPECT_EQ(HashTensors({w, b}), HashTensors({w.clone(), b.clone()}));
  EXPECT_NE(HashTensors({w, b}), HashTensors({odd, b}));
  EXPECT_NE(HashTensors({w, b}), HashTensors({b, w}));
  EXPECT_EQ(HashTensors({w, b}), HashTensors({w, torch::Tensor(), b}));  // undefined: skipped
  // Bytes as stored: a transposed view hashes as its contiguous copy does.
  const torch::Tensor t = w.t();
  EXPECT_EQ(HashTensors({t}), HashTensors({t.contiguous()}));
}

}  // namespace
}  // namespace remotehead::server
