#include "wire.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::client::wire {

// Wire tensors are little-endian; on a little-endian host the bytes are copied as they are.
static_assert(std::endian::native == std::endian::little,
              "remotehead's client assumes a little-endian host");

namespace {

constexpr std::pair<v1::DType, torch::ScalarType> kDtypes[] = {
    {v1::DTYPE_FLOAT32, torch::kFloat}, {v1::DTYPE_BFLOAT16, torch::kBFloat16},
    {v1::DTYPE_FLOAT16, torch::kHalf},  {v1::DTYPE_FLOAT64, torch::kDouble},
    {v1::DTYPE_INT64, torch::kLong},    {v1::DTYPE_INT32, torch::kInt},
};

std::string ShapeString(const v1::Tensor& wire) {
  return absl::StrCat("[", absl::StrJoin(wire.shape(), ", "), "]");
}

}  // namespace

absl::StatusOr<v1::DType> ToWireDtype(torch::ScalarType dtype, const std::string& field) {
  for (const auto& [wire, torch_dtype] : kDtypes) {
    if (torch_dtype == dtype) return wire;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected float32, bfloat16, float16, float64, int64 or int32; got ",
                   std::string(c10::toString(dtype))));
}

absl::StatusOr<torch::ScalarType> FromWireDtype(v1::DType dtype, const std::string& field) {
  for (const auto& [wire, torch_dtype] : kDtypes) {
    if (wire == dtype) return torch_dtype;
  }
  return absl::InternalError(
      absl::StrCat(field, ".dtype: the server sent an unknown dtype ", static_cast<int>(dtype)));
}

torch::Tensor ToWireLayout(const torch::Tensor& t, std::optional<torch::ScalarType> dtype) {
  return t.detach().to(torch::kCPU, dtype.value_or(t.scalar_type())).contiguous();
}

void EncodeRows(const torch::Tensor& cpu, int64_t offset, int64_t count, v1::Tensor* wire) {
  // The dtype was checked when the tensor was prepared (ToWireDtype).
  for (const auto& [wire_dtype, torch_dtype] : kDtypes) {
    if (torch_dtype == cpu.scalar_type()) wire->set_dtype(wire_dtype);
  }
  wire->clear_shape();
  wire->add_shape(count);
  int64_t row_elements = 1;
  for (int64_t d = 1; d < cpu.dim(); ++d) {
    wire->add_shape(cpu.size(d));
    row_elements *= cpu.size(d);
  }
  const int64_t row_bytes = row_elements * static_cast<int64_t>(cpu.element_size());
  const auto* base = static_cast<const char*>(cpu.data_ptr());
  wire->set_data(base + offset * row_bytes, count * row_bytes);
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> PlanRowChunks(int64_t rows,
                                                                       int64_t bytes_per_row,
                                                                       int64_t overhead_bytes,
                                                                       int64_t max_message_bytes) {
  const int64_t room = max_message_bytes - overhead_bytes;
  if (bytes_per_row > room) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: expected room for at least one row (", bytes_per_row,
                     " bytes + ", overhead_bytes, " bytes of framing); got ", max_message_bytes));
  }
  const int64_t per_chunk = std::max<int64_t>(1, room / std::max<int64_t>(bytes_per_row, 1));
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t offset = 0; offset < rows; offset += per_chunk) {
    chunks.emplace_back(offset, std::min(per_chunk, rows - offset));
  }
  return chunks;
}

absl::Status RowAssembler::Add(const v1::TensorChunk& chunk) {
  const v1::Tensor& values = chunk.values();
  auto dtype = FromWireDtype(values.dtype(), field_);
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> expected = dst_.sizes().vec();
  const int64_t rows = values.shape_size() > 0 ? values.shape(0) : -1;
  if (!expected.empty()) expected[0] = rows;
  const bool shape_ok = rows >= 0 && std::equal(values.shape().begin(), values.shape().end(),
                                                expected.begin(), expected.end());
  if (chunk.row_offset() != next_row_ || !shape_ok || next_row_ + rows > dst_.size(0)) {
    return absl::InternalError(absl::StrCat(
        field_, ": expected rows from ", next_row_, " shaped [rows",
        dst_.dim() > 1 ? absl::StrCat(", ", absl::StrJoin(dst_.sizes().slice(1), ", ")) : "",
        "] within ", dst_.size(0), " rows; the server sent ", ShapeString(values), " at row ",
        chunk.row_offset()));
  }
  int64_t row_elements = 1;
  for (const int64_t d : dst_.sizes().slice(1)) row_elements *= d;
  const int64_t bytes = rows * row_elements * static_cast<int64_t>(c10::elementSize(*dtype));
  if (static_cast<int64_t>(values.data().size()) != bytes) {
    return absl::InternalError(absl::StrCat(field_, ": expected ", bytes, " bytes for ",
                                            ShapeString(values), "; the server sent ",
                                            values.data().size()));
  }
  torch::Tensor target = dst_.narrow(0, next_row_, rows);
  if (bytes > 0) {
    if (*dtype == dst_.scalar_type()) {
      // A row slice of a contiguous tensor is contiguous: the bytes go straight into place.
      std::memcpy(target.data_ptr(), values.data().data(), bytes);
    } else {
      const torch::Tensor decoded = torch::empty(expected, torch::TensorOptions(*dtype));
      std::memcpy(decoded.data_ptr(), values.data().data(), bytes);
      target.copy_(decoded);
    }
  }
  next_row_ += rows;
  return absl::OkStatus();
}

absl::Status RowAssembler::CheckComplete() const {
  if (next_row_ == dst_.size(0)) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(field_, ": expected ", dst_.size(0), " rows; the server sent ", next_row_));
}

}  // namespace remotehead::client::wire
