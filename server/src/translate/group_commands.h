// The head commands of a head group (remotehead/v1/head_group.proto): built on the front from
// the operations' own arguments, turned back into the same calls on the other ranks
// (replication/group_follower.h). The one home of their encoding, and of how the group's
// transport (group/head_group.h, which carries bytes) carries them; a request's engine calls are
// replication/group_steps.h's.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "head_requests.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/v1/head_group.pb.h"

namespace remotehead::server {

enum class HeadCommandKind { kDrop, kZeroGradients };

// `traits`: the head is created with them on every rank (frozen, its gradient dtype).
v1::GroupCommand CreateCommand(const std::string& id, const core::HeadInit& init,
                               const HeadTraits& traits);
v1::GroupCommand CreateCommand(const std::string& id, const SafetensorsSource& source,
                               const HeadTraits& traits);
// The tensors follow by broadcast (HeadGroup::Share): the command carries their shapes.
v1::GroupCommand UploadCommand(const std::string& id, const torch::Tensor& weight,
                               const torch::Tensor& bias, bool replace, const HeadTraits& traits);
v1::GroupCommand UndoCreateCommand(const std::string& id);
v1::GroupCommand HeadCommand(HeadCommandKind kind, const std::string& id);
v1::GroupCommand OptimizerStepCommand(const std::string& id, const OptimizerStepSpec& spec);
// A mesh replica's part of the mesh's step (dW summed over the replicas, then the step).
v1::GroupCommand ReduceStepCommand(const std::string& id, const OptimizerStepSpec& spec);
// A head's state saved (restored) on every rank under `state_id`; `check_only`: every rank only
// checks that it could restore it.
v1::GroupCommand SaveStateCommand(const std::string& id, const std::string& state_id);
v1::GroupCommand RestoreStateCommand(const std::string& id, const std::string& state_id,
                                     bool check_only);
// A tied embedding's lookup of `ids` (in `dtype`; unset: the head's) and its gradient `rows`
// under `key`, on every rank; `ids` and `rows` follow by broadcast (HeadGroup::Share).
v1::GroupCommand EmbeddingLookupCommand(const std::string& id, const torch::Tensor& ids,
                                        std::optional<torch::ScalarType> dtype);
v1::GroupCommand EmbeddingGradientCommand(const std::string& id, const torch::Tensor& ids,
                                          const torch::Tensor& rows, const GradientKey& key,
                                          std::optional<int64_t> expected_weight_version);
// What EmbeddingGradientCommand carries, read back on another rank.
GradientKey EmbeddingGradientKey(const v1::GroupEmbedding& embedding);
v1::GroupCommand MeshGradientsCommand(const std::string& id);
v1::GroupCommand GatherCommand(const std::string& id, std::optional<torch::ScalarType> dtype,
                               bool gradients);

// A tensor's name, dtype and shape, for a command whose broadcast (HeadGroup::Share) carries it.
v1::GroupTensor DescribeTensor(const std::string& name, const torch::Tensor& t);
// An uninitialised tensor as `spec` describes, on `device`: what Share fills.
absl::StatusOr<torch::Tensor> EmptyTensor(const v1::GroupTensor& spec, torch::Device device);

// The name of `command`'s operation ("create", "step_batch", …: its field in the oneof).
std::string CommandName(const v1::GroupCommand& command);
// `command` as the group's log carries it: its bytes, named by its operation.
HeadGroup::Command ToLog(const v1::GroupCommand& command);
// The front: `command` run on every rank of `lane`'s group (HeadGroup::Lane::Run).
absl::Status RunCommand(HeadGroup::Lane& lane, const v1::GroupCommand& command,
                        const std::function<absl::Status()>& local, bool local_last = false);
// Another rank: follows `group`'s log (HeadGroup::Follow), each command's bytes parsed back
// (DATA_LOSS if they do not parse) and run by `run`, timed under the command's name.
absl::Status FollowCommands(HeadGroup& group,
                            const std::function<absl::Status(const v1::GroupCommand&)>& run,
                            const std::atomic<bool>& stop);

}  // namespace remotehead::server
