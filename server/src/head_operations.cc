#include "head_operations.h"

#include <map>
#include <mutex>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/status_macros.h"
#include "request_memory.h"

namespace remotehead::server {
namespace {

struct HeadTensors {
  torch::Tensor weight;
  torch::Tensor bias;  // undefined without source.bias_name
};

// Rows [offset, offset + rows) of the weight and bias that `source` names (reading only those),
// in source.dtype when it asks for one.
absl::StatusOr<HeadTensors> ReadHeadTensors(const core::CheckpointDir& dir,
                                            const SafetensorsSource& source,
                                            const std::string& field, int64_t offset,
                                            int64_t rows) {
  HeadTensors t;
  ASSIGN_OR_RETURN(t.weight, core::ReadSafetensorRows(dir, source.path, source.weight_name, offset,
                                                      rows, field));
  if (!source.bias_name.empty()) {
    ASSIGN_OR_RETURN(
        t.bias, core::ReadSafetensorRows(dir, source.path, source.bias_name, offset, rows, field));
  }
  if (source.dtype.has_value()) {
    t.weight = t.weight.to(*source.dtype);
    if (t.bias.defined()) t.bias = t.bias.to(*source.dtype);
  }
  return t;
}

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
  if (group_ == nullptr) return Rows{.offset = 0, .rows = vocab_size};
  if (vocab_size < group_->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at least one row per rank of the head group of ",
                     group_->size(), "; got ", vocab_size));
  }
  ASSIGN_OR_RETURN(std::vector<core::ShardRange> shards, group_->Ranges(vocab_size));
  const core::ShardRange mine = shards.at(static_cast<size_t>(group_->rank()));
  return Rows{.offset = mine.offset, .rows = mine.rows, .shards = std::move(shards)};
}

absl::StatusOr<HeadDescription> HeadOperations::CreateFromSeed(const std::string& id,
                                                               const core::HeadInit& init,
                                                               const HeadTraits& traits) {
  ASSIGN_OR_RETURN(const Rows rows, RowsOf(init.vocab_size, "init.vocab_size"));
  ASSIGN_OR_RETURN(const uint64_t ticket, ReserveHead(id, rows.rows, init.hidden_size, init.dtype,
                                                      init.bias, traits.grad_dtype, "init."));
  ASSIGN_OR_RETURN(auto entry, AddReserved(id,
                                           core::Head::InitializeRows(init, HeadOptionsOf(traits),
                                                                      rows.offset, rows.rows),
                                           ticket, rows.shards, traits.frozen));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("head created from seed ", init.seed, ": ", Summary(d)));
  return d;
}

absl::StatusOr<HeadDescription> HeadOperations::CreateFromSafetensors(
    const std::string& id, const SafetensorsSource& source, const HeadTraits& traits) {
  const std::string field = "safetensors.path";
  ASSIGN_OR_RETURN(const core::CheckpointDir* dir, CheckpointDirFor(field));
  // The shape from the file's header first: the head's bytes are reserved (and its size
  // checked) before its data is read into memory.
  ASSIGN_OR_RETURN(const core::SafetensorInfo info,
                   core::InspectSafetensor(*dir, source.path, source.weight_name, field));
  if (info.shape.size() != 2 || info.shape[0] < 1 || info.shape[1] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors.weight_name: expected a 2-D tensor [vocab_size, hidden_size]; \"",
                     source.weight_name, "\" has shape [", absl::StrJoin(info.shape, ", "), "]"));
  }
  ASSIGN_OR_RETURN(const Rows rows, RowsOf(info.shape[0], "safetensors.weight_name rows"));
  ASSIGN_OR_RETURN(const uint64_t ticket,
                   ReserveHead(id, rows.rows, info.shape[1], source.dtype.value_or(info.dtype),
                               !source.bias_name.empty(), traits.grad_dtype, "safetensors."));
  // AddReserved gives the reservation back if this fails.
  absl::StatusOr<std::unique_ptr<core::Head>> head =
      [&]() -> absl::StatusOr<std::unique_ptr<core::Head>> {
    ASSIGN_OR_RETURN(const HeadTensors tensors,
                     ReadHeadTensors(*dir, source, field, rows.offset, rows.rows));
    return core::Head::FromTensors(tensors.weight, tensors.bias, HeadOptionsOf(traits));
  }();
  ASSIGN_OR_RETURN(auto entry,
                   AddReserved(id, std::move(head), ticket, rows.shards, traits.frozen));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("head created from ", dir->root(), "/", source.path, " (",
                        source.weight_name, "): ", Summary(d)));
  return d;
}

absl::Status HeadOperations::CheckReplaceKeepsTraits(const std::string& id,
                                                     const HeadTraits& traits) const {
  const absl::StatusOr<std::shared_ptr<HeadEntry>> entry = registry_->Get(id);
  if (!entry.ok()) return absl::OkStatus();
  const bool frozen = (*entry)->frozen();
  if (frozen != traits.frozen) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.frozen: expected ", frozen ? "true" : "false", " (head \"", id,
                     "\" is ", frozen ? "" : "not ",
                     "frozen, and a replace keeps that: drop and upload it to change it); got ",
                     traits.frozen ? "true" : "false"));
  }
  const torch::ScalarType grad_dtype = (*entry)->Describe().grad_dtype;
  if (traits.grad_dtype.has_value() && *traits.grad_dtype != grad_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.grad_dtype: expected ", core::DtypeName(grad_dtype), " (head \"", id,
        "\"'s gradient dtype, which a replace keeps: drop and upload it to change it) or unset; "
        "got ",
        core::DtypeName(*traits.grad_dtype)));
  }
  return absl::OkStatus();
}

absl::Status HeadOperations::ShareUploaded(HeadGroup& group, torch::Tensor* weight,
                                           torch::Tensor* bias) {
  std::vector<torch::Tensor> shared = {weight->to(device_)};
  if (bias->defined()) shared.push_back(bias->to(device_));
  RETURN_IF_ERROR(group.Share(shared));
  *weight = shared[0];
  if (bias->defined()) *bias = shared[1];
  return absl::OkStatus();
}

absl::StatusOr<HeadOperations::Rows> HeadOperations::ShareUploadedRows(torch::Tensor* weight,
                                                                       torch::Tensor* bias) {
  RETURN_IF_ERROR(ShareUploaded(*group_, weight, bias));
  ASSIGN_OR_RETURN(Rows rows, RowsOf(weight->size(0), "header.vocab_size"));
  *weight = weight->narrow(0, rows.offset, rows.rows);
  if (bias->defined()) *bias = bias->narrow(0, rows.offset, rows.rows);
  return rows;
}

absl::StatusOr<HeadDescription> HeadOperations::Upload(const std::string& id, torch::Tensor weight,
                                                       torch::Tensor bias, bool replace,
                                                       const HeadTraits& traits) {
  // Before any tensor is shared: every rank holds the same traits, so all refuse alike.
  if (replace) RETURN_IF_ERROR(CheckReplaceKeepsTraits(id, traits));
  absl::StatusOr<std::shared_ptr<HeadEntry>> entry = registry_->Get(id);
  std::vector<core::ShardRange> shards;
  if (mesh_ != nullptr && mesh_->is_front()) {
    // The leader's W (and b) to every replica's front first, which shares them in its replica.
    RETURN_IF_ERROR(ShareUploaded(*mesh_->fronts(), &weight, &bias));
  }
  if (group_ != nullptr) {
    const int64_t vocab_size = weight.size(0);
    ASSIGN_OR_RETURN(Rows rows, ShareUploadedRows(&weight, &bias));
    if (replace && entry.ok()) {
      const int64_t expected = (*entry)->Describe().vocab_size;
      if (expected != vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("header.vocab_size: expected head \"", id,
                                                       "\"'s ", expected, " rows to replace; got ",
                                                       vocab_size));
      }
    }
    shards = std::move(rows.shards);
  }
  if (replace && entry.ok()) {
    // New values for a head whose bytes are reserved already.
    ASSIGN_OR_RETURN(auto head, core::Head::FromTensors(weight, bias, {.device = device_}));
    RETURN_IF_ERROR((*entry)->ReplaceWeights(*head, ResizeOf(**entry, "")));
  } else {
    ASSIGN_OR_RETURN(const uint64_t ticket,
                     ReserveHead(id, weight.size(0), weight.size(1), weight.scalar_type(),
                                 bias.defined(), traits.grad_dtype, "header."));
    entry = AddReserved(id, core::Head::FromTensors(weight, bias, HeadOptionsOf(traits)), ticket,
                        std::move(shards), traits.frozen);
    RETURN_IF_ERROR(entry.status());
  }
  const HeadDescription d = (*entry)->Describe();
  // Replacements come once per optimizer step from trainers that own the parameter: not
  // lifecycle events worth a line each.
  if (!replace) LogEvent(absl::StrCat("head uploaded: ", Summary(d)));
  return d;
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
    // On a group the copies stay on the device until they are gathered.
    if (group_ != nullptr)
      return HeadSnapshot{.matrix = m.to(out, false, true),
                          .vector = v.defined() ? v.to(out, false, true) : v};
    return HeadSnapshot{.matrix = CpuCopy(m, out), .vector = CpuCopy(v, out)};
  });
  snapshot.description = entry->Describe();
  snapshot.description.weight_version = version;
  if (group_ != nullptr) {
    // The whole head on the front (nothing elsewhere).
    ASSIGN_OR_RETURN(snapshot.matrix, group_->GatherRows(snapshot.matrix, entry->shards()));
    if (snapshot.vector.defined()) {
      ASSIGN_OR_RETURN(snapshot.vector, group_->GatherRows(snapshot.vector, entry->shards()));
    }
    if (snapshot.matrix.defined()) snapshot.matrix = snapshot.matrix.cpu();
    if (snapshot.vector.defined()) snapshot.vector = snapshot.vector.cpu();
  }
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

absl::StatusOr<core::GradientBuffers> HeadOperations::SumGradientsOverReplicas(core::Head& head,
                                                                               bool keep_own) {
  core::GradientBuffers& grads = head.grads();
  core::GradientBuffers own;
  if (keep_own) {
    own.weight = grads.weight.clone();
    if (grads.bias.defined()) own.bias = grads.bias.clone();
  }
  RETURN_IF_ERROR(mesh_->SumOverReplicas(grads.weight));
  if (grads.bias.defined()) RETURN_IF_ERROR(mesh_->SumOverReplicas(grads.bias));
  return own;
}

absl::StatusOr<HeadDescription> HeadOperations::Step(const std::string& id,
                                                     const OptimizerStepSpec& spec,
                                                     bool over_replicas) {
  if (over_replicas && mesh_ == nullptr) {
    return absl::FailedPreconditionError("reduce_step: this server is not a replica of a mesh");
  }
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
              core::GradientBuffers own;
              if (over_replicas) {
                ASSIGN_OR_RETURN(own, SumGradientsOverReplicas(head, !spec.zero_gradients));
              }
              RETURN_IF_ERROR(ChangeOptimizerState(
                  state, core::OptimizerStateBytesAfterStep(head, state, options),
                  ResizeOf(*entry, absl::StrCat(StateBuffers(options), " of head \"", id, "\"")),
                  [&] { return ApplyStep(head, options, spec.grad_scale, &state); }));
              if (own.weight.defined()) head.grads().weight.copy_(own.weight);
              if (own.bias.defined()) head.grads().bias.copy_(own.bias);
              const int every = mesh_ != nullptr ? mesh_->options().checksum_every_steps : 0;
              if (over_replicas && every > 0 && head.version() % every == 0) {
                return mesh_->CompareAcrossReplicas(
                    {head.weight(), head.bias()},
                    absl::StrCat("the weights of head \"", id, "\" at version ", head.version()));
              }
              return absl::OkStatus();
            },
            spec.optimizer);
      },
      spec.zero_gradients));
  LogEvent(
      absl::StrCat("optimizer step (", sgd ? "sgd" : "adamw", "): ", Summary(entry->Describe())));
  return entry->Describe();
}

}  // namespace remotehead::server
