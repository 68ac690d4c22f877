// Server-side optimizer steps on a head, from its accumulated gradients: SGD (momentum, weight
// decay) and AdamW, computed and kept in the head's AccumulationDtype (fp32; float64 for a float64
// head), following torch.optim's update rules exactly.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

struct SgdOptions {
  double lr = 0;            // [0, ∞): 0 leaves the parameters as they are
  double momentum = 0;      // [0, 1)
  double weight_decay = 0;  // L2, added to the gradient (torch.optim.SGD)
};

struct AdamWOptions {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // decoupled (torch.optim.AdamW)
};

// Per-head optimizer state (AccumulationDtype of the head's dtype), created by the first step.
struct OptimizerState {
  std::string kind;  // "", "sgd" or "adamw"
  int64_t steps = 0;
  std::map<std::string, double> hyper_parameters;  // of the last step ("lr", "beta1", …)
  torch::Tensor weight_buf1, weight_buf2;          // SGD: momentum; AdamW: exp_avg, exp_avg_sq
  torch::Tensor bias_buf1, bias_buf2;
};

// What SgdStep / AdamWStep check before changing anything: INVALID_ARGUMENT for bad
// hyper-parameters or grad_scale, FAILED_PRECONDITION when the state belongs to the other
// optimizer. Lets a caller refuse a bad step before reserving memory for it.
absl::Status CheckOptimizerStep(const OptimizerState& state, const SgdOptions& options,
                                double grad_scale);
absl::Status CheckOptimizerStep(const OptimizerState& state, const AdamWOptions& options,
                                double grad_scale);

// Bytes the state's buffers hold now.
int64_t OptimizerStateBytes(const OptimizerState& state);
// Bytes the state's buffers will hold after one step with `options` on `head` (the buffers are
// created by the first step, in the head's AccumulationDtype, one per parameter for SGD with
// momentum and two for AdamW): what a server reserves before the step allocates them. The current
// bytes when the step would be refused for belonging to the other optimizer.
int64_t OptimizerStateBytesAfterStep(const Head& head, const OptimizerState& state,
                                     const SgdOptions& options);
int64_t OptimizerStateBytesAfterStep(const Head& head, const OptimizerState& state,
                                     const AdamWOptions& options);

// p ← update(p, grad · grad_scale); bumps the head's version. INVALID_ARGUMENT for bad
// hyper-parameters, FAILED_PRECONDITION when the state belongs to the other optimizer.
// Parameters of a half-precision head are updated in fp32 and rounded back once; a float64
// head's in float64. lr 0 is accepted (the state advances, the parameters stay), as torch.optim.
absl::Status SgdStep(Head& head, const SgdOptions& options, double grad_scale,
                     OptimizerState* state);
absl::Status AdamWStep(Head& head, const AdamWOptions& options, double grad_scale,
                       OptimizerState* state);

}  // namespace remotehead::core
