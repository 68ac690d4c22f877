#include "remotehead/server/group/mesh_epoch.h"

#include <algorithm>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::server {

MeshEpoch MeshEpoch::First(int replicas) {
  MeshEpoch epoch;
  for (int r = 0; r < replicas; ++r) epoch.live.push_back(r);
  return epoch;
}

bool MeshEpoch::serves(int replica) const { return IndexOf(replica) >= 0; }

int MeshEpoch::IndexOf(int replica) const {
  const auto it = std::find(live.begin(), live.end(), replica);
  return it == live.end() ? -1 : static_cast<int>(it - live.begin());
}

int MeshEpoch::ReplicaOf(int trainer, int replicas) const {
  const int own = trainer % replicas;
  if (serves(own) || live.empty()) return own;
  return live[trainer % static_cast<int>(live.size())];
}

std::vector<int> MeshEpoch::TrainersOf(int replica, int world_size, int replicas) const {
  std::vector<int> trainers;
  for (int t = 0; t < world_size; ++t) {
    if (ReplicaOf(t, replicas) == replica) trainers.push_back(t);
  }
  return trainers;
}

MeshEpoch MeshEpoch::Without(int replica, const std::string& why) const {
  MeshEpoch next{.number = number + 1, .live = {}, .evicted = replica, .cause = why};
  for (int r : live) {
    if (r != replica) next.live.push_back(r);
  }
  return next;
}

MeshEpoch MeshEpoch::With(int replica, const std::string& why) const {
  MeshEpoch next{.number = number + 1, .live = live, .evicted = -1, .cause = why};
  next.admitted = replica;
  next.live.push_back(replica);  // the newest member last: the leader stays where it is
  return next;
}

std::string MeshEpoch::Describe() const {
  std::string text =
      absl::StrCat("epoch ", number, " (replicas [", absl::StrJoin(live, ", "), "] serve");
  if (evicted >= 0) absl::StrAppend(&text, "; replica ", evicted, " evicted");
  if (admitted >= 0) absl::StrAppend(&text, "; replica ", admitted, " admitted");
  return text + ")";
}

std::string MeshEpoch::Moves(int replicas) const {
  if (admitted >= 0) {
    return absl::StrCat("trainers t with t mod ", replicas, " = ", admitted, " go back to replica ",
                        admitted, " once it is healed");
  }
  if (evicted < 0 || live.empty()) return "no trainer moves";
  std::vector<std::string> to;
  for (size_t i = 0; i < live.size(); ++i) {
    to.push_back(live.size() == 1
                     ? absl::StrCat("replica ", live[i])
                     : absl::StrCat("replica ", live[i], " (t mod ", live.size(), " = ", i, ")"));
  }
  return absl::StrCat("trainers t with t mod ", replicas, " = ", evicted, " now go to ",
                      absl::StrJoin(to, " and "));
}

std::string MeshEpoch::Encode() const {
  return absl::StrCat(number, " ", evicted, " ", absl::StrJoin(live, ","), " ", admitted, "\n",
                      cause);
}

absl::StatusOr<MeshEpoch> MeshEpoch::Decode(const std::string& bytes) {
  const size_t newline = bytes.find('\n');
  const std::vector<std::string> fields =
      absl::StrSplit(bytes.substr(0, newline), ' ', absl::SkipEmpty());
  MeshEpoch epoch;
  bool ok = fields.size() == 4 && absl::SimpleAtoi(fields[0], &epoch.number) &&
            absl::SimpleAtoi(fields[1], &epoch.evicted) &&
            absl::SimpleAtoi(fields[3], &epoch.admitted) && epoch.number > 0;
  for (absl::string_view r : absl::StrSplit(ok ? fields[2] : "", ',', absl::SkipEmpty())) {
    int replica = -1;
    ok = ok && absl::SimpleAtoi(r, &replica) && replica >= 0;
    epoch.live.push_back(replica);
  }
  std::vector<int> distinct = epoch.live;
  std::sort(distinct.begin(), distinct.end());
  if (!ok || epoch.live.empty() ||
      std::adjacent_find(distinct.begin(), distinct.end()) != distinct.end()) {
    return absl::DataLossError(
        absl::StrCat("mesh epoch record: expected \"<number> <evicted> "
                     "<serving replicas> <admitted>\"; got \"",
                     bytes.substr(0, newline), "\""));
  }
  if (newline != std::string::npos) epoch.cause = bytes.substr(newline + 1);
  return epoch;
}

absl::Status MeshEpoch::ChangeStatus(const std::string& what) const {
  const MeshEpoch& next = *this;
  if (next.admitted >= 0) {
    return core::WithReason(
        absl::UnavailableError(absl::StrCat(
            what, "the mesh admits replica ", next.admitted, " again (", next.cause, ") in ",
            next.Describe(), " and heals it (every head's state from the leader, replica ",
            next.leader(),
            "): nothing of "
            "this call was applied; ask again in a moment (the replica's trainers go back to it)")),
        core::reason::kMeshReconfiguring,
        {{"epoch", absl::StrCat(next.number)}, {"admitted", absl::StrCat(next.admitted)}});
  }
  return core::WithReason(
      absl::UnavailableError(absl::StrCat(
          what, "the mesh lost replica ", next.evicted, " (", next.cause,
          ") and goes on without it in ", next.Describe(),
          ": nothing of this call was applied; ask again in a moment (the replica's trainers "
          "move to the replicas that serve)")),
      core::reason::kMeshReconfiguring,
      {{"epoch", absl::StrCat(next.number)}, {"evicted", absl::StrCat(next.evicted)}});
}

bool IsMeshReconfiguring(const absl::Status& status) {
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  return reason.has_value() && reason->reason == core::reason::kMeshReconfiguring;
}

}  // namespace remotehead::server
