// How a head group's commands (remotehead/v1/head_group.proto) travel: their bytes and names in
// the group's log (group/head_group.h, which carries bytes), the front's run of one on every
// rank, the other ranks' following of the log, and the tensors a command describes for a
// broadcast. The head commands themselves are translate/head_commands.h's; a request's engine
// calls are replication/group_steps.h's.
#pragma once

#include <atomic>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/v1/head_group.pb.h"

namespace remotehead::server {

// A dtype as the group's commands carry it.
v1::DType GroupWireDtype(torch::ScalarType dtype);

// A step command's pin (the head's version and gradient window the front's session pinned).
v1::GroupPin PinToWire(const HeadPin& pin);
HeadPin PinFromWire(const v1::GroupPin& pin);

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
