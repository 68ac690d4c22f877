#include "group/mesh_decisions.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/group/liveness.h"

namespace remotehead::server {
namespace {
// A mesh step's commit decisions, as settled.
constexpr char kDecisionApply[] = "apply";
constexpr char kDecisionAbort[] = "abort";
}  // namespace

absl::StatusOr<bool> MeshDecisions::AllSummed(const std::string& attempt,
                                              const MeshEpoch& at) const {
  Liveness* const liveness = mesh_->liveness();
  if (liveness->epochs().current().number != at.number) {
    return absl::AbortedError("a replica was evicted during the step");
  }
  const int k = liveness->config().ranks_per_replica();
  for (int r : at.live) {
    for (int s = 0; s < k; ++s) {
      ASSIGN_OR_RETURN(const std::optional<std::string> said,
                       liveness->Read(store_keys::MeshSummed(attempt, r * k + s)));
      if (!said.has_value()) return false;
    }
  }
  return true;
}

absl::Status MeshDecisions::Decide(const std::string& attempt, const absl::Status& summed,
                                   int epoch) {
  Liveness* const liveness = mesh_->liveness();
  if (liveness == nullptr) return summed;
  const bool evicting = mesh_->evicts();
  if (!evicting) RETURN_IF_ERROR(summed);  // without eviction a failed sum takes the mesh down
  const char* proposal = summed.ok() ? kDecisionApply : kDecisionAbort;
  const std::string key = store_keys::MeshDecision(attempt);
  if (evicting && summed.ok()) {
    // "apply" only once every serving rank summed: then no rank is left without the sum.
    const int me = liveness->config().rank;
    if (!last_summed_.empty()) {
      liveness->Unpublish(store_keys::MeshSummed(last_summed_, me)).IgnoreError();
    }
    last_summed_ = attempt;
    RETURN_IF_ERROR(liveness->Publish(store_keys::MeshSummed(attempt, me), "summed"));
    const MeshEpoch at = mesh_->epoch();
    if (epoch >= 0 && epoch != at.number) proposal = kDecisionAbort;
    const auto deadline = std::chrono::steady_clock::now() + liveness->config().timeout;
    for (auto pause = std::chrono::milliseconds(1); proposal == kDecisionApply;
         pause = std::min(pause * 2, std::chrono::milliseconds(20))) {
      const absl::StatusOr<bool> all = AllSummed(attempt, at);
      if (!all.ok()) {
        proposal = kDecisionAbort;
        break;
      }
      if (*all) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        proposal = kDecisionAbort;
        break;
      }
      std::this_thread::sleep_for(pause);
    }
  }
  ASSIGN_OR_RETURN(const std::string decided, liveness->Settle(key, proposal));
  if (mesh_->is_leader()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!last_decided_.empty() && last_decided_ != attempt) {
      // Forgetting is housekeeping: a store that fails here fails the next step's settle too.
      liveness->Unsettle(store_keys::MeshDecision(last_decided_)).IgnoreError();
    }
    last_decided_ = attempt;
  }
  if (decided == kDecisionApply && summed.ok()) {
    ++applied_;
    return absl::OkStatus();
  }
  if (decided == kDecisionApply) {
    // Never happens: "apply" needs this rank's word that it summed. Were it to, this replica
    // lacks the step every other applies: it must leave the mesh.
    return absl::DataLossError(
        absl::StrCat("mesh step ", attempt,
                     ": settled to apply, but this rank's sum failed: ", summed.message()));
  }
  if (decided == kDecisionAbort) {
    ++aborted_;
    if (!summed.ok()) return summed;
    return core::WithReason(
        absl::AbortedError(absl::StrCat(
            "mesh step ", attempt,
            ": settled to abort (a replica was lost before every rank had summed): nothing "
            "applied")),
        core::reason::kMeshReconfiguring,
        {{"epoch", absl::StrCat(liveness->epochs().current().number)}});
  }
  return absl::DataLossError(absl::StrCat("mesh step ", attempt, ": the settled decision is \"",
                                          decided, "\", neither apply nor abort"));
}

}  // namespace remotehead::server
