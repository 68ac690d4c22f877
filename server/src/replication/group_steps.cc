#include "replication/group_steps.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "step/engine_call.h"
#include "translate/group_commands.h"
#include "translate/step_header.h"

namespace remotehead::server {
namespace {

constexpr char kAuxPrefix[] = "aux:";

}  // namespace

std::vector<torch::Tensor> BatchTensors(const core::TokenBatch& batch,
                                        const torch::Tensor& grad_output) {
  std::vector<torch::Tensor> tensors = {batch.hidden};
  if (batch.targets.defined()) tensors.push_back(batch.targets);
  if (batch.weights.defined()) tensors.push_back(batch.weights);
  for (const auto& [name, t] : batch.aux) tensors.push_back(t);
  if (batch.teacher_hidden.defined()) tensors.push_back(batch.teacher_hidden);
  if (grad_output.defined()) tensors.push_back(grad_output);
  return tensors;
}

v1::GroupCommand StepBatchCommand(int64_t session, const v1::StepHeader& header,
                                  core::CallMode mode, bool accumulate, const HeadPin& pin,
                                  int64_t first_row, const core::TokenBatch& batch,
                                  const torch::Tensor& grad_output) {
  v1::GroupCommand command;
  v1::GroupStepBatch* b = command.mutable_step_batch();
  b->set_session(session);
  b->set_head_id(header.head_id());
  b->set_mode(static_cast<int32_t>(mode));
  b->set_accumulate(accumulate);
  *b->mutable_pin() = PinToWire(pin);
  *b->mutable_header() = header;
  b->set_first_row(first_row);
  // In BatchTensors' order.
  *b->add_tensors() = DescribeTensor("hidden", batch.hidden);
  if (batch.targets.defined()) *b->add_tensors() = DescribeTensor("targets", batch.targets);
  if (batch.weights.defined()) *b->add_tensors() = DescribeTensor("weights", batch.weights);
  for (const auto& [name, t] : batch.aux) {
    *b->add_tensors() = DescribeTensor(absl::StrCat(kAuxPrefix, name), t);
  }
  if (batch.teacher_hidden.defined()) {
    *b->add_tensors() = DescribeTensor("teacher_hidden", batch.teacher_hidden);
  }
  if (grad_output.defined()) *b->add_tensors() = DescribeTensor("grad_output", grad_output);
  return command;
}

v1::GroupCommand StepEndCommand(int64_t session, const std::string& head_id, bool commit,
                                const std::optional<HeadPin>& pin,
                                const std::optional<GradientKey>& key, std::optional<double> loss) {
  v1::GroupCommand command;
  v1::GroupStepEnd* end = command.mutable_step_end();
  end->set_session(session);
  end->set_head_id(head_id);
  end->set_commit(commit);
  if (pin.has_value()) *end->mutable_pin() = PinToWire(*pin);
  if (key.has_value()) {
    end->mutable_gradient_id()->set_trainer(key->trainer);
    end->mutable_gradient_id()->set_step(key->step);
    end->mutable_gradient_id()->set_micro_batch(key->micro_batch);
  }
  if (loss.has_value()) end->set_loss(*loss);
  return command;
}

GroupStepFront::~GroupStepFront() {
  if (!open_) return;
  // Best effort: a group that is down discards nothing, and has nothing to keep either.
  absl::StatusOr<HeadGroup::Lane> lane = group_->Enter();
  if (!lane.ok()) return;
  RunCommand(*lane,
             StepEndCommand(session_, header_.head_id(), /*commit=*/false, std::nullopt,
                            std::nullopt, std::nullopt),
             [] { return absl::OkStatus(); })
      .IgnoreError();
}

const core::VocabShard* GroupStepFront::Shard(const std::vector<core::ShardRange>& ranges) {
  shard_ = {.group = &group_->collectives(), .ranges = ranges};
  return &shard_;
}

absl::Status GroupStepFront::RunBatch(const Batch& call, const HeadEntry& entry,
                                      const HeadEntry* teacher, std::optional<HeadPin>* pin,
                                      const Here& here) {
  // The lane first (every group operation takes it before any head's lock), then the pin is
  // checked here before any other rank is asked to compute.
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, group_->Enter());
  auto run = [&](const core::Head& head, const core::Head* teacher_head) {
    open_ = open_ || call.accumulate;
    return RunCommand(lane,
                      StepBatchCommand(session_, header_, call.mode, call.accumulate, **pin,
                                       call.first_row, *call.batch, *call.grad_output),
                      [&]() -> absl::Status {
                        std::vector<torch::Tensor> tensors =
                            BatchTensors(*call.batch, *call.grad_output);
                        RETURN_IF_ERROR(group_->Share(tensors));
                        return here(head, teacher_head);
                      });
  };
  return entry.ReadPinnedWith(teacher, pin, run);
}

absl::StatusOr<CommitResult> GroupStepFront::Commit(
    const StepCommit& commit, const std::function<absl::StatusOr<CommitResult>()>& here) {
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, group_->Enter());
  absl::StatusOr<CommitResult> result = absl::UnknownError("not run");
  open_ = false;  // committed or not, the other ranks let go of the scratch
  RETURN_IF_ERROR(RunCommand(
      lane,
      StepEndCommand(session_, header_.head_id(), /*commit=*/true, commit.pin, commit.key,
                     commit.loss),
      [&] {
        result = here();
        return result.status();
      },
      /*local_last=*/true));
  return result;
}

absl::Status GroupStepFollower::Follow(const v1::GroupCommand& command) {
  if (command.has_step_batch()) return Batch(command.step_batch());
  if (command.has_step_end()) return End(command.step_end());
  return absl::InternalError("head group: not a step command");
}

absl::Status GroupStepFollower::Batch(const v1::GroupStepBatch& b) {
  ASSIGN_OR_RETURN(const std::shared_ptr<HeadEntry> entry, registry_->Get(b.head_id()));
  core::GradientBuffers* grads = nullptr;
  if (b.accumulate()) {
    auto it = scratch_.find(b.session());
    if (it == scratch_.end()) {
      it = scratch_
               .emplace(b.session(), entry->Read([](const core::Head& head) {
                 return head.NewGradientBuffers();
               }))
               .first;
    }
    grads = &it->second;
  }
  // The request's options as the front read them, from the same header by the same function
  // (should_stop, the workspace and the shard are each rank's own).
  ASSIGN_OR_RETURN(StepCall read,
                   ReadStepHeader(b.header(), static_cast<core::CallMode>(b.mode())));
  core::StepOptions options = std::move(read.options);
  options.first_row = b.first_row();
  const core::VocabShard shard{.group = &group_->collectives(), .ranges = entry->shards()};
  options.shard = &shard;
  // A two-head call's teacher: this rank's shard of it (the front checked it against the
  // student: the same rows on every rank).
  std::shared_ptr<HeadEntry> teacher;
  if (!read.teacher_head_id.empty()) {
    ASSIGN_OR_RETURN(teacher, registry_->Get(read.teacher_head_id));
  }
  std::optional<HeadPin> pin = PinFromWire(b.pin());
  auto run = [&](const core::Head& head, const core::Head* teacher_head) -> absl::Status {
    options.teacher = teacher_head;
    std::vector<torch::Tensor> tensors;
    for (const v1::GroupTensor& spec : b.tensors()) {
      ASSIGN_OR_RETURN(torch::Tensor t, EmptyTensor(spec, device_));
      tensors.push_back(std::move(t));
    }
    RETURN_IF_ERROR(group_->Share(tensors));
    core::TokenBatch batch;
    torch::Tensor grad_output;
    for (int i = 0; i < b.tensors_size(); ++i) {
      const std::string& name = b.tensors(i).name();
      torch::Tensor& t = tensors[static_cast<size_t>(i)];
      if (name == "hidden") {
        batch.hidden = t;
      } else if (name == "targets") {
        batch.targets = t;
      } else if (name == "weights") {
        batch.weights = t;
      } else if (name == "grad_output") {
        grad_output = t;
      } else if (name == "teacher_hidden") {
        batch.teacher_hidden = t;
      } else if (absl::StartsWith(name, kAuxPrefix)) {
        batch.aux[name.substr(sizeof(kAuxPrefix) - 1)] = t;
      }
    }
    ASSIGN_OR_RETURN(const EngineOutputs out, RunEngine(static_cast<core::CallMode>(b.mode()), head,
                                                        batch, options, grad_output, grads));
    if (b.accumulate()) health_[b.session()].Add(HealthWindow::Of(out.stats));
    return absl::OkStatus();
  };
  return entry->ReadPinnedWith(teacher.get(), &pin, run);
}

absl::Status GroupStepFollower::End(const v1::GroupStepEnd& end) {
  const auto node = scratch_.extract(end.session());
  const auto health = health_.extract(end.session());
  if (!end.commit()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::shared_ptr<HeadEntry> entry, registry_->Get(end.head_id()));
  // A request that computed no rows accumulated nothing: its zero dW still records its id.
  const core::GradientBuffers scratch =
      !node.empty() ? node.mapped()
                    : entry->Read([](const core::Head& head) { return head.NewGradientBuffers(); });
  StepCommit commit{.scratch = &scratch, .health = health.empty() ? nullptr : &health.mapped()};
  if (end.has_pin()) commit.pin = PinFromWire(end.pin());
  if (end.has_gradient_id()) {
    commit.key = GradientKey{end.gradient_id().trainer(), end.gradient_id().step(),
                             end.gradient_id().micro_batch()};
  }
  if (end.has_loss()) commit.loss = end.loss();
  return entry->Commit(commit).status();
}

}  // namespace remotehead::server
