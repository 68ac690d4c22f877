// A head's whole training state, as a server saves it to survive a crash and restores it at
// start: W (and b), the optimizer state (kind, step count, moments, the last step's
// hyper-parameters) and the weight version, under the id of this state.
//
// Encoded as a safetensors file (readable by Python's `safetensors`), whose metadata holds the
// scalars and a checksum of the data section: a truncated or corrupted file is detected and
// refused whole, never half-loaded.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

struct HeadState {
  std::string head_id;
  std::string state_id;  // unique per saved state
  int64_t weight_version = 0;
  // Which rows of the head these are: a head group's rank saves its shard, rows
  // [vocab_offset, vocab_offset + weight.size(0)) of a head of vocab_size rows. 0 and 0: the
  // whole head (one server; also what a file without them means).
  int64_t vocab_offset = 0;
  int64_t vocab_size = 0;
  // A frozen head (a distillation teacher, a reference): restored frozen. Absent in files
  // written before frozen heads existed: false.
  bool frozen = false;
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

// FAILED_PRECONDITION (field "state_id") unless `state` holds rows [offset, offset + its rows)
// of a head of `vocab_size` rows: a head group's rank restores only its own shard, of a head of
// the same size.
absl::Status CheckHeadStateRows(const HeadState& state, int64_t vocab_size, int64_t offset);
// FAILED_PRECONDITION unless the state has `head`'s shape, dtype and bias.
absl::Status CheckHeadStateFits(const HeadState& state, const Head& head);

// Puts `head` and `optimizer` back to `state`: weights, version, optimizer state (moved to the
// head's device). FAILED_PRECONDITION, changing nothing, unless the state has the head's shape,
// dtype and bias.
absl::Status ApplyHeadState(const HeadState& state, Head* head, OptimizerState* optimizer);

}  // namespace remotehead::core
