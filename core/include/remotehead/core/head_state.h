// A head's whole training state, as a server saves it to survive a crash and restores it at
// start: W (and b), the optimizer state (kind, step count, moments, the last step's
// hyper-parameters) and the weight version, under the id of this state.
//
// Encoded as a safetensors file (readable by Python's `safetensors`), whose metadata holds the
// scalars and a checksum of the data section: a truncated or corrupted file is detected and
// refused whole, never half-loaded. With a state secret the file is also sealed: metadata "mac"
// holds an HMAC-SHA256 (core/mac.h) under the secret of what the checksum covers, so that a file
// whoever can write the state directory made (the checksum is no secret) is refused too.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
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
  // The dW (and db) accumulators' dtype (HeadOptions::grad_dtype): restored with it. Absent in
  // files of heads with the default accumulators (and in those written before it was kept).
  std::optional<torch::ScalarType> grad_dtype;
  torch::Tensor weight;  // [V, D] on the CPU
  torch::Tensor bias;    // [V], undefined without bias
  OptimizerState optimizer;
};

// A CPU copy of `head`'s state with `optimizer` (the caller holds whatever lock guards them).
HeadState CaptureHeadState(const std::string& head_id, const std::string& state_id,
                           const Head& head, const OptimizerState& optimizer);

// The key that seals a server's head states, and where it came from (named in the messages of a
// state that does not verify, e.g. "--state_secret_file"). An empty secret seals nothing: states
// are saved without a seal and loaded on their checksum alone.
struct StateSecret {
  std::string secret;
  std::string origin;
};

// The file's bytes, sealed under `secret` unless it is empty.
absl::StatusOr<std::string> EncodeHeadState(const HeadState& state, const StateSecret& secret);
// DATA_LOSS naming `source` (a path) for anything but a complete, intact head state; with a
// secret, then PERMISSION_DENIED naming `source` and the secret's origin for an intact state that
// does not verify under it: one with no seal (saved unsealed, or made by hand) or with a seal
// that does not verify (forged, or sealed under another secret). Without a secret, a seal is not
// checked. The message never contains bytes of the file.
absl::StatusOr<HeadState> DecodeHeadState(const std::string& bytes, const std::string& source,
                                          const StateSecret& secret);

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
