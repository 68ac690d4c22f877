// The policy losses' references (policy_reference.cc), for reference.cc's table.
#pragma once

#include "core/reference.h"

namespace remotehead::reference {

enum class PolicyLoss { kClip, kCispo, kSapo, kVespo };

// y [N] of the policy loss `kind` (the registry's grpo, cispo, sapo, vespo) from the targets'
// float64 log-probabilities `logp` [N] (the full softmax's, or the sampler's), the call's aux
// inputs (float64; sequence_ids int64; "valid" the bool mask of the rows whose target is not
// ignored), params resolved.
torch::Tensor PolicyReference(PolicyLoss kind, const torch::Tensor& logp,
                              const core::AuxTensors& aux, const core::FunctionParams& p);

}  // namespace remotehead::reference
