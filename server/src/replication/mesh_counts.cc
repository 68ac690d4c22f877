#include "replication/mesh_counts.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "group/store_keys.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
bool MeshCounts::active() const {
  return local_->placement().is_replica_front() && mesh_->liveness() != nullptr;
}

void MeshCounts::Publish(const std::string& id) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(publishing_);
  const absl::StatusOr<HeadDescription> head = local_->Describe(id);
  const int64_t count = head.ok() ? head->accumulated_micro_batches : 0;
  if (const absl::Status s = mesh_->liveness()->Publish(
          store_keys::MeshCounts(id, mesh_->replica()), absl::StrCat(count));
      !s.ok()) {
    local_->LogEvent(absl::StrCat("mesh: head \"", id, "\": replica ", mesh_->replica(),
                                  "'s micro-batch count not published: ", s.message()));
  }
}

absl::StatusOr<HeadDescription> MeshCounts::Describe(const std::string& id) const {
  ASSIGN_OR_RETURN(HeadDescription head, local_->Describe(id));
  if (!active()) return head;
  // The serving replicas' counts: an evicted replica's dW is gone with it (its trainers resend).
  for (int r : mesh_->epoch().live) {
    if (r == mesh_->replica()) continue;
    const absl::StatusOr<std::optional<std::string>> told =
        mesh_->liveness()->Read(store_keys::MeshCounts(id, r));
    int64_t count = 0;
    if (!told.ok() || (told->has_value() && !absl::SimpleAtoi(**told, &count))) {
      return absl::UnavailableError(
          absl::StrCat("accumulated_micro_batches: replica ", r, "'s count of head \"", id,
                       "\" cannot be read (", told.ok() ? "not a count" : told.status().message(),
                       "), so the mesh's count is not known"));
    }
    head.accumulated_micro_batches += count;
  }
  return head;
}

}  // namespace remotehead::server
