// One engine call of a step request (core/engine.h) in one of the three modes, and what it
// produced: what StepSession runs for each batch of rows, and what every rank of a head group
// runs on its shard for the front's step commands (group/group_steps.h).
#pragma once

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::server {

// What one engine call produced.
struct EngineOutputs {
  // Fused, or a forward with a scalar reduction: the loss, 0-d float64 on the head's device
  // (StepOptions::loss_on_device: read once per request, not once per batch).
  torch::Tensor loss;
  torch::Tensor grad_hidden;       // fused / backward (a group: on the front only)
  torch::Tensor outputs;           // forward with reduction NONE
  torch::Tensor token_ids;         // forward with function "sample"
  core::TokenExtras token_extras;  // StepOptions::token_extras, any mode
  core::StepStats stats;
};
// One engine call in `mode` (core/engine.h); what every rank runs on a group.
absl::StatusOr<EngineOutputs> RunEngine(core::CallMode mode, const core::Head& head,
                                        const core::TokenBatch& batch,
                                        const core::StepOptions& options,
                                        const torch::Tensor& grad_output,
                                        core::GradientBuffers* grads);

}  // namespace remotehead::server
