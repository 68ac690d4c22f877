// HeadOperations' creations: a head initialised from a seed, read from a safetensors checkpoint
// or uploaded (and an upload's replace of an existing head's weights), each with its traits —
// frozen, the dW accumulators' dtype — and its bytes reserved before anything is allocated.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/status_macros.h"
#include "service/head_operations.h"

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

}  // namespace

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

absl::Status HeadOperations::ShareUploaded(ShareFn share, torch::Tensor* weight,
                                           torch::Tensor* bias) {
  std::vector<torch::Tensor> shared = {weight->to(device_)};
  if (bias->defined()) shared.push_back(bias->to(device_));
  RETURN_IF_ERROR((placement_.*share)(shared));
  *weight = shared[0];
  if (bias->defined()) *bias = shared[1];
  return absl::OkStatus();
}

absl::StatusOr<HeadOperations::Rows> HeadOperations::ShareUploadedRows(torch::Tensor* weight,
                                                                       torch::Tensor* bias) {
  RETURN_IF_ERROR(ShareUploaded(&Placement::Share, weight, bias));
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
  if (placement_.replicated()) {
    // The leader's W (and b) to every replica's front first, which shares them in its replica.
    RETURN_IF_ERROR(ShareUploaded(&Placement::ShareFromLeader, &weight, &bias));
  }
  if (placement_.sharded()) {
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

}  // namespace remotehead::server
