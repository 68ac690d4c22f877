// HeadOperations' durable training state (--state_dir): this rank's shard of a head saved and
// restored (head_operations.h). Doing so on every rank of a group or mesh under one state id is
// replication/head_states.cc's.
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "service/head_operations.h"

namespace remotehead::server {

absl::StatusOr<StateStore*> HeadOperations::Store() const {
  if (state_store_ == nullptr) {
    return absl::FailedPreconditionError(
        "head state: expected a server started with --state_dir; got none");
  }
  return state_store_;
}

int64_t HeadOperations::OwnOffset(const HeadDescription& d) const {
  return d.shards.empty() ? 0 : d.shards.at(static_cast<size_t>(placement_.rank())).offset;
}

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

absl::Status HeadOperations::CheckOwnRows(const core::HeadState& state,
                                          const std::string& field) const {
  ASSIGN_OR_RETURN(const Rows rows, RowsOf(state.vocab_size, field));
  return core::CheckHeadStateRows(state, state.vocab_size, rows.offset);
}

absl::StatusOr<HeadDescription> HeadOperations::InstallState(const core::HeadState& state,
                                                             const std::string& field_prefix) {
  ASSIGN_OR_RETURN(const Rows rows, RowsOf(state.vocab_size, field_prefix + "vocab_size"));
  const HeadTraits traits{.frozen = state.frozen, .grad_dtype = state.grad_dtype};
  ASSIGN_OR_RETURN(const uint64_t ticket,
                   ReserveHead(state.head_id, state.weight.size(0), state.weight.size(1),
                               state.weight.scalar_type(), state.bias.defined(), state.grad_dtype,
                               field_prefix));
  ASSIGN_OR_RETURN(auto entry, AddReserved(state.head_id,
                                           core::Head::FromTensors(state.weight, state.bias,
                                                                   HeadOptionsOf(traits)),
                                           ticket, rows.shards, state.frozen));
  RETURN_IF_ERROR(entry->RestoreState(
      state, /*at_start=*/false,
      ResizeOf(*entry, absl::StrCat("the optimizer state of head \"", state.head_id, "\""))));
  return entry->Describe();
}

absl::StatusOr<HeadDescription> HeadOperations::SaveState(const std::string& id,
                                                          const std::string& state_id) {
  ASSIGN_OR_RETURN(StateStore* const store, Store());
  ASSIGN_OR_RETURN(const core::HeadState state, CaptureOwnState(id, state_id));
  ASSIGN_OR_RETURN(const HeadDescription d, Describe(id));
  RETURN_IF_ERROR(store->Save(state));
  LogEvent(absl::StrCat("head state saved: \"", id, "\" version ", state.weight_version, " as ",
                        state.state_id));
  return d;
}

absl::StatusOr<HeadDescription> HeadOperations::RestoreState(const std::string& id,
                                                             const std::string& state_id,
                                                             bool check_only) {
  ASSIGN_OR_RETURN(StateStore* const store, Store());
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  ASSIGN_OR_RETURN(const core::HeadState state, store->Load(id, state_id));
  const HeadDescription before = entry->Describe();
  RETURN_IF_ERROR(core::CheckHeadStateRows(state, before.vocab_size, OwnOffset(before)));
  if (check_only) {
    RETURN_IF_ERROR(
        entry->Read([&](const core::Head& head) { return core::CheckHeadStateFits(state, head); }));
    return before;
  }
  RETURN_IF_ERROR(entry->RestoreState(
      state, /*at_start=*/false,
      ResizeOf(*entry, absl::StrCat("the optimizer state of head \"", id, "\" in ", state_id))));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("head state restored: ", Summary(d), " from ", state_id));
  return d;
}

}  // namespace remotehead::server
