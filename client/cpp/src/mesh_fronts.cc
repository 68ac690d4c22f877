// How a trainer follows a mesh whose replica was evicted (mesh_fronts.h): which failures may mean
// a move, and the probes that find the front serving the trainer now.
#include "mesh_fronts.h"

#include <algorithm>
#include <deque>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "remotehead/core/error_reason.h"
#include "status.h"

namespace remotehead::client::internal {
namespace {

// How long one probe of a front may take (a front that is gone refuses at once).
constexpr std::chrono::seconds kProbeTimeout{5};

}  // namespace

bool MeshFronts::MayFollow(const absl::Status& failed) const {
  if (!meshed() || failed.ok()) return false;
  const std::optional<core::ErrorReason> reason = core::GetReason(failed);
  const std::string why = reason.has_value() ? reason->reason : "";
  if (why == core::reason::kServerDraining) return false;
  return failed.code() == absl::StatusCode::kUnavailable || why == core::reason::kWrongReplica;
}

absl::StatusOr<v1::HeadInfo> MeshFronts::Probe(int replica, const std::string& head_id,
                                               const Open& open) const {
  const std::shared_ptr<grpc::Channel> channel = open(addresses_[replica]);
  const std::unique_ptr<v1::HeadService::Stub> stub = v1::HeadService::NewStub(channel);
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  ref.set_trainer_rank(trainer_);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kProbeTimeout);
  v1::HeadInfo info;
  const absl::Status status = FromGrpc(stub->DescribeHead(&context, ref, &info));
  if (!status.ok()) return status;
  return info;
}

std::optional<MeshFronts::Found> MeshFronts::Follow(const std::string& head_id, int current,
                                                    const Open& open, const Pace& pace) const {
  const int count = static_cast<int>(addresses_.size());
  std::vector<int> order;
  for (int i = 1; i < count; ++i) order.push_back((current + i) % count);
  order.push_back(current);
  const auto deadline = std::chrono::steady_clock::now() + pace.patience;
  std::chrono::milliseconds pause = pace.initial_backoff;
  while (true) {
    std::deque<int> queue(order.begin(), order.end());
    std::set<int> probed;
    while (!queue.empty()) {
      const int replica = queue.front();
      queue.pop_front();
      if (!probed.insert(replica).second) continue;
      absl::StatusOr<v1::HeadInfo> info = Probe(replica, head_id, open);
      if (info.ok()) return Found{.replica = replica, .info = *std::move(info)};
      const std::optional<core::ErrorReason> reason = core::GetReason(info.status());
      if (!reason.has_value()) continue;
      // A front that does not serve this trainer names the replica that does: asked next.
      if (reason->reason == core::reason::kWrongReplica) {
        const auto named = reason->metadata.find("replica");
        int next = -1;
        if (named != reason->metadata.end() && absl::SimpleAtoi(named->second, &next) &&
            next >= 0 && next < count) {
          queue.push_front(next);
        }
      } else if (reason->reason == core::reason::kGroupUnavailable &&
                 !reason->metadata.contains("evicted")) {
        return std::nullopt;  // the mesh is down (it does not evict): nothing to follow
      }
    }
    if (std::chrono::steady_clock::now() + pause > deadline) return std::nullopt;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, pace.max_backoff);
  }
}

}  // namespace remotehead::client::internal
