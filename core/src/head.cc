#include "remotehead/core/head.h"

#include <string>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/device.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace {

// float64 is accepted for verification (finite-difference checks); serving uses the others.
bool IsHeadDtype(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf || t == torch::kDouble;
}

}  // namespace

absl::StatusOr<torch::ScalarType> ParseHeadDtype(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "float32" || n == "fp32" || n == "float") return torch::kFloat;
  if (n == "bfloat16" || n == "bf16") return torch::kBFloat16;
  if (n == "float16" || n == "fp16" || n == "half") return torch::kHalf;
  if (n == "float64" || n == "fp64" || n == "double") return torch::kDouble;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: expected one of float32, bfloat16, float16, float64; got \"",
                   std::string(name), "\""));
}

std::string DtypeName(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat:
      return "float32";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kHalf:
      return "float16";
    case torch::kDouble:
      return "float64";
    case torch::kLong:
      return "int64";
    case torch::kInt:
      return "int32";
    case torch::kBool:
      return "bool";
    default:
      return c10::toString(dtype);
  }
}

torch::ScalarType AccumulationDtype(torch::ScalarType head_dtype) {
  return head_dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
}

Head::Head(torch::Tensor weight, torch::Tensor bias, torch::ScalarType grad_dtype)
    : weight_(std::move(weight)), bias_(std::move(bias)), grad_dtype_(grad_dtype) {
  grads_ = NewGradientBuffers();
}

GradientBuffers Head::NewGradientBuffers() const {
  const auto opts = torch::TensorOptions().dtype(grad_dtype_).device(weight_.device());
  GradientBuffers g;
  g.weight = torch::zeros(weight_.sizes(), opts);
  if (bias_.defined()) g.bias = torch::zeros(bias_.sizes(), opts);
  return g;
}

void Head::ZeroGrad() {
  grads_.weight.zero_();
  if (grads_.bias.defined()) grads_.bias.zero_();
}

namespace {

// INVALID_ARGUMENT naming `field` unless the accumulators' dtype is float32 or the head's own.
absl::Status CheckGradDtype(torch::ScalarType dtype, std::optional<torch::ScalarType> grad_dtype,
                            const std::string& field) {
  const torch::ScalarType g = grad_dtype.value_or(AccumulationDtype(dtype));
  if (g == torch::kFloat || g == dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected float32 or the head's dtype (",
                                                 DtypeName(dtype), "); got ", DtypeName(g)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Head>> Head::FromTensors(const torch::Tensor& weight,
                                                        const torch::Tensor& bias,
                                                        const HeadOptions& options) {
  torch::NoGradGuard no_grad;
  if (!weight.defined() || weight.dim() != 2 || weight.size(0) < 1 || weight.size(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: expected a 2-D tensor [vocab_size, hidden_size] with both sizes >= 1; got ",
        weight.defined() ? c10::str(weight.sizes()) : std::string("no tensor")));
  }
  if (!IsHeadDtype(weight.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight.dtype: expected float32, bfloat16, float16 or float64; got ",
                     DtypeName(weight.scalar_type())));
  }
  RETURN_IF_ERROR(CheckGradDtype(weight.scalar_type(), options.grad_dtype, "grad_dtype"));
  const torch::ScalarType grad_dtype =
      options.grad_dtype.value_or(AccumulationDtype(weight.scalar_type()));
  if (bias.defined()) {
    if (bias.dim() != 1 || bias.size(0) != weight.size(0)) {
      return absl::InvalidArgumentError(absl::StrCat("bias: expected shape [", weight.size(0),
                                                     "]; got ", c10::str(bias.sizes())));
    }
  }
  if (!torch::isfinite(weight).all().item<bool>()) {
    return absl::InvalidArgumentError("weight: expected finite values; got NaN or Inf");
  }
  if (bias.defined() && !torch::isfinite(bias).all().item<bool>()) {
    return absl::InvalidArgumentError("bias: expected finite values; got NaN or Inf");
  }
  RETURN_IF_ERROR(CheckDeviceOnMachine(options.device, "device"));
  const auto opts = torch::TensorOptions().dtype(weight.scalar_type()).device(options.device);
  torch::Tensor w = weight.detach().to(opts, /*non_blocking=*/false, /*copy=*/true).contiguous();
  torch::Tensor b;
  if (bias.defined()) b = bias.detach().to(opts, false, true).contiguous();
  return std::unique_ptr<Head>(new Head(std::move(w), std::move(b), grad_dtype));
}

absl::StatusOr<int64_t> HeadMemoryBytes(int64_t vocab_size, int64_t hidden_size,
                                        torch::ScalarType dtype, bool bias,
                                        std::optional<torch::ScalarType> grad_dtype,
                                        const std::string& field_prefix) {
  if (vocab_size < 1 || hidden_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(field_prefix, "vocab_size, ", field_prefix,
                                                   "hidden_size: expected >= 1; got ", vocab_size,
                                                   ", ", hidden_size));
  }
  for (const auto& [name, value, limit] :
       {std::tuple{"vocab_size", vocab_size, kMaxVocabSize},
        std::tuple{"hidden_size", hidden_size, kMaxHiddenSize}}) {
    if (value > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_prefix, name, ": expected at most ", limit, "; got ", value));
    }
  }
  if (IsHeadDtype(dtype)) {
    RETURN_IF_ERROR(CheckGradDtype(dtype, grad_dtype, absl::StrCat(field_prefix, "grad_dtype")));
  }
  // Within the limits V·D < 2^42, so nothing below can overflow; checked all the same.
  const int64_t per_row =
      static_cast<int64_t>(c10::elementSize(dtype)) +
      static_cast<int64_t>(c10::elementSize(grad_dtype.value_or(AccumulationDtype(dtype))));
  int64_t elements = 0, bytes = 0;
  if (__builtin_mul_overflow(vocab_size, hidden_size + (bias ? 1 : 0), &elements) ||
      __builtin_mul_overflow(elements, per_row, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(field_prefix, "vocab_size × ", field_prefix,
                                                   "hidden_size: ", vocab_size, " × ", hidden_size,
                                                   " overflows a byte count"));
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<Head>> Head::Initialize(const HeadInit& init,
                                                       const HeadOptions& options) {
  return InitializeRows(init, options, 0, init.vocab_size);
}

absl::StatusOr<std::unique_ptr<Head>> Head::InitializeRows(const HeadInit& init,
                                                           const HeadOptions& options,
                                                           int64_t offset, int64_t rows) {
  RETURN_IF_ERROR(
      HeadMemoryBytes(init.vocab_size, init.hidden_size, init.dtype, init.bias, options.grad_dtype)
          .status());
  if (!(init.init_std > 0) || !std::isfinite(init.init_std)) {
    return absl::InvalidArgumentError(
        absl::StrCat("init_std: expected a finite value > 0; got ", init.init_std));
  }
  if (!IsHeadDtype(init.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype: expected float32, bfloat16, float16 or float64; got ", DtypeName(init.dtype)));
  }
  if (offset < 0 || rows < 1 || offset + rows > init.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("rows: expected a range within [0, ",
                                                   init.vocab_size, "); got [", offset, ", ",
                                                   offset + rows, ")"));
  }
  torch::NoGradGuard no_grad;
  // Generated on the CPU in float32 so the values do not depend on the target device.
  auto gen = at::detail::createCPUGenerator(init.seed);
  torch::Tensor w = at::normal(0.0, init.init_std, {init.vocab_size, init.hidden_size}, gen);
  // A copy of the rows, so that the whole draw is freed here.
  if (rows != init.vocab_size) w = w.narrow(0, offset, rows).clone();
  w = w.to(init.dtype);
  torch::Tensor b;
  if (init.bias) b = torch::zeros({rows}, torch::TensorOptions().dtype(init.dtype));
  return FromTensors(w, b, options);
}

}  // namespace remotehead::core
