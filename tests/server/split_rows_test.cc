// wire::SplitHiddenData against protobuf's own parser: wherever the split finds rows.hidden's
// bytes, the request parses (protobuf) as the split's rest with those bytes put back as
// hidden.data — for the clients' framed messages and for messages serialized whole, over pieces
// cut anywhere (gRPC's slices), and for every truncation of one; where it finds none, it says so.
#include "remotehead/wire/split_rows.h"

#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "framed_rows.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead {
namespace {

// `bytes` cut into pieces of the sizes in `cuts`, in turn (0: an empty piece), the rest whole.
std::vector<wire::BytePiece> CutInto(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<wire::BytePiece> pieces;
  size_t at = 0;
  for (size_t i = 0; at < bytes.size(); ++i) {
    const size_t n = i < cuts.size() ? std::min(cuts[i], bytes.size() - at) : bytes.size() - at;
    pieces.push_back({bytes.data() + at, n});
    at += n;
  }
  return pieces;
}

// The split's claim, checked with protobuf: the rest plus the data is the request.
void ExpectSplitMatchesParse(const std::string& bytes, const std::vector<wire::BytePiece>& pieces,
                             bool expect_found) {
  const std::optional<wire::SplitTensor> split = wire::SplitHiddenData(pieces);
  ASSERT_EQ(split.has_value(), expect_found);
  if (!split.has_value()) return;
  v1::StepRequest original;
  ASSERT_TRUE(original.ParseFromString(bytes));
  v1::StepRequest rebuilt;
  ASSERT_TRUE(rebuilt.ParseFromString(split->rest));
  EXPECT_TRUE(rebuilt.rows().hidden().data().empty());
  std::string data(split->data_size, '\0');
  wire::CopyBytes(pieces, split->data_offset, split->data_size, data.data());
  rebuilt.mutable_rows()->mutable_hidden()->set_data(data);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(rebuilt, original))
      << rebuilt.ShortDebugString().substr(0, 300);
  EXPECT_LT(split->rest.size(), bytes.size() - split->data_size + 16);
}

struct RowsBytes {
  std::string whole;   // serialized as one message
  std::string framed;  // as the clients send it (frames.h): the rows' bytes as fields of their own
};

RowsBytes MakeRows(int64_t offset, int64_t count) {
  static const torch::Tensor hidden = torch::randn({300, 70});
  static const torch::Tensor targets = torch::randint(0, 50, {300}, torch::kLong);
  static const torch::Tensor advantages = torch::randn({300});
  const testing::RowsMessage m =
      testing::MakeRowsMessage(hidden, targets, offset, count, {{"advantages", advantages}});
  return {m.whole.SerializeAsString(), m.framed.Flatten()};
}

TEST(SplitHiddenData, FindsTheRowsWhereverTheyLieAndTheRestParsesAsTheRequest) {
  for (const auto& [offset, count] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 300}, {17, 5}, {299, 1}}) {
    const RowsBytes m = MakeRows(offset, count);
    for (const std::string* bytes : {&m.whole, &m.framed}) {
      for (const std::vector<size_t>& cuts :
           std::vector<std::vector<size_t>>{{}, {1, 1, 1, 0, 2, 3}, {7, 0, 4096, 13}, {2, 5000}}) {
        SCOPED_TRACE(absl::StrCat("rows ", offset, "+", count,
                                  bytes == &m.whole ? " whole" : " framed", " cuts ", cuts.size()));
        ExpectSplitMatchesParse(*bytes, CutInto(*bytes, cuts), /*expect_found=*/true);
      }
    }
  }
}

TEST(SplitHiddenData, SaysSoWhereThereIsNothingToSplit) {
  v1::StepRequest header;
  header.mutable_header()->set_head_id("h");
  EXPECT_FALSE(wire::SplitHiddenData(CutInto(header.SerializeAsString(), {})).has_value());
  v1::StepRequest grad_only;  // a Backward by handle: grad_output, no hidden
  wire::EncodeRows(torch::ones({4}), 0, 4, grad_only.mutable_rows()->mutable_grad_output());
  EXPECT_FALSE(wire::SplitHiddenData(CutInto(grad_only.SerializeAsString(), {})).has_value());
  // hidden's data twice (the last wins in protobuf): parsed whole instead.
  const RowsBytes m = MakeRows(3, 4);
  const std::string twice = m.framed + MakeRows(3, 4).whole;
  EXPECT_FALSE(wire::SplitHiddenData(CutInto(twice, {})).has_value());
  EXPECT_FALSE(wire::SplitHiddenData({}).has_value());
  // A header (StepRequest.part's other member) between or before rows occurrences: it clears
  // the rows before it, so the split would not be what protobuf parses.
  const std::string header_bytes = header.SerializeAsString();
  for (const std::string& mixed : {m.framed + header_bytes + MakeRows(3, 4).whole,
                                   header_bytes + m.framed}) {
    EXPECT_FALSE(wire::SplitHiddenData(CutInto(mixed, {})).has_value());
  }
}

// Every truncation: either no split, or one that protobuf agrees with (a prefix cut at a field's
// end is a well-formed message).
TEST(SplitHiddenData, EveryTruncatedRequestIsRefusedOrSplitAsProtobufParsesIt) {
  const RowsBytes m = MakeRows(40, 3);
  for (const std::string* bytes : {&m.whole, &m.framed}) {
    int splits = 0, refusals = 0;
    for (size_t n = 0; n < bytes->size(); ++n) {
      const std::string prefix = bytes->substr(0, n);
      const std::vector<wire::BytePiece> pieces = CutInto(prefix, {3, 1, 0, 5});
      const std::optional<wire::SplitTensor> split = wire::SplitHiddenData(pieces);
      if (!split.has_value()) {
        ++refusals;
        continue;
      }
      ++splits;
      SCOPED_TRACE(absl::StrCat("prefix of ", n, " bytes"));
      ExpectSplitMatchesParse(prefix, pieces, /*expect_found=*/true);
    }
    // Cut inside hidden's data: refused. Cut after it at an occurrence's end (the framed form
    // has several; the whole form's one rows field is cut by every prefix): split.
    EXPECT_GT(refusals, 100);
    EXPECT_EQ(splits > 0, bytes == &m.framed);
  }
}

}  // namespace
}  // namespace remotehead
