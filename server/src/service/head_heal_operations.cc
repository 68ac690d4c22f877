// HeadOperations' part of the heal of a mesh replica admitted again (head_mesh.h): every rank of
// every serving replica runs it, as the mesh command hc::Heal, on the rows of its shard.
//
//   send     replica 0's rank encodes every head's whole training state (core/head_state.h: W,
//            b, the optimizer state, the version), sealed under the group's secret, and
//            broadcasts them to its shard peers of the admitted epoch;
//   install  the admitted replica's rank decodes each one — the seal and the checksum verified,
//            its rows this rank's — drops whatever heads it held, and installs them;
//   compare  every rank hashes the canonical bytes of every head it holds and the replicas
//            compare them: the heal succeeds only where every replica holds the same bytes.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "group/exchange.h"
#include "remotehead/core/head_state.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_mesh.h"
#include "service/head_operations.h"

namespace remotehead::server {
namespace {

// Every head's ids here, in order: the same order on every replica.
std::vector<std::string> SortedIds(const std::vector<HeadDescription>& heads) {
  std::vector<std::string> ids;
  for (const HeadDescription& d : heads) ids.push_back(d.id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace

absl::StatusOr<core::HeadState> HeadOperations::CaptureOwnState(const std::string& id,
                                                                const std::string& state_id) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  core::HeadState state = entry->CaptureState(state_id);
  const HeadDescription d = entry->Describe();
  // Which rows of which head this is: a restore (or a heal) checks them against its own.
  state.vocab_size = d.vocab_size;
  state.vocab_offset = OwnOffset(d);
  return state;
}

absl::StatusOr<core::HeadState> HeadOperations::CaptureAsIs(const std::string& id) {
  // Under the head's own state id (the last one saved on every member, or none): a capture
  // records its id as the head's, which the heal must not change.
  ASSIGN_OR_RETURN(const HeadDescription d, Describe(id));
  return CaptureOwnState(id, d.state_id);
}

absl::StatusOr<std::string> HeadOperations::EncodeOwnStates(const core::StateSecret& secret) {
  std::vector<std::string> encoded;
  for (const std::string& id : SortedIds(List())) {
    ASSIGN_OR_RETURN(const core::HeadState state, CaptureAsIs(id));
    ASSIGN_OR_RETURN(encoded.emplace_back(), core::EncodeHeadState(state, secret));
  }
  return PackStrings(encoded);
}

absl::Status HeadOperations::InstallHealed(const std::string& bundle,
                                           const core::StateSecret& secret) {
  ASSIGN_OR_RETURN(const std::vector<std::string> encoded, UnpackStrings(bundle));
  std::vector<core::HeadState> states;
  for (size_t i = 0; i < encoded.size(); ++i) {
    ASSIGN_OR_RETURN(core::HeadState state,
                     core::DecodeHeadState(encoded[i],
                                           absl::StrCat("the heal's state ", i + 1, " of ",
                                                        encoded.size(), " from replica 0"),
                                           secret));
    ASSIGN_OR_RETURN(const Rows rows, RowsOf(state.vocab_size, "heal.vocab_size"));
    RETURN_IF_ERROR(core::CheckHeadStateRows(state, state.vocab_size, rows.offset));
    states.push_back(std::move(state));
  }
  // Verified whole before anything changes: what this process held (nothing, or heads of an
  // epoch it was evicted from) goes, replica 0's comes.
  for (const HeadDescription& held : List()) RETURN_IF_ERROR(Drop(held.id));
  for (core::HeadState& state : states) {
    ASSIGN_OR_RETURN(const Rows rows, RowsOf(state.vocab_size, "heal.vocab_size"));
    const HeadTraits traits{.frozen = state.frozen, .grad_dtype = state.grad_dtype};
    ASSIGN_OR_RETURN(
        const uint64_t ticket,
        ReserveHead(state.head_id, state.weight.size(0), state.weight.size(1),
                    state.weight.scalar_type(), state.bias.defined(), state.grad_dtype, "heal."));
    ASSIGN_OR_RETURN(auto entry, AddReserved(state.head_id,
                                             core::Head::FromTensors(state.weight, state.bias,
                                                                     HeadOptionsOf(traits)),
                                             ticket, rows.shards, state.frozen));
    RETURN_IF_ERROR(entry->RestoreState(
        state, /*at_start=*/false,
        ResizeOf(*entry, absl::StrCat("the optimizer state of head \"", state.head_id, "\""))));
    LogEvent(absl::StrCat("head healed from replica 0: ", Summary(entry->Describe())));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> HeadOperations::HashOwnStates() {
  std::vector<torch::Tensor> bytes;
  for (const std::string& id : SortedIds(List())) {
    ASSIGN_OR_RETURN(const core::HeadState state, CaptureAsIs(id));
    ASSIGN_OR_RETURN(const std::string encoded, core::EncodeHeadState(state, {}));
    bytes.push_back(torch::tensor(static_cast<int64_t>(encoded.size())));
    bytes.push_back(torch::from_blob(const_cast<char*>(encoded.data()),
                                     {static_cast<int64_t>(encoded.size())}, torch::kUInt8)
                        .clone());
  }
  return HashTensors(bytes);
}

absl::Status HeadOperations::Heal(int epoch, int admitted) {
  const bool joiner = placement_.replica() == admitted;
  const core::StateSecret secret{.secret = placement_.heal_secret(),
                                 .origin = "the group's --group_secret_file"};
  std::string bundle;
  absl::Status outcome = absl::OkStatus();
  if (placement_.replica() == 0) {
    absl::StatusOr<std::string> encoded = EncodeOwnStates(secret);
    // Replica 0's ranks never fail here but for memory; an empty bundle then fails the joiner.
    if (encoded.ok()) bundle = *std::move(encoded);
    outcome = encoded.status();
  }
  RETURN_IF_ERROR(placement_.BroadcastHeal(bundle, epoch, joiner));
  if (joiner) {
    if (placement_.testonly_corrupt_heal() && !bundle.empty()) bundle[bundle.size() / 2] ^= 0x5a;
    outcome = InstallHealed(bundle, secret);
    if (!outcome.ok()) LogEvent(absl::StrCat("heal refused: ", outcome.message()));
  }
  // Every replica compares the bytes of what it holds (the joiner's, whatever it installed).
  ASSIGN_OR_RETURN(const uint64_t mine, HashOwnStates());
  torch::Tensor hash = torch::empty({1}, torch::kInt64);
  std::memcpy(hash.data_ptr<int64_t>(), &mine, sizeof(mine));
  const absl::Status compared =
      placement_.CompareReplicas({hash}, "every head's state after the heal");
  if (outcome.ok()) outcome = compared;
  placement_.HealEnded(outcome, joiner);
  return outcome;
}

}  // namespace remotehead::server
