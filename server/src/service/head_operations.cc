#include "service/head_operations.h"

#include <map>
#include <mutex>
#include <variant>

#include "absl/strings/str_cat.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/status_macros.h"
#include "service/request_memory.h"

namespace remotehead::server {
namespace {

torch::Tensor CpuCopy(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.defined() ? t.to(torch::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true) : t;
}

// The buffers each optimizer keeps (named when the budget refuses them).
std::string StateBuffers(const core::SgdOptions&) {
  return "sgd optimizer state (float32 momentum for every parameter)";
}
std::string StateBuffers(const core::AdamWOptions&) {
  return "adamw optimizer state (float32 exp_avg and exp_avg_sq for every parameter)";
}

absl::Status ApplyStep(core::Head& head, const core::SgdOptions& options, double grad_scale,
                       core::OptimizerState* state) {
  return core::SgdStep(head, options, grad_scale, state);
}
absl::Status ApplyStep(core::Head& head, const core::AdamWOptions& options, double grad_scale,
                       core::OptimizerState* state) {
  return core::AdamWStep(head, options, grad_scale, state);
}

}  // namespace

std::string HeadOperations::Summary(const HeadDescription& d) {
  return absl::StrCat("\"", d.id, "\" [", d.vocab_size, ", ", d.hidden_size, "] ",
                      core::DtypeName(d.dtype), d.has_bias ? " with bias" : "", " on ", d.device,
                      ", version ", d.weight_version, d.frozen ? ", frozen" : "");
}

void HeadOperations::LogEvent(const std::string& line) const {
  if (event_log_ == nullptr) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  *event_log_ << "remotehead-server: " << line << std::endl;
}

absl::Status HeadOperations::CheckNewHeadId(const std::string& id, const std::string& field) const {
  // An id whose states could not be saved is refused now, not at its first save.
  return state_store_ == nullptr ? absl::OkStatus() : StateStore::CheckHeadId(id, field);
}

absl::StatusOr<uint64_t> HeadOperations::ReserveHead(const std::string& id, int64_t vocab_size,
                                                     int64_t hidden_size, torch::ScalarType dtype,
                                                     bool bias,
                                                     std::optional<torch::ScalarType> grad_dtype,
                                                     const std::string& field_prefix) {
  RETURN_IF_ERROR(CheckNewHeadId(id, field_prefix == "--head " ? "--head" : "head_id"));
  ASSIGN_OR_RETURN(const MemoryEstimate head,
                   HeadMemory(id, vocab_size, hidden_size, dtype, bias, grad_dtype, field_prefix));
  const uint64_t ticket = admission_->NewTicket();
  RETURN_IF_ERROR(admission_->ReserveHead(ticket, head.bytes, head.breakdown));
  return ticket;
}

HeadEntry::ResizeState HeadOperations::ResizeOf(const HeadEntry& entry, const std::string& why) {
  return [this, ticket = entry.reservation(), why](int64_t delta) {
    return ticket == 0 || delta == 0 ? absl::OkStatus() : admission_->Grow(ticket, delta, why);
  };
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadOperations::AddReserved(
    const std::string& id, absl::StatusOr<std::unique_ptr<core::Head>> head, uint64_t ticket,
    std::vector<core::ShardRange> shards, bool frozen) {
  absl::StatusOr<std::shared_ptr<HeadEntry>> entry =
      head.ok() ? registry_->Add(id, *std::move(head), ticket, std::move(shards), frozen)
                : absl::StatusOr<std::shared_ptr<HeadEntry>>(head.status());
  if (!entry.ok()) admission_->Release(ticket);
  return entry;
}

absl::Status HeadOperations::ReserveLoadedHeads() {
  for (const std::shared_ptr<HeadEntry>& entry : registry_->List()) {
    if (entry->reservation() != 0) continue;
    const HeadDescription d = entry->Describe();
    // The rows this process holds (a head group's rank holds its shard's, not d.vocab_size).
    const int64_t rows = entry->Read([](const core::Head& head) { return head.vocab_size(); });
    ASSIGN_OR_RETURN(const uint64_t ticket, ReserveHead(d.id, rows, d.hidden_size, d.dtype,
                                                        d.has_bias, d.grad_dtype, "--head "));
    entry->set_reservation(ticket);
    RETURN_IF_ERROR(ResizeOf(*entry, absl::StrCat("the restored optimizer state of head \"", d.id,
                                                  "\""))(entry->OptimizerStateBytes()));
  }
  return absl::OkStatus();
}

absl::StatusOr<const core::CheckpointDir*> HeadOperations::CheckpointDirFor(
    const std::string& field) const {
  if (checkpoint_dir_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        field,
        ": expected a server started with --checkpoint_dir (the only directory it reads and "
        "writes checkpoints in); this one was started without, so it touches no files"));
  }
  return checkpoint_dir_.get();
}

absl::StatusOr<HeadOperations::Rows> HeadOperations::RowsOf(int64_t vocab_size,
                                                            const std::string& field) const {
  ASSIGN_OR_RETURN(std::vector<core::ShardRange> shards, placement_.Ranges(vocab_size, field));
  const core::ShardRange mine = shards.at(static_cast<size_t>(placement_.rank()));
  // A head records its shards only when its rows are split.
  if (!placement_.sharded()) shards.clear();
  return Rows{.offset = mine.offset, .rows = mine.rows, .shards = std::move(shards)};
}

absl::Status HeadOperations::CheckCheckpointPath(const std::string& path) const {
  RETURN_IF_ERROR(CheckpointDirFor("path").status());
  return core::CheckpointDir::CheckRelative(path, "path");
}

absl::StatusOr<int64_t> HeadOperations::WriteCheckpoint(const std::string& id,
                                                        const HeadSnapshot& snapshot,
                                                        const std::string& path,
                                                        const std::string& weight_name,
                                                        const std::string& bias_name) {
  RETURN_IF_ERROR(CheckCheckpointPath(path));
  const core::CheckpointDir* dir = checkpoint_dir_.get();
  std::map<std::string, torch::Tensor> tensors;
  tensors[weight_name.empty() ? "lm_head.weight" : weight_name] = snapshot.matrix;
  if (snapshot.vector.defined()) {
    tensors[bias_name.empty() ? "lm_head.bias" : bias_name] = snapshot.vector;
  }
  ASSIGN_OR_RETURN(const int64_t bytes, core::WriteSafetensors(*dir, path, tensors, "path"));
  LogEvent(
      absl::StrCat("head \"", id, "\" saved to ", dir->root(), "/", path, " (", bytes, " bytes)"));
  return bytes;
}

absl::StatusOr<HeadSnapshot> HeadOperations::Snapshot(const std::string& id,
                                                      std::optional<torch::ScalarType> dtype,
                                                      bool gradients) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  int64_t version = 0;  // of the rows copied, read under the same lock
  HeadSnapshot snapshot = entry->Read([&](const core::Head& head) {
    version = head.version();
    const torch::Tensor& m = gradients ? head.grads().weight : head.weight();
    const torch::Tensor& v = gradients ? head.grads().bias : head.bias();
    const torch::ScalarType out = dtype.value_or(m.scalar_type());
    // A whole head goes to the host at once; split rows stay on the device until gathered.
    if (!placement_.sharded()) {
      return HeadSnapshot{.matrix = CpuCopy(m, out), .vector = CpuCopy(v, out)};
    }
    return HeadSnapshot{.matrix = m.to(out, false, true),
                        .vector = v.defined() ? v.to(out, false, true) : v};
  });
  snapshot.description = entry->Describe();
  snapshot.description.weight_version = version;
  // The whole head on the front (nothing on the other ranks of a group).
  ASSIGN_OR_RETURN(snapshot.matrix, placement_.GatherRows(snapshot.matrix, entry->shards()));
  if (snapshot.vector.defined()) {
    ASSIGN_OR_RETURN(snapshot.vector, placement_.GatherRows(snapshot.vector, entry->shards()));
  }
  if (snapshot.matrix.defined()) snapshot.matrix = snapshot.matrix.cpu();
  if (snapshot.vector.defined()) snapshot.vector = snapshot.vector.cpu();
  return snapshot;
}

absl::StatusOr<HeadDescription> HeadOperations::Describe(const std::string& id) const {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  return entry->Describe();
}

std::vector<HeadDescription> HeadOperations::List() const {
  std::vector<HeadDescription> out;
  for (const auto& entry : registry_->List()) out.push_back(entry->Describe());
  return out;
}

absl::Status HeadOperations::UndoCreate(const std::string& id) {
  if (!registry_->Get(id).ok()) return absl::OkStatus();  // never created on this rank
  return Drop(id);
}

absl::Status HeadOperations::Drop(const std::string& id) {
  ASSIGN_OR_RETURN(const std::shared_ptr<HeadEntry> dropped, registry_->Drop(id));
  admission_->Release(dropped->reservation());
  if (state_store_ != nullptr) state_store_->Remove(id);  // it must not come back at a restart
  LogEvent(absl::StrCat("head dropped: \"", id, "\""));
  return absl::OkStatus();
}

absl::StatusOr<HeadDescription> HeadOperations::ZeroGradients(const std::string& id) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  entry->ZeroGradients();
  LogEvent(absl::StrCat("gradients zeroed: \"", id, "\""));
  return entry->Describe();
}

absl::StatusOr<HeadDescription> HeadOperations::OptimizerStep(const std::string& id,
                                                              const OptimizerStepSpec& spec,
                                                              const StepAround& around) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  const bool sgd = std::holds_alternative<core::SgdOptions>(spec.optimizer);
  RETURN_IF_ERROR(entry->OptimizerStep(
      [&](core::Head& head, core::OptimizerState& state) {
        if (spec.expected_weight_version.has_value() &&
            *spec.expected_weight_version != head.version()) {
          return absl::FailedPreconditionError(
              absl::StrCat("expected_weight_version: expected the head's current version ",
                           head.version(), "; got ", *spec.expected_weight_version, " (head \"", id,
                           "\" moved on since this trainer saw it: nothing applied)"));
        }
        return std::visit(
            [&](const auto& options) -> absl::Status {
              // A bad step is refused for what is wrong with it before any memory is asked
              // for; the buffers the first step creates are reserved before they exist.
              RETURN_IF_ERROR(core::CheckOptimizerStep(state, options, spec.grad_scale));
              core::GradientBuffers restore;
              if (around.before) {
                ASSIGN_OR_RETURN(restore, around.before(head));
              }
              RETURN_IF_ERROR(ChangeOptimizerState(
                  state, core::OptimizerStateBytesAfterStep(head, state, options),
                  ResizeOf(*entry, absl::StrCat(StateBuffers(options), " of head \"", id, "\"")),
                  [&] { return ApplyStep(head, options, spec.grad_scale, &state); }));
              if (restore.weight.defined()) head.grads().weight.copy_(restore.weight);
              if (restore.bias.defined()) head.grads().bias.copy_(restore.bias);
              return around.after ? around.after(head) : absl::OkStatus();
            },
            spec.optimizer);
      },
      spec.zero_gradients));
  LogEvent(
      absl::StrCat("optimizer step (", sgd ? "sgd" : "adamw", "): ", Summary(entry->Describe())));
  return entry->Describe();
}

}  // namespace remotehead::server
