// A served LM head: the vocabulary projection W [V, D] (and optional bias [V]) on one device,
// with the gradient accumulators that every gradient-producing call adds into.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// "float32" / "fp32", "bfloat16" / "bf16", "float16" / "fp16" — the dtypes a head may hold —
// and "float64", accepted for verification (finite-difference checks), not for serving.
absl::StatusOr<torch::ScalarType> ParseHeadDtype(std::string_view name);
std::string DtypeName(torch::ScalarType dtype);

// The dtype a head's values are computed and accumulated in beyond its own precision: float64
// for a float64 head (nothing is rounded below the head's own precision), float32 for the others
// (a half-precision head's logits, outputs, dW and optimizer state are fp32). The one home of
// that rule: the logits (LogitsDtype), the per-token outputs (OutputDtype), the dW / db
// accumulators' default and the optimizer's arithmetic and state.
torch::ScalarType AccumulationDtype(torch::ScalarType head_dtype);

// Where dW / db accumulate. Kept apart from the head so a caller (e.g. the server) can
// accumulate one request into scratch buffers and commit them only when the request succeeds.
struct GradientBuffers {
  torch::Tensor weight;  // [V, D]
  torch::Tensor bias;    // [V], undefined when the head has no bias

  int64_t nbytes() const {
    return (weight.defined() ? static_cast<int64_t>(weight.nbytes()) : 0) +
           (bias.defined() ? static_cast<int64_t>(bias.nbytes()) : 0);
  }
};

struct HeadInit {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  torch::ScalarType dtype = torch::kFloat;
  bool bias = false;
  uint64_t seed = 0;
  double init_std = 0.02;  // W ~ N(0, init_std²), bias = 0 (the usual LM-head initialisation)
};

struct HeadOptions {
  torch::Device device = torch::kCPU;
  // dtype of the dW / db accumulators: unset, AccumulationDtype(the head's dtype) — float32
  // (exact accumulation over many micro-batches) for fp32 and half-precision heads, float64 for
  // a float64 head; or float32 / the head's own dtype (bf16 accumulators halve the gradient
  // memory of a bf16 head).
  std::optional<torch::ScalarType> grad_dtype;
};

// The largest head a server accepts: sizes far beyond any real vocabulary or model width are a
// caller's mistake, refused before anything is allocated.
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 24;   // 16,777,216 tokens
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 18;  // 262,144

// The bytes a head of this shape holds — W (and b) in `dtype`, dW (and db) in `grad_dtype`
// (unset: AccumulationDtype(dtype), as HeadOptions) —
// computed without overflow. INVALID_ARGUMENT naming `field_prefix` + vocab_size / hidden_size
// for a size < 1 or above the limits. The one home of a head's size: head creation checks it,
// the server reserves it in its memory budget before allocating.
absl::StatusOr<int64_t> HeadMemoryBytes(int64_t vocab_size, int64_t hidden_size,
                                        torch::ScalarType dtype, bool bias,
                                        std::optional<torch::ScalarType> grad_dtype = std::nullopt,
                                        const std::string& field_prefix = "");

class Head {
 public:
  // Takes W [V, D] and optional bias [V] (undefined tensor for none); copies them to
  // options.device in W's dtype. W must be float32, bfloat16, float16 (or float64) and finite.
  static absl::StatusOr<std::unique_ptr<Head>> FromTensors(const torch::Tensor& weight,
                                                           const torch::Tensor& bias,
                                                           const HeadOptions& options);
  // Deterministic initialisation: the same seed gives bit-identical weights on any device.
  static absl::StatusOr<std::unique_ptr<Head>> Initialize(const HeadInit& init,
                                                          const HeadOptions& options);
  // Rows [offset, offset + rows) of the head Initialize(init) makes: a head group's shard, equal
  // to those rows of a one-server head with the same seed. The whole W is drawn on the CPU (one
  // draw, so the values match) and only the shard's rows are kept and moved to the device.
  static absl::StatusOr<std::unique_ptr<Head>> InitializeRows(const HeadInit& init,
                                                              const HeadOptions& options,
                                                              int64_t offset, int64_t rows);

  int64_t vocab_size() const { return weight_.size(0); }
  int64_t hidden_size() const { return weight_.size(1); }
  torch::ScalarType dtype() const { return weight_.scalar_type(); }
  torch::Device device() const { return weight_.device(); }
  // The dW (and db) accumulators' dtype (HeadOptions::grad_dtype, resolved).
  torch::ScalarType grad_dtype() const { return grad_dtype_; }
  bool has_bias() const { return bias_.defined(); }

  const torch::Tensor& weight() const { return weight_; }
  const torch::Tensor& bias() const { return bias_; }
  // For optimizers, which update the parameters in place and then call BumpVersion().
  torch::Tensor& mutable_weight() { return weight_; }
  torch::Tensor& mutable_bias() { return bias_; }

  GradientBuffers& grads() { return grads_; }
  const GradientBuffers& grads() const { return grads_; }
  // Fresh zero buffers shaped like this head's accumulators (for per-request scratch).
  GradientBuffers NewGradientBuffers() const;
  void ZeroGrad();

  // Incremented whenever the weights change, so callers can detect stale work.
  int64_t version() const { return version_; }
  void BumpVersion() { ++version_; }
  // For a head restored from its saved training state (core/head_state.h).
  void RestoreVersion(int64_t version) { version_ = version; }

 private:
  Head(torch::Tensor weight, torch::Tensor bias, torch::ScalarType grad_dtype);

  torch::Tensor weight_;
  torch::Tensor bias_;
  torch::ScalarType grad_dtype_;
  GradientBuffers grads_;
  int64_t version_ = 0;
};

}  // namespace remotehead::core
