// The wire codec: remotehead.v1.Tensor <-> torch::Tensor (raw little-endian bytes with dtype and
// shape), the row-chunk plan that keeps every streamed message far below gRPC's size limits,
// and the assembly of streamed row chunks into one tensor. The one codec of the project: the
// server and the C++ client both use it (a trainer links this and proto/, never server code),
// and the Python client's own small codec is tested against the same vectors
// (tests/data/wire_vectors.json).
//
// Errors are INVALID_ARGUMENT naming the field, the expected and the actual value; a caller for
// whom bad bytes mean a broken peer rather than bad input (the client reading the server's
// responses) maps them to its own code.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::wire {

// ----- dtypes (the one table of wire dtypes and their LibTorch counterparts) -----

// INVALID_ARGUMENT "<field>.dtype: expected one of FLOAT32, …; got X".
absl::StatusOr<torch::ScalarType> FromWireDtype(v1::DType dtype, const std::string& field);
// INVALID_ARGUMENT "<field>: expected float32, bfloat16, …; got uint8" for a dtype the wire
// cannot carry.
absl::StatusOr<v1::DType> ToWireDtype(torch::ScalarType dtype, const std::string& field);

// ----- tensors -----

// The dtype of `wire` once its dtype, shape (non-negative, fewer than 2^31 elements) and a data
// field of `data_bytes` agree: DecodeTensorView's checks, also for bytes that lie elsewhere
// (a message split at them: split_rows.h).
absl::StatusOr<torch::ScalarType> CheckTensor(const v1::Tensor& wire, size_t data_bytes,
                                              const std::string& field);
// Checks `wire` (CheckTensor with its own data) and returns a tensor that aliases
// wire.data() (no copy): valid only while `wire` lives unchanged, and only for reading. `field`
// names it in errors, e.g. "rows.hidden: expected 8192 bytes for Float [8, 256]; got 8000".
absl::StatusOr<torch::Tensor> DecodeTensorView(const v1::Tensor& wire, const std::string& field);
// The same, copied into a new CPU tensor.
absl::StatusOr<torch::Tensor> DecodeTensor(const v1::Tensor& wire, const std::string& field);

// Writes `tensor` (any device and layout; copied to a contiguous CPU tensor if needed) into
// `wire`. INVALID_ARGUMENT for a dtype the wire cannot carry.
absl::Status EncodeTensor(const torch::Tensor& tensor, v1::Tensor* wire);

// The CPU, contiguous version of `t` in `dtype` (unset: t's own): one copy at most, none when
// `t` already is one. What EncodeRows takes.
torch::Tensor ToWireLayout(const torch::Tensor& t, std::optional<torch::ScalarType> dtype = {});
// Writes rows [offset, offset + count) of `cpu` (a ToWireLayout tensor with a wire dtype) into
// `wire`, copying the bytes once.
void EncodeRows(const torch::Tensor& cpu, int64_t offset, int64_t count, v1::Tensor* wire);
// The same without the bytes: `wire` gets the dtype and shape (its data cleared), and the bytes
// it would carry are returned where they lie in `cpu` (row_frames.h sends them from there).
struct RowBytes {
  const char* data = nullptr;
  size_t size = 0;
};
RowBytes EncodeRowsHead(const torch::Tensor& cpu, int64_t offset, int64_t count, v1::Tensor* wire);

// ----- row chunks -----

struct RowRange {
  int64_t offset = 0;
  int64_t count = 0;
};

// Default size of one streamed tensor chunk: far below gRPC's 4 MiB default message limit.
inline constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;

// Splits `rows` rows of `bytes_per_row` bytes into consecutive ranges of at most
// `max_chunk_bytes` each; a row larger than that still travels, one row per range.
std::vector<RowRange> PlanRowChunks(int64_t rows, int64_t bytes_per_row, int64_t max_chunk_bytes);

// Protobuf framing of one message beyond its tensor bytes (tags, lengths, dtype and shape
// fields, map keys), generously: with it a request's whole message stays within its limit.
int64_t FramingBytes(int64_t tensors, int64_t name_bytes);

// A request's plan: rows split so that every message, framing included, fits
// `max_message_bytes`. INVALID_ARGUMENT naming chunk_bytes when one row alone does not fit.
absl::StatusOr<std::vector<RowRange>> PlanRequestChunks(int64_t rows, int64_t bytes_per_row,
                                                        int64_t framing_bytes,
                                                        int64_t max_message_bytes);

// ----- assembly of streamed rows -----

// The rows of one tensor, streamed as TensorChunks, checked and copied into `dst` as they
// arrive: chunks come without overlaps, with dst's trailing shape and within its rows — in
// order and without gaps (kInOrder: one stream), or in any order (kAnyOrder: a step striped over
// several streams, StepHeader.stripe, whose results come back on any of them). Errors name
// `field` (e.g. "weight_rows"); a chunk of another dtype is converted to dst's when
// `convert_dtype`, refused otherwise.
class RowAssembler {
 public:
  enum class Order { kInOrder, kAnyOrder };
  RowAssembler(torch::Tensor dst, std::string field, bool convert_dtype,
               Order order = Order::kInOrder)
      : dst_(std::move(dst)),
        field_(std::move(field)),
        convert_dtype_(convert_dtype),
        order_(order) {}
  absl::Status Add(const v1::TensorChunk& chunk) { return Add(chunk.row_offset(), chunk.values()); }
  // The rows `values` from `row_offset` (a chunk of another message type, e.g. a token extra's).
  absl::Status Add(int64_t row_offset, const v1::Tensor& values);
  // The rows `values` of `dtype` would fill from `row_offset` — checked as Add checks them, from
  // their dtype and shape, their data not read — as taken: the caller copies their bytes there
  // itself (straight from the bytes received: split_rows.h).
  absl::StatusOr<torch::Tensor> Claim(int64_t row_offset, const v1::Tensor& values,
                                      torch::ScalarType dtype);
  // INVALID_ARGUMENT unless every row arrived.
  absl::Status CheckComplete() const;
  int64_t rows_received() const { return received_; }
  const torch::Tensor& tensor() const { return dst_; }

 private:
  // kAnyOrder: the first row at or after `from` that has arrived (dst's rows: none).
  int64_t FirstReceivedFrom(int64_t from) const;

  torch::Tensor dst_;
  std::string field_;
  bool convert_dtype_;
  Order order_;
  int64_t received_ = 0;
  std::map<int64_t, int64_t> ranges_;  // kAnyOrder: the rows received, [first, end) by first
};

}  // namespace remotehead::wire
