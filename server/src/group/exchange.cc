#include "group/exchange.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {

absl::StatusOr<std::vector<std::string>> AllGatherStrings(ProcessGroup& group,
                                                          const std::string& mine) {
  const torch::Device device = group.config().device;  // NCCL moves device tensors only
  torch::Tensor length = torch::full({1}, static_cast<int64_t>(mine.size()), torch::kLong);
  ASSIGN_OR_RETURN(const torch::Tensor lengths, group.AllGather(length.to(device)));
  const torch::Tensor sizes = lengths.reshape({-1}).cpu();
  const int64_t longest = std::max<int64_t>(1, sizes.max().item<int64_t>());
  torch::Tensor bytes = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(bytes.data_ptr<uint8_t>(), mine.data(), mine.size());
  ASSIGN_OR_RETURN(torch::Tensor all, group.AllGather(bytes.to(device)));
  all = all.cpu().contiguous();
  std::vector<std::string> out;
  for (int64_t r = 0; r < all.size(0); ++r) {
    const auto* row = all[r].data_ptr<uint8_t>();
    out.emplace_back(
        reinterpret_cast<const char*>(row),
        static_cast<size_t>(std::clamp<int64_t>(sizes[r].item<int64_t>(), 0, longest)));
  }
  return out;
}

std::string PackStrings(const std::vector<std::string>& strings) {
  std::string out;
  for (const std::string& s : strings) {
    const uint64_t n = s.size();
    out.append(reinterpret_cast<const char*>(&n), sizeof(n));
    out.append(s);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> UnpackStrings(const std::string& packed) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < packed.size()) {
    uint64_t n = 0;
    if (packed.size() - at < sizeof(n)) break;
    std::memcpy(&n, packed.data() + at, sizeof(n));
    if (n > packed.size() - at - sizeof(n)) break;
    out.push_back(packed.substr(at + sizeof(n), n));
    at += sizeof(n) + n;
  }
  if (at != packed.size()) {
    return absl::InternalError(absl::StrCat("group exchange: expected packed strings; got ",
                                            packed.size(), " bytes that are not"));
  }
  return out;
}

std::string EncodeStatus(const absl::Status& status) {
  return PackStrings({absl::StrCat(static_cast<int>(status.code())), core::SerializeReason(status),
                      std::string(status.message())});
}

absl::Status DecodeStatus(const std::string& bytes) {
  const absl::StatusOr<std::vector<std::string>> parts = UnpackStrings(bytes);
  int code = 0;
  if (!parts.ok() || parts->size() != 3 || !absl::SimpleAtoi((*parts)[0], &code) || code < 0 ||
      code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError("group exchange: a status that cannot be decoded");
  }
  return core::WithSerializedReason(absl::Status(static_cast<absl::StatusCode>(code), (*parts)[2]),
                                    (*parts)[1]);
}

uint64_t HashTensors(const std::vector<torch::Tensor>& tensors) {
  // FNV-1a over 64-bit words (then the tail's bytes): any changed bit changes the hash; not
  // meant against adversaries, only to prove that replicas hold the same bytes.
  constexpr uint64_t kPrime = 1099511628211ULL;
  uint64_t h = 1469598103934665603ULL;
  for (const torch::Tensor& t : tensors) {
    if (!t.defined()) continue;
    const torch::Tensor cpu = t.contiguous().cpu();
    const auto* bytes = static_cast<const uint8_t*>(cpu.data_ptr());
    const size_t n = cpu.nbytes();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word = 0;
      std::memcpy(&word, bytes + i, 8);
      h = (h ^ word) * kPrime;
    }
    for (; i < n; ++i) h = (h ^ bytes[i]) * kPrime;
  }
  return h;
}

}  // namespace remotehead::server
