// The seam between the wire and the engine: remotehead.v1.Tensor <-> torch::Tensor, with every
// check a client's bytes need (dtype, shape, byte count) reported as INVALID_ARGUMENT naming
// the field, and the row-chunk plan that keeps every message far below gRPC's size limits.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::server {

absl::StatusOr<torch::ScalarType> FromWireDtype(v1::DType dtype, const std::string& field);
absl::StatusOr<v1::DType> ToWireDtype(torch::ScalarType dtype);

// Copies the bytes of `wire` into a new CPU tensor. `field` names it in errors, e.g.
// "rows.hidden: expected 8192 bytes for float32 [8, 256]; got 8000".
absl::StatusOr<torch::Tensor> DecodeTensor(const v1::Tensor& wire, const std::string& field);
// The same checks, but the tensor aliases wire.data() (no copy): valid only while `wire` lives
// unchanged, and only for reading.
absl::StatusOr<torch::Tensor> DecodeTensorView(const v1::Tensor& wire, const std::string& field);

// Writes `tensor` (any device; copied to a contiguous CPU tensor if needed) into `wire`.
absl::Status EncodeTensor(const torch::Tensor& tensor, v1::Tensor* wire);

// Splits `rows` rows of `bytes_per_row` bytes into [offset, count) pieces of at most
// `max_chunk_bytes` each (at least one row per piece).
std::vector<std::pair<int64_t, int64_t>> PlanRowChunks(int64_t rows, int64_t bytes_per_row,
                                                       int64_t max_chunk_bytes);

// Default size of one streamed tensor chunk: far below gRPC's 4 MiB default message limit.
inline constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;

}  // namespace remotehead::server
