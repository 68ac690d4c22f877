#include "group/retired_groups.h"

namespace remotehead::server {

std::vector<RetiredGroups::Entry> RetiredGroups::Retire(EpochGroups left, int epoch) {
  const auto now = std::chrono::steady_clock::now();
  if (left.fronts != nullptr) left.fronts->collectives().Abort();
  if (left.shard_peers != nullptr) left.shard_peers->Abort();
  std::vector<Entry> expired;
  std::vector<Entry> kept;
  for (Entry& e : kept_) {
    const bool done = e.epoch > 0 && now - e.at > patience_;
    (done ? expired : kept).push_back(std::move(e));
  }
  kept.push_back({.groups = std::move(left), .epoch = epoch, .at = now});
  kept_ = std::move(kept);
  return expired;
}

void RetiredGroups::Close(std::vector<Entry> expired, std::ostream& log) {
  for (Entry& e : expired) {
    e.groups = EpochGroups{};
    log << "remotehead-server: mesh: the cross-replica groups of epoch " << e.epoch << " closed"
        << std::endl;
  }
}

}  // namespace remotehead::server
