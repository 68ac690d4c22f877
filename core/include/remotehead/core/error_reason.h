// Machine-readable reasons of failed statuses: the one list of what a program may branch on.
//
// A status's code says how to handle it (retry on UNAVAILABLE, fix the input on
// INVALID_ARGUMENT); its message is for people. What a program needs beyond that — "the server
// restarted, resume from a checkpoint", "rank 3 never came" — travels as a reason (UPPER_SNAKE
// constant below) with metadata (the field, the head, the missing ranks), attached where the
// status is made with WithReason. The server's status seam (server/status_mapping) sends it as
// a google.rpc.ErrorInfo (domain kErrorDomain) in the status details; clients read it there and
// never match message text. A status made without a reason gets its code's default
// (DefaultReason): a reason is on every failed status.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace remotehead::core {

inline constexpr char kErrorDomain[] = "remotehead.dev";

namespace reason {
// A request field is out of its domain; metadata "field" names it.
inline constexpr char kInvalidField[] = "INVALID_FIELD";
// No head of that id; metadata "head".
inline constexpr char kHeadNotFound[] = "HEAD_NOT_FOUND";
// A head of that id exists already; metadata "head".
inline constexpr char kHeadExists[] = "HEAD_EXISTS";
// The server process is not the one the caller knew (expected_incarnation): dW and gradient
// ids are gone; metadata "head", "expected_incarnation", "incarnation", "weight_version".
inline constexpr char kServerRestarted[] = "SERVER_RESTARTED";
// The head is at another weight version than the caller holds; metadata "head", "expected",
// "actual".
inline constexpr char kWeightVersionMismatch[] = "WEIGHT_VERSION_MISMATCH";
// Admission refused the call for memory or the queue; metadata "resource".
inline constexpr char kResourceExhausted[] = "RESOURCE_EXHAUSTED";
// A synchronous step timed out waiting for ranks; metadata "head", "step", "missing_ranks".
inline constexpr char kRanksMissing[] = "RANKS_MISSING";
// The ranks of a synchronous step disagree; metadata "head", "step", "field".
inline constexpr char kRanksDisagree[] = "RANKS_DISAGREE";
// A head group's collective or store call ran past --group_timeout_seconds; metadata "op",
// "rank".
inline constexpr char kGroupTimeout[] = "GROUP_TIMEOUT";
// A head group is down or one of its ranks is unreachable; metadata "rank" where known.
inline constexpr char kGroupUnavailable[] = "GROUP_UNAVAILABLE";
// The server is draining (SIGTERM): try again elsewhere or later.
inline constexpr char kServerDraining[] = "SERVER_DRAINING";
// The function cannot run on a head group (not vocabulary-decomposable); metadata "function".
inline constexpr char kNotOnGroup[] = "FUNCTION_NOT_ON_GROUP";
// The call reached a rank of a head group that is not its front; metadata "front" (the address
// to dial instead; "" while the front has not announced it yet), "rank", "method".
inline constexpr char kNotTheFront[] = "NOT_THE_FRONT";
// An operation that changes every replica of a mesh reached a replica's front other than the
// leader's (replica 0); metadata "leader" (the address to dial; "" until it announced it),
// "replica", "method".
inline constexpr char kNotTheLeader[] = "NOT_THE_LEADER";
// A synchronous step's trainer dialled the front of another replica than its own (rank mod R);
// metadata "rank", "replica" (the one to dial).
inline constexpr char kWrongReplica[] = "WRONG_REPLICA";
// A mesh lost a replica and goes on without it (--mesh_min_replicas): for a moment it changes
// epochs, and the call (a step in flight at the loss: nothing applied) is to be asked again;
// metadata "epoch" (the epoch it enters), "evicted" (the replica evicted).
inline constexpr char kMeshReconfiguring[] = "MESH_RECONFIGURING";
// The replicas of a mesh hold different weights (a checksum differs); metadata "replicas".
inline constexpr char kReplicasDiverged[] = "REPLICAS_DIVERGED";
// A frozen head (a teacher, a reference) was asked to accumulate dW or to take an optimizer
// step; metadata "head".
inline constexpr char kHeadFrozen[] = "HEAD_FROZEN";
// A step's teacher head (StepHeader.teacher_head_id) cannot serve as its student's teacher: not
// frozen, another vocabulary or layout, the student itself; metadata "teacher", "field"
// ("frozen", "vocab_size", "shards", "teacher_head_id"), "expected", "actual".
inline constexpr char kTeacherIncompatible[] = "TEACHER_INCOMPATIBLE";
}  // namespace reason

struct ErrorReason {
  std::string reason;
  std::map<std::string, std::string> metadata;
};

// `status` with `reason` and `metadata` attached (a status that is OK is returned as it is).
absl::Status WithReason(absl::Status status, absl::string_view reason,
                        std::map<std::string, std::string> metadata = {});

// The reason attached with WithReason, if any.
std::optional<ErrorReason> GetReason(const absl::Status& status);

// The attached reason as one string, "" if none: how a status crosses a process boundary that
// carries code and message (a head group's reply), with WithSerializedReason on the other side.
std::string SerializeReason(const absl::Status& status);
absl::Status WithSerializedReason(absl::Status status, absl::string_view serialized);

// The reason of a failed status: the attached one, else the code's default (INVALID_FIELD for
// INVALID_ARGUMENT with the field a message starts with, "field: expected …", as metadata;
// otherwise the code's canonical name, e.g. "INTERNAL").
ErrorReason ReasonOf(const absl::Status& status);

}  // namespace remotehead::core
