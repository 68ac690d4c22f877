#include "replication/apply_head_command.h"

#include "replication/replica_step.h"
#include "service/replica_heal.h"

namespace remotehead::server {
namespace {

namespace hc = head_command;

// Each command as its HeadOperations call (the arguments are the struct's fields, in order).
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::CreateFromSeed& c) {
  return ops.CreateFromSeed(c.id, c.init, c.traits);
}
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::CreateFromSafetensors& c) {
  return ops.CreateFromSafetensors(c.id, c.source, c.traits);
}
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::Upload& c) {
  return ops.Upload(c.id, c.weight, c.bias, c.replace, c.traits);
}
absl::Status Apply(HeadOperations& ops, const hc::Drop& c) { return ops.Drop(c.id); }
absl::Status Apply(HeadOperations& ops, const hc::UndoCreate& c) { return ops.UndoCreate(c.id); }
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::ZeroGradients& c) {
  return ops.ZeroGradients(c.id);
}
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::OptimizerStep& c) {
  return ops.OptimizerStep(c.id, c.spec);
}
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::ReduceStep& c) {
  return ReplicaStep(ops, c.id, c.spec, c.attempt, c.epoch);
}
absl::Status Apply(HeadOperations& ops, const hc::Heal& c) {
  return HealReplica(ops, c.epoch, c.replica);
}
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::SaveState& c) {
  return ops.SaveState(c.id, c.state_id);
}
absl::StatusOr<HeadDescription> Apply(HeadOperations& ops, const hc::RestoreState& c) {
  return ops.RestoreState(c.id, c.state_id, c.check_only);
}
absl::StatusOr<HeadSnapshot> Apply(HeadOperations& ops, const hc::Gather& c) {
  return ops.Snapshot(c.id, c.dtype, c.gradients);
}
absl::StatusOr<HeadSnapshot> Apply(HeadOperations& ops, const hc::EmbeddingLookup& c) {
  return ops.LookupEmbedding(c.id, c.ids, c.dtype);
}
absl::StatusOr<EmbeddingGradientOutcome> Apply(HeadOperations& ops,
                                               const hc::EmbeddingGradient& c) {
  return ops.AddEmbeddingGradient(c.id, c.ids, c.rows, c.key, c.expected_weight_version,
                                  c.version_field);
}

absl::StatusOr<HeadCommandResult> AsResult(absl::Status status) {
  if (!status.ok()) return status;
  return HeadCommandResult(std::monostate{});
}
template <typename T>
absl::StatusOr<HeadCommandResult> AsResult(absl::StatusOr<T> result) {
  if (!result.ok()) return result.status();
  return HeadCommandResult(*std::move(result));
}

}  // namespace

absl::StatusOr<HeadCommandResult> ApplyHeadCommand(HeadOperations& operations,
                                                   const HeadCommand& command) {
  return std::visit([&](const auto& c) { return AsResult(Apply(operations, c)); }, command);
}

}  // namespace remotehead::server
