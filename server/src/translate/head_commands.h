// The head commands a head group or mesh replicates, typed: one struct per operation, holding
// the arguments of the HeadOperations call it is (replication/apply_head_command.h applies
// them), and the one home of their encoding in the group's log (remotehead/v1/head_group.proto).
//
// The front builds a command from its caller's arguments, logs its encoding and applies the
// command itself; every other rank decodes the log's bytes into the same struct and applies it
// through the same function. Tensors (an upload's weights, an embedding's ids and rows) are not
// encoded: the command carries their shapes, and each rank's part of the operation shares the
// front's values into them (HeadGroup::Share). Decoded, they are uninitialised tensors of those
// shapes on the rank's device.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>

#include "absl/status/statusor.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/service/head_description.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/v1/head_group.pb.h"
#include "service/head_requests.h"

namespace remotehead::server {
namespace head_command {

// Each struct's Result is what its HeadOperations call returns (std::monostate: a status only).
struct CreateFromSeed {
  using Result = HeadDescription;
  std::string id;
  core::HeadInit init;
  HeadTraits traits;
};
struct CreateFromSafetensors {
  using Result = HeadDescription;
  std::string id;
  SafetensorsSource source;
  HeadTraits traits;
};
struct Upload {
  using Result = HeadDescription;
  std::string id;
  torch::Tensor weight;
  torch::Tensor bias;  // undefined: none
  bool replace = false;
  HeadTraits traits;
};
struct Drop {
  using Result = std::monostate;
  std::string id;
};
// A failed creation undone: the head dropped wherever it was made.
struct UndoCreate {
  using Result = std::monostate;
  std::string id;
};
struct ZeroGradients {
  using Result = HeadDescription;
  std::string id;
};
struct OptimizerStep {
  using Result = HeadDescription;
  std::string id;
  OptimizerStepSpec spec;
};
// A mesh replica's part of the mesh's step (dW summed over the replicas, the commit decision of
// the step `attempt` of the mesh's epoch `epoch`, then the step).
struct ReduceStep {
  using Result = HeadDescription;
  std::string id;
  OptimizerStepSpec spec;
  std::string attempt;
  int epoch = 0;
};
// A replica admitted again to the mesh in `epoch` healed (HeadOperations::Heal).
struct Heal {
  using Result = std::monostate;
  int epoch = 0;
  int replica = -1;
};
struct SaveState {
  using Result = HeadDescription;
  std::string id;
  std::string state_id;
};
// `check_only`: every rank only checks that it could restore the state.
struct RestoreState {
  using Result = HeadDescription;
  std::string id;
  std::string state_id;
  bool check_only = false;
};
// The weights (dW with `gradients`) gathered on the front, in `dtype` (unset: as stored).
struct Gather {
  using Result = HeadSnapshot;
  std::string id;
  std::optional<torch::ScalarType> dtype;
  bool gradients = false;
};
struct EmbeddingLookup {
  using Result = HeadSnapshot;
  std::string id;
  torch::Tensor ids;
  std::optional<torch::ScalarType> dtype;
};
struct EmbeddingGradient {
  using Result = EmbeddingGradientOutcome;
  std::string id;
  torch::Tensor ids;
  torch::Tensor rows;
  GradientKey key;
  std::optional<int64_t> expected_weight_version;
  // The field a version mismatch names: the caller's on the front (not encoded; every other
  // rank names the header's).
  std::string version_field = "header.expected_weight_version";
};

}  // namespace head_command

using HeadCommand =
    std::variant<head_command::CreateFromSeed, head_command::CreateFromSafetensors,
                 head_command::Upload, head_command::Drop, head_command::UndoCreate,
                 head_command::ZeroGradients, head_command::OptimizerStep, head_command::ReduceStep,
                 head_command::Heal, head_command::SaveState, head_command::RestoreState,
                 head_command::Gather, head_command::EmbeddingLookup,
                 head_command::EmbeddingGradient>;

// What applying a head command returned (its struct's Result).
using HeadCommandResult =
    std::variant<std::monostate, HeadDescription, HeadSnapshot, EmbeddingGradientOutcome>;

// `command` as the group's log carries it.
v1::GroupCommand Encode(const HeadCommand& command);
// A log entry back into its command, tensors uninitialised on `device`; INTERNAL for an entry
// that is no head command (a step's, the drain's, the front's address: another follower's),
// INVALID_ARGUMENT for dtypes that do not decode.
absl::StatusOr<HeadCommand> DecodeHeadCommand(const v1::GroupCommand& entry, torch::Device device);
// The mesh's dW summed on the leader: a gather of dW that every replica's front runs as its own
// (MeshFollower; IsHeadCommand is false for it), not relayed to its replica's ranks.
v1::GroupCommand MeshGradientsCommand(const std::string& id);
// Whether `entry` is a head command (DecodeHeadCommand takes it).
bool IsHeadCommand(const v1::GroupCommand& entry);

}  // namespace remotehead::server
