// Transformation functions: what the head computes from one chunk of fp32 logits.
//
// Each function is plain *forward* LibTorch code mapping logits [n, V] (fp32, already
// soft-capped and divided by the temperature) and per-token inputs to per-token outputs [n].
// No derivative is ever written by hand: the engine differentiates the forward with autograd,
// chunk by chunk. Adding a function is one entry in BuiltinFunctions() in functions.cc.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/token_batch.h"

namespace remotehead::core {

// Scalar options of a function, by name (e.g. {"label_smoothing", 0.1}). Defaults are filled
// in and ranges checked by FunctionRegistry::ResolveParams before a function ever runs.
using FunctionParams = std::map<std::string, double>;

struct ChunkInputs {
  torch::Tensor logits;   // [n, V] fp32, requires grad when gradients are wanted
  torch::Tensor targets;  // [n] int64 in [0, V): ignored positions hold 0 (the engine masks
                          // them out afterwards); undefined if the batch carries no targets
  AuxTensors aux;         // [n] fp32 slices of the per-token inputs
  const FunctionParams* params = nullptr;

  double param(const std::string& name) const { return params->at(name); }
};

struct FunctionOutput {
  torch::Tensor per_token;  // [n] fp32, differentiable w.r.t. logits: what is reduced to the loss
  // Per-token diagnostics (detached), reported as sums over valid tokens, e.g. "z_loss".
  std::map<std::string, torch::Tensor> extras;
};

struct ParamSpec {
  std::string name;
  double default_value;
  double min_value;  // inclusive
  double max_value;  // inclusive
  std::string help;
};

struct TransformFunction {
  std::string name;
  std::string help;
  bool needs_targets = true;
  std::vector<std::string> required_aux;
  std::vector<std::string> optional_aux;
  std::vector<ParamSpec> params;
  // How many fp32 [n, V] buffers the forward plus its autograd backward keep alive at the peak
  // (logits and their gradient not included); used to derive chunk rows from a memory budget.
  // Measured, not guessed: tests/core/memory_budget_test.cc fails if the real peak exceeds it.
  double workspace_logit_buffers = 2.0;
  std::function<FunctionOutput(const ChunkInputs&)> forward;
  // Optional cross-field check run before any compute (e.g. GRPO's beta > 0 needs ref_logprobs).
  std::function<absl::Status(const FunctionParams&, const AuxTensors&)> validate;
};

// Options every function accepts; the engine applies them to the logits before the function:
// softcap > 0 gives z ← softcap·tanh(z / softcap) (Gemma-style), then z ← z / temperature.
inline constexpr char kTemperatureParam[] = "temperature";
inline constexpr char kSoftcapParam[] = "softcap";

class FunctionRegistry {
 public:
  // The built-in functions: cross_entropy, token_logprobs, entropy, grpo, mse_onehot,
  // sigmoid_sum.
  static const FunctionRegistry& Builtin();

  absl::StatusOr<const TransformFunction*> Find(const std::string& name) const;
  std::vector<std::string> Names() const;

  // Checks every given param is known, finite and in range; returns the complete set with
  // defaults filled in (the common temperature / softcap included).
  absl::StatusOr<FunctionParams> ResolveParams(const TransformFunction& fn,
                                               const FunctionParams& given) const;

 private:
  std::map<std::string, TransformFunction> functions_;
};

}  // namespace remotehead::core
