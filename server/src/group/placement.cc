#include "remotehead/server/group/placement.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/group/liveness.h"

namespace remotehead::server {

int Placement::rank() const { return group_ != nullptr ? group_->rank() : 0; }

int Placement::size() const { return group_ != nullptr ? group_->size() : 1; }

bool Placement::is_front() const { return group_ == nullptr || group_->is_front(); }

int Placement::replica() const { return mesh_ != nullptr ? mesh_->replica() : 0; }

int Placement::replicas() const { return mesh_ != nullptr ? mesh_->replicas() : 1; }

int Placement::leader_replica() const { return mesh_ != nullptr ? mesh_->leader_replica() : 0; }

bool Placement::is_replica_front() const { return mesh_ != nullptr && mesh_->is_front(); }

bool Placement::follows_mesh() const { return is_replica_front() && !mesh_->is_leader(); }

bool Placement::leads_cluster() const {
  if (mesh_ != nullptr) return mesh_->is_leader();
  return group_ != nullptr && group_->is_front();
}

const char* Placement::cluster_name() const {
  return mesh_ != nullptr ? "mesh" : group_ != nullptr ? "head group" : "server";
}

absl::Status Placement::health() const {
  if (group_ != nullptr) RETURN_IF_ERROR(group_->health());
  return mesh_ != nullptr ? mesh_->health() : absl::OkStatus();
}

absl::Status Placement::Serving() const {
  if (group_ != nullptr) RETURN_IF_ERROR(group_->Serving());
  if (mesh_ != nullptr && mesh_->fronts() != nullptr) {
    // A replica whose process was lost is evicted: then the others answer for a moment that the
    // mesh changes epochs, not that it is down.
    RETURN_IF_ERROR(mesh_->Reconfiguring());
    return mesh_->Restated(mesh_->fronts()->Serving());
  }
  return absl::OkStatus();
}

absl::Status Placement::BroadcastHeal(std::string& bytes, int epoch, bool joiner) {
  if (mesh_ == nullptr) return absl::FailedPreconditionError("heal: expected a mesh; got none");
  return mesh_->BroadcastFromLeader(bytes, epoch, joiner);
}

std::string Placement::heal_secret() const {
  if (mesh_ == nullptr || mesh_->liveness() == nullptr) return "";
  return mesh_->liveness()->config().secret;
}

bool Placement::testonly_corrupt_heal() const {
  return mesh_ != nullptr && mesh_->options().testonly_corrupt_heal;
}

void Placement::HealEnded(const absl::Status& outcome, bool joiner) {
  if (mesh_ == nullptr) return;
  mesh_->CountHeal(outcome.ok());
  if (!joiner) return;
  if (outcome.ok()) {
    mesh_->MarkHealed();
  } else {
    mesh_->HealFailed(outcome);
  }
}

absl::Status Placement::AwaitMeshSettled(std::chrono::steady_clock::time_point deadline) {
  return mesh_ != nullptr ? mesh_->AwaitSettled(deadline) : absl::OkStatus();
}

absl::Status Placement::CompareReplicas(const std::vector<torch::Tensor>& tensors,
                                        const std::string& what) {
  return mesh_ != nullptr ? mesh_->CompareAcrossReplicas(tensors, what) : absl::OkStatus();
}

std::optional<std::string> Placement::DrainRequested() {
  for (HeadGroup* log : {group_, mesh_ != nullptr ? mesh_->fronts() : nullptr}) {
    if (log == nullptr) continue;
    absl::StatusOr<std::optional<std::string>> reason = log->DrainRequested();
    if (reason.ok() && reason->has_value()) return **reason;
  }
  return std::nullopt;
}

std::optional<std::string> Placement::ReplicaDrainRequested() {
  if (mesh_ == nullptr || group_ == nullptr || !group_->is_front()) return std::nullopt;
  absl::StatusOr<std::optional<std::string>> reason = group_->DrainRequested();
  return reason.ok() ? *reason : std::nullopt;
}

absl::Status Placement::RequestDrainUp(const std::string& reason) {
  HeadGroup* up = is_front() && mesh_ != nullptr ? mesh_->fronts() : group_;
  if (up == nullptr) {
    return absl::FailedPreconditionError("drain: this process is alone: no one to ask");
  }
  return up->RequestDrain(reason);
}

absl::StatusOr<std::vector<core::ShardRange>> Placement::Ranges(int64_t vocab_size,
                                                                const std::string& field) const {
  if (group_ == nullptr) return std::vector<core::ShardRange>{{.offset = 0, .rows = vocab_size}};
  if (vocab_size < group_->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at least one row per rank of the head group of ",
                     group_->size(), "; got ", vocab_size));
  }
  return group_->Ranges(vocab_size);
}

absl::Status Placement::Share(std::vector<torch::Tensor>& tensors) {
  return group_ != nullptr ? group_->Share(tensors) : absl::OkStatus();
}

absl::StatusOr<torch::Tensor> Placement::GatherRows(const torch::Tensor& mine,
                                                    const std::vector<core::ShardRange>& ranges) {
  if (group_ == nullptr) return mine;
  return group_->GatherRows(mine, ranges);
}

absl::StatusOr<torch::Tensor> Placement::SumToFront(const torch::Tensor& mine) {
  if (group_ == nullptr) return mine;
  return group_->SumToFront(mine);
}

absl::Status Placement::ShareFromLeader(std::vector<torch::Tensor>& tensors) {
  if (mesh_ == nullptr || !mesh_->is_front()) return absl::OkStatus();
  return mesh_->fronts()->Share(tensors);
}

absl::Status Placement::SumOverReplicas(torch::Tensor& t, int epoch) {
  return mesh_ != nullptr ? mesh_->SumOverReplicas(t, epoch) : absl::OkStatus();
}

absl::Status Placement::DecideStep(const std::string& attempt, const absl::Status& summed,
                                   int epoch) {
  return mesh_ != nullptr ? mesh_->Decide(attempt, summed, epoch) : summed;
}

void Placement::TestOnlyPause(const std::string& point, int64_t version) const {
  if (mesh_ != nullptr) mesh_->TestOnlyPause(point, version);
}

bool Placement::evicts_replicas() const { return mesh_ != nullptr && mesh_->evicts(); }

absl::Status Placement::Restated(const absl::Status& status) const {
  return mesh_ != nullptr ? mesh_->Restated(status) : status;
}

absl::Status Placement::CompareReplicasAt(int64_t version,
                                          const std::vector<torch::Tensor>& tensors,
                                          const std::string& what) {
  if (mesh_ == nullptr) return absl::OkStatus();
  const int every = mesh_->options().checksum_every_steps;
  if (every <= 0 || version % every != 0) return absl::OkStatus();
  return mesh_->CompareAcrossReplicas(tensors, what);
}

std::chrono::milliseconds Placement::mesh_reply_timeout() const {
  if (mesh_ == nullptr || mesh_->fronts() == nullptr) return std::chrono::milliseconds(0);
  return std::chrono::duration_cast<std::chrono::milliseconds>(
      mesh_->fronts()->collectives().config().timeout);
}

}  // namespace remotehead::server
