// This rank's part of the heal of a mesh replica admitted again (replica_heal.h).
//
//   send     the leader's replica's rank encodes every head's whole training state
//   (core/head_state.h: W,
//            b, the optimizer state, the version), sealed under the group's secret, and
//            broadcasts them to its shard peers of the admitted epoch;
//   install  the admitted replica's rank decodes each one — the seal and the checksum verified,
//            its rows this rank's — drops whatever heads it held, and installs them;
//   compare  every rank hashes the canonical bytes of every head it holds and the replicas
//            compare them: the heal succeeds only where every replica holds the same bytes.
#include "service/replica_heal.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "group/exchange.h"
#include "remotehead/core/head_state.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_mesh.h"

namespace remotehead::server {
namespace {

// Every head's ids here, in order: the same order on every replica.
std::vector<std::string> SortedIds(const std::vector<HeadDescription>& heads) {
  std::vector<std::string> ids;
  for (const HeadDescription& d : heads) ids.push_back(d.id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Head `id` as this rank holds it, under the head's own state id (the last one saved on every
// member, or none): a capture records its id as the head's, which the heal must not change.
absl::StatusOr<core::HeadState> CaptureAsIs(HeadOperations& ops, const std::string& id) {
  ASSIGN_OR_RETURN(const HeadDescription d, ops.Describe(id));
  return ops.CaptureOwnState(id, d.state_id);
}

// Every head's state here, sealed under `secret`, packed.
absl::StatusOr<std::string> EncodeOwnStates(HeadOperations& ops, const core::StateSecret& secret) {
  std::vector<std::string> encoded;
  for (const std::string& id : SortedIds(ops.List())) {
    ASSIGN_OR_RETURN(const core::HeadState state, CaptureAsIs(ops, id));
    ASSIGN_OR_RETURN(encoded.emplace_back(), core::EncodeHeadState(state, secret));
  }
  return PackStrings(encoded);
}

// A packed bundle verified whole, then installed in place of every head held here.
absl::Status InstallHealed(HeadOperations& ops, const std::string& bundle,
                           const core::StateSecret& secret, int source) {
  ASSIGN_OR_RETURN(const std::vector<std::string> encoded, UnpackStrings(bundle));
  std::vector<core::HeadState> states;
  for (size_t i = 0; i < encoded.size(); ++i) {
    ASSIGN_OR_RETURN(core::HeadState state,
                     core::DecodeHeadState(encoded[i],
                                           absl::StrCat("the heal's state ", i + 1, " of ",
                                                        encoded.size(), " from replica ", source),
                                           secret));
    RETURN_IF_ERROR(ops.CheckOwnRows(state, "heal.vocab_size"));
    states.push_back(std::move(state));
  }
  // Verified whole before anything changes: what this process held (nothing, or heads of an
  // epoch it was evicted from) goes, the leader's comes.
  for (const HeadDescription& held : ops.List()) RETURN_IF_ERROR(ops.Drop(held.id));
  for (core::HeadState& state : states) {
    ASSIGN_OR_RETURN(const HeadDescription d, ops.InstallState(state, "heal."));
    ops.LogEvent(absl::StrCat("head healed from replica ", source, ": \"", d.id, "\" version ",
                              d.weight_version));
  }
  return absl::OkStatus();
}

// A hash of every head's canonical bytes here.
absl::StatusOr<uint64_t> HashOwnStates(HeadOperations& ops) {
  std::vector<torch::Tensor> bytes;
  for (const std::string& id : SortedIds(ops.List())) {
    ASSIGN_OR_RETURN(const core::HeadState state, CaptureAsIs(ops, id));
    ASSIGN_OR_RETURN(const std::string encoded, core::EncodeHeadState(state, {}));
    bytes.push_back(torch::tensor(static_cast<int64_t>(encoded.size())));
    bytes.push_back(torch::from_blob(const_cast<char*>(encoded.data()),
                                     {static_cast<int64_t>(encoded.size())}, torch::kUInt8)
                        .clone());
  }
  return HashTensors(bytes);
}

}  // namespace

absl::Status HealReplica(HeadOperations& ops, int epoch, int admitted) {
  Placement& placement = ops.placement();
  const bool joiner = placement.replica() == admitted;
  const core::StateSecret secret{.secret = placement.heal_secret(),
                                 .origin = "the group's --group_secret_file"};
  std::string bundle;
  absl::Status outcome = absl::OkStatus();
  // The leader's replica sends (never the joiner: it is the newest serving replica).
  const int source = placement.leader_replica();
  if (placement.replica() == source) {
    absl::StatusOr<std::string> encoded = EncodeOwnStates(ops, secret);
    // The leader's ranks never fail here but for memory; an empty bundle then fails the joiner.
    if (encoded.ok()) bundle = *std::move(encoded);
    outcome = encoded.status();
  }
  RETURN_IF_ERROR(placement.BroadcastHeal(bundle, epoch, joiner));
  if (joiner) {
    if (placement.testonly_corrupt_heal() && !bundle.empty()) bundle[bundle.size() / 2] ^= 0x5a;
    outcome = InstallHealed(ops, bundle, secret, source);
    if (!outcome.ok()) ops.LogEvent(absl::StrCat("heal refused: ", outcome.message()));
  }
  // Every replica compares the bytes of what it holds (the joiner's, whatever it installed).
  ASSIGN_OR_RETURN(const uint64_t mine, HashOwnStates(ops));
  torch::Tensor hash = torch::empty({1}, torch::kInt64);
  std::memcpy(hash.data_ptr<int64_t>(), &mine, sizeof(mine));
  const absl::Status compared =
      placement.CompareReplicas({hash}, "every head's state after the heal");
  if (outcome.ok()) outcome = compared;
  placement.HealEnded(outcome, joiner);
  return outcome;
}

}  // namespace remotehead::server
