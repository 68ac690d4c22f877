// Every key the server's processes write to a head group's (or mesh's) store, built here and
// nowhere else: the prefix each part of a group works under (below GroupConfig::prefix) and the
// keys inside it. A key's layout is what an operator fences and what docs/security.md promises
// in a tampering report's `key`, so it changes here only. c10d's PrefixStore joins a prefix and a
// key with "/": the command log's entry 5 is "remotehead/commands/cmd/5" to a store client.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace remotehead::server::store_keys {

// ----- prefixes, under a group's own (GroupConfig::prefix) -----

// c10d's rendezvous for the group's backend (Gloo / NCCL).
inline std::string Backend(absl::string_view group) { return absl::StrCat(group, "/backend"); }
// The group's command log (group_log.h): the keys below under "Command log".
inline std::string CommandLog(absl::string_view group) { return absl::StrCat(group, "/commands"); }
// A store of the group's opened by name (OpenStore): "liveness" (liveness.h).
inline std::string Named(absl::string_view group, absl::string_view name) {
  return absl::StrCat(group, "/", name);
}
// On a mesh: replica r's own group (its shards), and shard k's group across the replicas.
inline std::string ReplicaGroup(absl::string_view mesh, int replica) {
  return absl::StrCat(mesh, "/replica/", replica);
}
inline std::string ShardGroup(absl::string_view mesh, int shard) {
  return absl::StrCat(mesh, "/shard/", shard);
}
// Shard k's group in a later epoch of the mesh (mesh_epoch.h): the serving replicas' ranks only,
// a rendezvous and a log of its own (epoch 0 is ShardGroup's).
inline std::string ShardGroupInEpoch(absl::string_view mesh, int shard, int epoch) {
  return epoch == 0 ? ShardGroup(mesh, shard)
                    : absl::StrCat(mesh, "/shard/", shard, "/epoch/", epoch);
}
// Replica r's own group when it is admitted again in a later epoch (its processes are new).
inline std::string ReplicaGroupInEpoch(absl::string_view mesh, int replica, int epoch) {
  return absl::StrCat(mesh, "/replica/", replica, "/epoch/", epoch);
}

// ----- the command log (under CommandLog) -----

inline std::string Command(int64_t seq) { return absl::StrCat("cmd/", seq); }
inline std::string Reply(int64_t seq, int rank) { return absl::StrCat("reply/", seq, "/", rank); }
inline std::string Hello(int rank) { return absl::StrCat("hello/", rank); }
inline constexpr char kLogDown[] = "down";
// A rank's report that its reply was overwritten or deleted.
inline std::string Tampered(int rank) { return absl::StrCat("tampered/", rank); }
// A drain asked of the front by any rank.
inline constexpr char kDrainRequest[] = "drain";

// ----- liveness (under Named(group, "liveness")) -----

inline constexpr char kSession[] = "session";
inline constexpr char kVerdict[] = "down";
inline std::string Beat(int rank) { return absl::StrCat("beat/", rank); }
inline std::string Address(int rank) { return absl::StrCat("addr/", rank); }
// A value one rank publishes for the others (Liveness::Publish / Read).
inline std::string Shared(absl::string_view key) { return absl::StrCat("shared/", key); }
// A value set once for every process (Liveness::Settle).
inline std::string Settled(absl::string_view key) { return absl::StrCat("settled/", key); }

// ----- what a mesh's fronts publish (Shared keys) -----

// The leader's drain has begun.
inline constexpr char kMeshDraining[] = "draining";
// When replica r's trainers last came to a synchronous step of the head (mesh_steps.h), and
// its micro-batch count (mesh_counts.h); the head's id in hex, so any id is one key segment.
inline std::string MeshArrivals(absl::string_view head_id, int replica) {
  return absl::StrCat("arrivals/", absl::BytesToHexString(head_id), "/", replica);
}
inline std::string MeshCounts(absl::string_view head_id, int replica) {
  return absl::StrCat("counts/", absl::BytesToHexString(head_id), "/", replica);
}
// That global rank `rank` summed its dW for the mesh step `attempt` (HeadMesh::Decide).
inline std::string MeshSummed(absl::string_view attempt, int rank) {
  return absl::StrCat("summed/", attempt, "/", rank);
}
// That global rank `rank`, a process of an evicted replica, asks to join the mesh again
// (Liveness::AskToJoin); its value names the epoch it asks in.
inline std::string MeshJoin(int rank) { return absl::StrCat("join/", rank); }
// Where clients dial replica r's front (HeadMesh::PublishFrontAddress): the leader's address
// that another front names (NOT_THE_LEADER) once the leader changed.
inline std::string MeshFront(int replica) { return absl::StrCat("front/", replica); }

// ----- what a mesh's processes settle (Settled keys) -----

// A mesh step's commit decision, by the step's attempt (MeshStep.attempt, unique).
inline std::string MeshDecision(absl::string_view attempt) {
  return absl::StrCat("decision/", attempt);
}
// The record of the mesh's epoch `epoch` (> 0): the replica it evicted and those that serve.
inline std::string MeshEpochRecord(int epoch) { return absl::StrCat("epoch/", epoch); }

}  // namespace remotehead::server::store_keys
