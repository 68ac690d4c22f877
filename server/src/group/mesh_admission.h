// The leader's admission of an evicted replica whose every process asked to join again, and its
// heal (head_mesh.h's rules): every half second while the mesh lacks a replica, the leader looks
// at the requests (Liveness::AskedToJoin); for a replica whose every process asked in the current
// epoch it takes the mesh log's lane — between two mesh steps: no mesh command runs, every
// earlier one was answered by every rank — settles the next epoch with the replica serving
// (MeshEpochs::Admit), waits for that epoch's groups, and runs the heal (the healer: a mesh
// command of the replication layer). A heal that fails evicts the replica again. One admission
// at a time; meanwhile the mesh answers calls that train MESH_RECONFIGURING (HeadMesh::BeginHeal).
// Every front runs one; it acts only while its front leads (the leader changes when the leader's
// replica is evicted: mesh_epoch.h).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "remotehead/server/group/mesh_epoch.h"

namespace remotehead::server {

class HeadMesh;

class MeshAdmission {
 public:
  using Healer = std::function<absl::Status(const MeshEpoch& admitted)>;
  // Starts looking, on a thread of its own, for `mesh` (its leader, on a mesh that evicts).
  explicit MeshAdmission(HeadMesh* mesh);
  ~MeshAdmission();  // stops looking; an admission under way ends first
  MeshAdmission(const MeshAdmission&) = delete;
  MeshAdmission& operator=(const MeshAdmission&) = delete;

  // Unset: no replica is admitted (none can be healed).
  void set_healer(Healer healer);

 private:
  void Loop();
  absl::Status Admit(int replica);

  HeadMesh* const mesh_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // under mu_
  Healer healer_;      // under mu_
  std::thread thread_;
};

}  // namespace remotehead::server
