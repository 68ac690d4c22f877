#include "head_operations.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

std::string Summary(const HeadDescription& d) {
  return absl::StrCat("\"", d.id, "\" [", d.vocab_size, ", ", d.hidden_size, "] ",
                      core::DtypeName(d.dtype), d.has_bias ? " with bias" : "", " on ", d.device,
                      ", version ", d.weight_version);
}

torch::Tensor CpuCopy(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.defined() ? t.to(torch::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true) : t;
}

}  // namespace

void HeadOperations::LogEvent(const std::string& line) const {
  if (event_log_ == nullptr) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  *event_log_ << "remotehead-server: " << line << std::endl;
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

absl::StatusOr<HeadDescription> HeadOperations::CreateFromSeed(const std::string& id,
                                                               const core::HeadInit& init) {
  ASSIGN_OR_RETURN(auto head, core::Head::Initialize(init, {.device = device_}));
  ASSIGN_OR_RETURN(auto entry, registry_->Add(id, std::move(head)));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("head created from seed ", init.seed, ": ", Summary(d)));
  return d;
}

absl::StatusOr<HeadDescription> HeadOperations::CreateFromSafetensors(
    const std::string& id, const SafetensorsSource& source) {
  const std::string field = "safetensors.path";
  ASSIGN_OR_RETURN(const core::CheckpointDir* dir, CheckpointDirFor(field));
  ASSIGN_OR_RETURN(torch::Tensor weight,
                   core::ReadSafetensor(*dir, source.path, source.weight_name, field));
  torch::Tensor bias;
  if (!source.bias_name.empty()) {
    ASSIGN_OR_RETURN(bias, core::ReadSafetensor(*dir, source.path, source.bias_name, field));
  }
  if (source.dtype.has_value()) {
    weight = weight.to(*source.dtype);
    if (bias.defined()) bias = bias.to(*source.dtype);
  }
  ASSIGN_OR_RETURN(auto head, core::Head::FromTensors(weight, bias, {.device = device_}));
  ASSIGN_OR_RETURN(auto entry, registry_->Add(id, std::move(head)));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("head created from ", dir->root(), "/", source.path, " (",
                        source.weight_name, "): ", Summary(d)));
  return d;
}

absl::StatusOr<HeadDescription> HeadOperations::AddUploaded(const std::string& id,
                                                            const torch::Tensor& weight,
                                                            const torch::Tensor& bias,
                                                            bool replace) {
  ASSIGN_OR_RETURN(auto head, core::Head::FromTensors(weight, bias, {.device = device_}));
  ASSIGN_OR_RETURN(auto entry, replace ? registry_->AddOrReplace(id, std::move(head))
                                       : registry_->Add(id, std::move(head)));
  const HeadDescription d = entry->Describe();
  // Replacements come once per optimizer step from trainers that own the parameter: not
  // lifecycle events worth a line each.
  if (!replace) LogEvent(absl::StrCat("head uploaded: ", Summary(d)));
  return d;
}

absl::StatusOr<int64_t> HeadOperations::Save(const std::string& id, const std::string& path,
                                             const std::string& weight_name,
                                             const std::string& bias_name) {
  ASSIGN_OR_RETURN(const core::CheckpointDir* dir, CheckpointDirFor("path"));
  RETURN_IF_ERROR(core::CheckpointDir::CheckRelative(path, "path"));
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  const auto tensors = entry->Read([&](const core::Head& head) {
    std::map<std::string, torch::Tensor> t;
    t[weight_name.empty() ? "lm_head.weight" : weight_name] = CpuCopy(head.weight(), head.dtype());
    if (head.has_bias()) {
      t[bias_name.empty() ? "lm_head.bias" : bias_name] = CpuCopy(head.bias(), head.dtype());
    }
    return t;
  });
  ASSIGN_OR_RETURN(const int64_t bytes, core::WriteSafetensors(*dir, path, tensors, "path"));
  LogEvent(
      absl::StrCat("head \"", id, "\" saved to ", dir->root(), "/", path, " (", bytes, " bytes)"));
  return bytes;
}

absl::StatusOr<HeadSnapshot> HeadOperations::Snapshot(const std::string& id,
                                                      std::optional<torch::ScalarType> dtype,
                                                      bool gradients) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  HeadSnapshot snapshot = entry->Read([&](const core::Head& head) {
    const torch::Tensor& m = gradients ? head.grads().weight : head.weight();
    const torch::Tensor& v = gradients ? head.grads().bias : head.bias();
    const torch::ScalarType out = dtype.value_or(m.scalar_type());
    return HeadSnapshot{.matrix = CpuCopy(m, out), .vector = CpuCopy(v, out)};
  });
  snapshot.description = entry->Describe();
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

absl::Status HeadOperations::Drop(const std::string& id) {
  RETURN_IF_ERROR(registry_->Drop(id));
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
                                                              const OptimizerStepSpec& spec) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  const bool sgd = std::holds_alternative<core::SgdOptions>(spec.optimizer);
  RETURN_IF_ERROR(entry->OptimizerStep(
      [&](core::Head& head, core::OptimizerState& state) {
        return sgd ? core::SgdStep(head, std::get<core::SgdOptions>(spec.optimizer),
                                   spec.grad_scale, &state)
                   : core::AdamWStep(head, std::get<core::AdamWOptions>(spec.optimizer),
                                     spec.grad_scale, &state);
      },
      spec.zero_gradients));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("optimizer step (", sgd ? "sgd" : "adamw", "): ", Summary(d)));
  return d;
}

}  // namespace remotehead::server
