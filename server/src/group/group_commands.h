// The head commands of a head group (remotehead/v1/head_group.proto): built on the front from
// the operations' own arguments, turned back into the same calls on the other ranks
// (group_follower.h). The one home of their encoding; a request's engine calls are
// group_steps.h's.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "head_requests.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_group.pb.h"

namespace remotehead::server {

enum class HeadCommandKind { kDrop, kZeroGradients };

// `frozen`: the head is created frozen on every rank (HeadEntry::frozen).
v1::GroupCommand CreateCommand(const std::string& id, const core::HeadInit& init, bool frozen);
v1::GroupCommand CreateCommand(const std::string& id, const SafetensorsSource& source, bool frozen);
// The tensors follow by broadcast (HeadGroup::Share): the command carries their shapes.
v1::GroupCommand UploadCommand(const std::string& id, const torch::Tensor& weight,
                               const torch::Tensor& bias, bool replace, bool frozen);
v1::GroupCommand UndoCreateCommand(const std::string& id);
v1::GroupCommand HeadCommand(HeadCommandKind kind, const std::string& id);
v1::GroupCommand OptimizerStepCommand(const std::string& id, const OptimizerStepSpec& spec);
// A head's state saved (restored) on every rank under `state_id`; `check_only`: every rank only
// checks that it could restore it.
v1::GroupCommand SaveStateCommand(const std::string& id, const std::string& state_id);
v1::GroupCommand RestoreStateCommand(const std::string& id, const std::string& state_id,
                                     bool check_only);
v1::GroupCommand GatherCommand(const std::string& id, std::optional<torch::ScalarType> dtype,
                               bool gradients);

}  // namespace remotehead::server
