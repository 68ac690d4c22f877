// The client's side of the wire seam: torch::Tensor <-> remotehead.v1.Tensor (raw little-endian
// bytes, dtype, shape), row-chunk planning for requests, and the assembly of streamed row
// chunks into a preallocated result. Kept apart from server/'s codec on purpose: a trainer
// links no server code.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::client::wire {

// INVALID_ARGUMENT naming `field` for a dtype the wire cannot carry (e.g. uint8, bool).
absl::StatusOr<v1::DType> ToWireDtype(torch::ScalarType dtype, const std::string& field);
// INTERNAL naming `field` for a dtype the server should never send.
absl::StatusOr<torch::ScalarType> FromWireDtype(v1::DType dtype, const std::string& field);

// Writes rows [offset, offset + count) of `cpu` (a contiguous CPU tensor with a wire dtype)
// into `wire`, copying the bytes once.
void EncodeRows(const torch::Tensor& cpu, int64_t offset, int64_t count, v1::Tensor* wire);

// Copies the CPU, contiguous, wire-dtype version of `t` (one copy at most; none when `t`
// already is one). `dtype` unset keeps t's dtype.
torch::Tensor ToWireLayout(const torch::Tensor& t, std::optional<torch::ScalarType> dtype = {});

// Splits `rows` rows of `bytes_per_row` bytes into [offset, count) pieces whose messages stay
// within `max_message_bytes` once `overhead_bytes` of framing are added. INVALID_ARGUMENT when
// one row alone does not fit.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> PlanRowChunks(int64_t rows,
                                                                       int64_t bytes_per_row,
                                                                       int64_t overhead_bytes,
                                                                       int64_t max_message_bytes);

// Streamed rows of one result tensor, checked and copied into `dst` as they arrive: chunks must
// come in order, without gaps or overlaps, with dst's trailing shape; values are converted to
// dst's dtype. Anything else is a broken server response: INTERNAL naming `field`.
class RowAssembler {
 public:
  RowAssembler(torch::Tensor dst, std::string field) : dst_(std::move(dst)), field_(field) {}
  absl::Status Add(const v1::TensorChunk& chunk);
  // INTERNAL unless every row arrived.
  absl::Status CheckComplete() const;
  const torch::Tensor& tensor() const { return dst_; }

 private:
  torch::Tensor dst_;
  std::string field_;
  int64_t next_row_ = 0;
};

}  // namespace remotehead::client::wire
