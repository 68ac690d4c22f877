#include "remotehead/server/tensor_codec.h"

#include <bit>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::server {

// Wire tensors are little-endian; on a little-endian host the bytes are copied as they are.
static_assert(std::endian::native == std::endian::little,
              "remotehead's tensor codec assumes a little-endian host");

namespace {

// The one table of wire dtypes and their LibTorch counterparts.
constexpr std::pair<v1::DType, torch::ScalarType> kDtypes[] = {
    {v1::DTYPE_FLOAT32, torch::kFloat}, {v1::DTYPE_BFLOAT16, torch::kBFloat16},
    {v1::DTYPE_FLOAT16, torch::kHalf},  {v1::DTYPE_FLOAT64, torch::kDouble},
    {v1::DTYPE_INT64, torch::kLong},    {v1::DTYPE_INT32, torch::kInt},
};

}  // namespace

absl::StatusOr<torch::ScalarType> FromWireDtype(v1::DType dtype, const std::string& field) {
  for (const auto& [wire, torch_dtype] : kDtypes) {
    if (wire == dtype) return torch_dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".dtype: expected one of FLOAT32, BFLOAT16, FLOAT16, FLOAT64, INT64, INT32; got ",
      v1::DType_IsValid(dtype) ? v1::DType_Name(dtype) : std::to_string(dtype)));
}

absl::StatusOr<v1::DType> ToWireDtype(torch::ScalarType dtype) {
  for (const auto& [wire, torch_dtype] : kDtypes) {
    if (torch_dtype == dtype) return wire;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: ", c10::toString(dtype), " has no wire representation"));
}

absl::StatusOr<torch::Tensor> DecodeTensorView(const v1::Tensor& wire, const std::string& field) {
  auto dtype = FromWireDtype(wire.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> shape(wire.shape().begin(), wire.shape().end());
  const int64_t elem = static_cast<int64_t>(c10::elementSize(*dtype));
  int64_t numel = 1;
  for (const int64_t dim : shape) {
    // Bounded so that numel · elem cannot overflow before it is compared with the byte count.
    if (dim < 0 || (dim > 0 && numel > std::numeric_limits<int32_t>::max() / dim)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape: expected non-negative sizes with fewer than 2^31 elements; got [",
          absl::StrJoin(shape, ", "), "]"));
    }
    numel *= dim;
  }
  const int64_t expected_bytes = numel * elem;
  if (static_cast<int64_t>(wire.data().size()) != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected ", expected_bytes, " bytes for ", c10::toString(*dtype),
                     " [", absl::StrJoin(shape, ", "), "]; got ", wire.data().size()));
  }
  if (expected_bytes == 0) return torch::empty(shape, torch::TensorOptions().dtype(*dtype));
  // Read-only use by the caller; the bytes are little-endian like every host we build for.
  return torch::from_blob(const_cast<char*>(wire.data().data()), shape,
                          torch::TensorOptions().dtype(*dtype));
}

absl::StatusOr<torch::Tensor> DecodeTensor(const v1::Tensor& wire, const std::string& field) {
  auto view = DecodeTensorView(wire, field);
  if (!view.ok()) return view.status();
  return view->clone();
}

absl::Status EncodeTensor(const torch::Tensor& tensor, v1::Tensor* wire) {
  auto dtype = ToWireDtype(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  const torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
  wire->set_dtype(*dtype);
  wire->clear_shape();
  for (const int64_t dim : cpu.sizes()) wire->add_shape(dim);
  wire->set_data(cpu.data_ptr(), cpu.numel() * cpu.element_size());
  return absl::OkStatus();
}

std::vector<std::pair<int64_t, int64_t>> PlanRowChunks(int64_t rows, int64_t bytes_per_row,
                                                       int64_t max_chunk_bytes) {
  const int64_t per_chunk =
      std::max<int64_t>(1, max_chunk_bytes / std::max<int64_t>(bytes_per_row, 1));
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t offset = 0; offset < rows; offset += per_chunk) {
    chunks.emplace_back(offset, std::min(per_chunk, rows - offset));
  }
  return chunks;
}

}  // namespace remotehead::server
