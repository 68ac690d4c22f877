// Which of a mesh's replica fronts this trainer dials, and how it follows the mesh when its
// replica is evicted (docs/meshes.md, "A mesh that survives a lost replica") — the Python client's
// _mesh_fronts.py (Fronts), rule for rule.
//
// Trainer t dials fronts[t mod R]. With --mesh_min_replicas below R, a mesh whose replica r lost a
// process evicts r and goes on in its next epoch, where trainer t is served by replica t mod R if
// that serves, else by the serving replica live[t mod |live|] — the server's rule, which the
// client never computes: it asks. When a call at its front fails for good (the front refuses
// connections, answers that its replica is down or evicted, or that this trainer belongs
// elsewhere), Follow probes the fronts in order from the next one, each with a DescribeHead naming
// the trainer (HeadRef.trainer_rank): a front that serves it answers; another names the replica
// that does (WRONG_REPLICA), which is probed next; a mesh still changing epochs
// (MESH_RECONFIGURING) is asked again at the next sweep. The sweeps go on for up to the patience,
// and stop at once when a front says that the mesh is down (GROUP_UNAVAILABLE, not an evicted
// replica's: a mesh without --mesh_min_replicas, or one that lost its leader's replica, goes down
// as a whole).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/v1/head_service.grpc.pb.h"

namespace remotehead::client::internal {

class MeshFronts {
 public:
  // `addresses`: a mesh's replica fronts [replica 0's, replica 1's, …] (ClientOptions::fronts), or
  // the one server's address; `trainer`: this trainer's rank.
  MeshFronts(std::vector<std::string> addresses, int trainer)
      : addresses_(std::move(addresses)), trainer_(trainer) {}

  // Whether there is another front to follow the trainer to.
  bool meshed() const { return addresses_.size() > 1; }
  int trainer() const { return trainer_; }
  // The replica this trainer dials first: its rank mod R.
  int first_replica() const { return trainer_ % static_cast<int>(addresses_.size()); }
  const std::string& address(int replica) const { return addresses_[replica]; }
  int replicas() const { return static_cast<int>(addresses_.size()); }

  // Whether `failed` (a call at this trainer's front that failed for good) may mean that the mesh
  // moved this trainer: the front is gone or down (UNAVAILABLE, but for a draining server, which
  // is not a move), or it names another replica (WRONG_REPLICA).
  bool MayFollow(const absl::Status& failed) const;

  // A front that said it serves this trainer, and the head as it describes it.
  struct Found {
    int replica = 0;
    v1::HeadInfo info;
  };
  // A channel to `address` for one probe (closed when the probe drops it).
  using Open = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;
  // How long and how often to probe: sweeps until `patience` ran out, `initial_backoff` apart
  // at first, twice that after each sweep, up to `max_backoff`.
  struct Pace {
    std::chrono::milliseconds patience;
    std::chrono::milliseconds initial_backoff;
    std::chrono::milliseconds max_backoff;
  };
  // The replica whose front serves this trainer now — probed in the order of the fronts after
  // `current` (cyclically), then `current` — and the head `head_id` as that front describes it;
  // nullopt if no front said so within the patience, or one said the mesh is down.
  std::optional<Found> Follow(const std::string& head_id, int current, const Open& open,
                              const Pace& pace) const;

 private:
  // One DescribeHead naming this trainer at `replica`'s front.
  absl::StatusOr<v1::HeadInfo> Probe(int replica, const std::string& head_id,
                                     const Open& open) const;

  std::vector<std::string> addresses_;
  int trainer_;
};

}  // namespace remotehead::client::internal
