// A head's whole training state, as a server saves it to survive a crash and restores it at
// start: W (and b), the optimizer state (kind, step count, moments, the last step's
// hyper-parameters) and the weight version, under the id of this state.
//
// Encoded as a safetensors file (readable by Python's `safetensors`), whose metadata holds the
// scalars and a checksum of the data section: a truncated or corrupted file is detected and
// refused whole, never half-loaded.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"

namespace remotehead::core {

struct HeadState {
  std::string head_id;
  std::string state_id;  // unique per saved state
  int64_t weight_version = 0;
  torch::Tensor weight;  // [V, D] on the CPU
  torch::Tensor bias;    // [V], undefined without bias
  OptimizerState optimizer;
};

// A CPU copy of `head`'s state with `optimizer` (the caller holds whatever lock guards them).
HeadState CaptureHeadState(const std::string& head_id, const std::string& state_id,
                           const Head& head, const OptimizerState& optimizer);

// The file's bytes.
absl::StatusOr<std::string> EncodeHeadState(const HeadState& state);
// DATA_LOSS naming `source` (a path) for anything but a complete, intact head state; the
// message never contains bytes of the file.
absl::StatusOr<HeadState> DecodeHeadState(const std::string& bytes, const std::string& source);

// Puts `head` and `optimizer` back to `state`: weights, version, optimizer state (moved to the
// head's device). FAILED_PRECONDITION, changing nothing, unless the state has the head's shape,
// dtype and bias.
absl::Status ApplyHeadState(const HeadState& state, Head* head, OptimizerState* optimizer);

}  // namespace remotehead::core
