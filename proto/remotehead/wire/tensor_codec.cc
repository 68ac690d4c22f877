#include "remotehead/wire/tensor_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::wire {

// Wire tensors are little-endian; on a little-endian host the bytes are copied as they are.
static_assert(std::endian::native == std::endian::little,
              "remotehead's tensor codec assumes a little-endian host");

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

absl::StatusOr<torch::ScalarType> FromWireDtype(v1::DType dtype, const std::string& field) {
  for (const auto& [wire, torch_dtype] : kDtypes) {
    if (wire == dtype) return torch_dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".dtype: expected one of FLOAT32, BFLOAT16, FLOAT16, FLOAT64, INT64, INT32; got ",
      v1::DType_IsValid(dtype) ? v1::DType_Name(dtype) : std::to_string(dtype)));
}

absl::StatusOr<v1::DType> ToWireDtype(torch::ScalarType dtype, const std::string& field) {
  for (const auto& [wire, torch_dtype] : kDtypes) {
    if (torch_dtype == dtype) return wire;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected float32, bfloat16, float16, float64, int64 or int32; got ",
                   std::string(c10::toString(dtype))));
}

absl::StatusOr<torch::ScalarType> CheckTensor(const v1::Tensor& wire, size_t data_bytes,
                                              const std::string& field) {
  auto dtype = FromWireDtype(wire.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  const std::vector<int64_t> shape(wire.shape().begin(), wire.shape().end());
  const int64_t elem = static_cast<int64_t>(c10::elementSize(*dtype));
  int64_t numel = 1;
  int64_t extent = 1;  // the product of the sizes with zeros counted as 1
  for (const int64_t dim : shape) {
    // Bounded so that numel · elem cannot overflow before it is compared with the byte count,
    // and (extent) so that an empty tensor's strides cannot either: found by the fuzzers,
    // [0, 2^40, 2^40] made torch::empty throw "Stride calculation overflowed".
    if (dim < 0 || (dim > 0 && extent > std::numeric_limits<int32_t>::max() / dim)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape: expected non-negative sizes with fewer than 2^31 elements; got [",
          absl::StrJoin(shape, ", "), "]"));
    }
    numel *= dim;
    extent *= std::max<int64_t>(dim, 1);
  }
  const int64_t expected_bytes = numel * elem;
  if (static_cast<int64_t>(data_bytes) != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected ", expected_bytes, " bytes for ", c10::toString(*dtype),
                     " [", absl::StrJoin(shape, ", "), "]; got ", data_bytes));
  }
  return *dtype;
}

absl::StatusOr<torch::Tensor> DecodeTensorView(const v1::Tensor& wire, const std::string& field) {
  auto dtype = CheckTensor(wire, wire.data().size(), field);
  if (!dtype.ok()) return dtype.status();
  const std::vector<int64_t> shape(wire.shape().begin(), wire.shape().end());
  if (wire.data().empty()) return torch::empty(shape, torch::TensorOptions().dtype(*dtype));
  // Read-only use by the caller; the bytes are little-endian like every host we build for.
  return torch::from_blob(const_cast<char*>(wire.data().data()), shape,
                          torch::TensorOptions().dtype(*dtype));
}

absl::StatusOr<torch::Tensor> DecodeTensor(const v1::Tensor& wire, const std::string& field) {
  auto view = DecodeTensorView(wire, field);
  if (!view.ok()) return view.status();
  return view->clone();
}

torch::Tensor ToWireLayout(const torch::Tensor& t, std::optional<torch::ScalarType> dtype) {
  return t.detach().to(torch::kCPU, dtype.value_or(t.scalar_type())).contiguous();
}

RowBytes EncodeRowsHead(const torch::Tensor& cpu, int64_t offset, int64_t count, v1::Tensor* wire) {
  // The dtype was checked when the tensor was prepared (ToWireDtype).
  for (const auto& [wire_dtype, torch_dtype] : kDtypes) {
    if (torch_dtype == cpu.scalar_type()) wire->set_dtype(wire_dtype);
  }
  wire->clear_shape();
  wire->clear_data();
  const auto* base = static_cast<const char*>(cpu.data_ptr());
  if (cpu.dim() == 0) return {base, static_cast<size_t>(cpu.element_size())};
  wire->add_shape(count);
  int64_t row_elements = 1;
  for (int64_t d = 1; d < cpu.dim(); ++d) {
    wire->add_shape(cpu.size(d));
    row_elements *= cpu.size(d);
  }
  const int64_t row_bytes = row_elements * static_cast<int64_t>(cpu.element_size());
  if (row_bytes * count == 0) return {nullptr, 0};
  return {base + offset * row_bytes, static_cast<size_t>(count * row_bytes)};
}

void EncodeRows(const torch::Tensor& cpu, int64_t offset, int64_t count, v1::Tensor* wire) {
  const RowBytes bytes = EncodeRowsHead(cpu, offset, count, wire);
  if (bytes.size > 0) wire->set_data(bytes.data, bytes.size);
}

absl::Status EncodeTensor(const torch::Tensor& tensor, v1::Tensor* wire) {
  auto dtype = ToWireDtype(tensor.scalar_type(), "tensor");
  if (!dtype.ok()) return dtype.status();
  const torch::Tensor cpu = ToWireLayout(tensor);
  EncodeRows(cpu, 0, cpu.dim() == 0 ? 1 : cpu.size(0), wire);
  return absl::OkStatus();
}

std::vector<RowRange> PlanRowChunks(int64_t rows, int64_t bytes_per_row, int64_t max_chunk_bytes) {
  const int64_t per_chunk =
      std::max<int64_t>(1, max_chunk_bytes / std::max<int64_t>(bytes_per_row, 1));
  std::vector<RowRange> chunks;
  for (int64_t offset = 0; offset < rows; offset += per_chunk) {
    chunks.push_back({offset, std::min(per_chunk, rows - offset)});
  }
  return chunks;
}

int64_t FramingBytes(int64_t tensors, int64_t name_bytes) { return 64 + 64 * tensors + name_bytes; }

absl::StatusOr<std::vector<RowRange>> PlanRequestChunks(int64_t rows, int64_t bytes_per_row,
                                                        int64_t framing_bytes,
                                                        int64_t max_message_bytes) {
  const int64_t room = max_message_bytes - framing_bytes;
  if (bytes_per_row > room) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: expected room for at least one row (", bytes_per_row,
                     " bytes + ", framing_bytes, " bytes of framing); got ", max_message_bytes));
  }
  return PlanRowChunks(rows, bytes_per_row, room);
}

absl::Status RowAssembler::Add(int64_t row_offset, const v1::Tensor& values) {
  // The values as a view of the message (checks dtype, shape and byte count).
  auto decoded = DecodeTensorView(values, field_ + ".values");
  if (!decoded.ok()) return decoded.status();
  absl::StatusOr<torch::Tensor> rows = Claim(row_offset, values, decoded->scalar_type());
  if (!rows.ok()) return rows.status();
  if (rows->numel() > 0) rows->copy_(*decoded);
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> RowAssembler::Claim(int64_t row_offset, const v1::Tensor& values,
                                                  torch::ScalarType dtype) {
  const bool in_order = order_ == Order::kInOrder;
  if (in_order && row_offset != received_) {
    return absl::InvalidArgumentError(absl::StrCat(field_, ".row_offset: expected ", received_,
                                                   " (rows arrive in order); got ", row_offset));
  }
  if (!in_order && (row_offset < 0 || row_offset > dst_.size(0))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_, ".row_offset: expected 0 to ", dst_.size(0), "; got ", row_offset));
  }
  // The trailing shape and the rows from row_offset: within dst, none of them received already.
  const std::vector<int64_t> shape(values.shape().begin(), values.shape().end());
  std::vector<int64_t> expected = dst_.sizes().vec();
  const int64_t rows = shape.empty() ? -1 : shape[0];
  if (!expected.empty()) expected[0] = rows;
  const bool dtype_ok = convert_dtype_ || dtype == dst_.scalar_type();
  const int64_t room =
      in_order ? dst_.size(0) - received_ : FirstReceivedFrom(row_offset) - row_offset;
  if (!dtype_ok || rows < 0 || shape != expected || rows > room) {
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ".values: expected ",
        convert_dtype_ ? "" : absl::StrCat(std::string(c10::toString(dst_.scalar_type())), " "),
        "[rows",
        dst_.dim() > 1 ? absl::StrCat(", ", absl::StrJoin(dst_.sizes().slice(1), ", ")) : "",
        "] within the ", room, in_order ? " rows left of " : " rows not yet received of ",
        dst_.size(0), "; got ", std::string(c10::toString(dtype)), " ", ShapeString(values),
        " at row ", row_offset));
  }
  if (!in_order && rows > 0) ranges_[row_offset] = row_offset + rows;
  received_ += rows;
  return dst_.narrow(0, row_offset, rows);
}

int64_t RowAssembler::FirstReceivedFrom(int64_t from) const {
  // The range starting before `from` may reach past it; else the next range's first row.
  auto next = ranges_.upper_bound(from);
  if (next != ranges_.begin() && std::prev(next)->second > from) return from;
  return next == ranges_.end() ? dst_.size(0) : next->first;
}

absl::Status RowAssembler::CheckComplete() const {
  if (received_ == dst_.size(0)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field_, ": expected ", dst_.size(0), " rows; got ", received_));
}

}  // namespace remotehead::wire
