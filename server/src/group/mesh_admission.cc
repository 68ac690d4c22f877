#include "group/mesh_admission.h"

#include <chrono>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/group/liveness.h"

namespace remotehead::server {

MeshAdmission::MeshAdmission(HeadMesh* mesh) : mesh_(mesh) {
  thread_ = std::thread([this] { Loop(); });
}

MeshAdmission::~MeshAdmission() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MeshAdmission::set_healer(Healer healer) {
  std::lock_guard<std::mutex> lock(mu_);
  healer_ = std::move(healer);
}

void MeshAdmission::Loop() {
  Liveness* liveness = mesh_->liveness();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait_for(lock, std::chrono::milliseconds(500), [&] { return stop_; });
    if (stop_) return;
    lock.unlock();
    const MeshEpoch now = mesh_->epoch();
    // Only the front that leads admits (it holds the log's lane); any front may come to lead.
    if (mesh_->is_leader() && mesh_->Reconfiguring().ok()) {
      for (int r = 0; r < mesh_->replicas() && liveness->health().ok(); ++r) {
        if (now.serves(r)) continue;
        const absl::StatusOr<bool> asked = liveness->AskedToJoin(r, now.number);
        if (!asked.ok() || !*asked) continue;
        if (const absl::Status admitted = Admit(r); !admitted.ok()) {
          std::cerr << "remotehead-server: mesh: replica " << r
                    << " asked to join but was not admitted: " << admitted.message() << std::endl;
        }
        break;  // one admission at a time: the epoch changed
      }
    }
    lock.lock();
  }
}

absl::Status MeshAdmission::Admit(int replica) {
  Healer healer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    healer = healer_;
  }
  if (healer == nullptr) return absl::FailedPreconditionError("this leader cannot heal (yet)");
  Liveness* liveness = mesh_->liveness();
  absl::StatusOr<MeshEpoch> next = absl::UnknownError("not admitted");
  {
    // Between two mesh steps: while the lane is held no mesh command runs, and every command
    // before it was answered by every rank of every serving replica.
    ASSIGN_OR_RETURN(HeadGroup::Lane lane, mesh_->fronts()->Enter());
    mesh_->BeginHeal(replica);  // from now on calls wait for the heal
    next = liveness->epochs().Admit(replica);
  }
  liveness->ForgetJoin(replica).IgnoreError();  // housekeeping: a later request is asked anew
  if (!next.ok() || next->admitted != replica) {
    mesh_->EndHeal();
    return next.ok() ? absl::AbortedError(
                           absl::StrCat("the mesh entered ", next->Describe(), " meanwhile"))
                     : next.status();
  }
  absl::Status healed = absl::CancelledError("the mesh closes");
  const auto start = std::chrono::steady_clock::now();
  if (mesh_->AwaitEpoch(next->number)) {
    mesh_->TestOnlyPause("before_heal", next->number);
    healed = mesh_->epoch().number == next->number
                 ? healer(*next)
                 : absl::AbortedError(absl::StrCat("the mesh left ", next->Describe()));
  }
  mesh_->EndHeal();
  if (healed.ok()) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cerr << "remotehead-server: mesh: replica " << replica << " healed in "
              << absl::StrFormat("%.1f", seconds) << " s: every head's state verified; it serves "
              << "again in " << next->Describe() << std::endl;
    return absl::OkStatus();
  }
  // The joiner leaves again and the mesh goes on without it (unless the mesh went down).
  liveness->epochs().EvictReplica(
      replica, absl::StrCat("the heal of replica ", replica, " failed (", healed.message(), ")"));
  return absl::DataLossError(
      absl::StrCat("the heal failed: ", healed.message(), "; the replica is evicted again"));
}

}  // namespace remotehead::server
