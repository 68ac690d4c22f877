// A request's engine calls on a head group: the front sends one command per engine call (the
// step options it resolved, the pin, the batch's shapes), every rank joins the broadcast of the
// batch and runs the engine on its shard (core::StepOptions::shard), and a last command commits
// or discards every rank's scratch dW. The one home of the step commands' encoding; the
// front's side is GroupStepFront (the StepFanout a StepSession runs its calls through), the
// other ranks' GroupStepFollower.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/v1/head_group.pb.h"
#include "remotehead/v1/head_service.pb.h"
#include "step/step_call.h"

namespace remotehead::server {

// The front: the command of one engine call of request `session`, and the tensors its broadcast
// carries, in the command's order.
v1::GroupCommand StepBatchCommand(int64_t session, const v1::StepHeader& header,
                                  core::CallMode mode, bool accumulate, const HeadPin& pin,
                                  int64_t first_row, const core::TokenBatch& batch,
                                  const torch::Tensor& grad_output);
std::vector<torch::Tensor> BatchTensors(const core::TokenBatch& batch,
                                        const torch::Tensor& grad_output);
// The end of request `session`: commit its scratch (under `pin`, with `key`) or discard it.
v1::GroupCommand StepEndCommand(int64_t session, const std::string& head_id, bool commit,
                                const std::optional<HeadPin>& pin,
                                const std::optional<GradientKey>& key, std::optional<double> loss);

// The front's side of one request: its engine calls and its end, sent to every rank with the
// request's own header (which every rank reads as the front did, step_header.h).
class GroupStepFront final : public StepFanout {
 public:
  GroupStepFront(HeadGroup* group, v1::StepHeader header)
      : group_(group), header_(std::move(header)), session_(group->NewSession()) {}
  // A request that ends without committing: the other ranks' scratch is freed, not committed.
  ~GroupStepFront() override;
  GroupStepFront(const GroupStepFront&) = delete;
  GroupStepFront& operator=(const GroupStepFront&) = delete;

  const core::VocabShard* Shard(const std::vector<core::ShardRange>& ranges) override;
  absl::Status RunBatch(const Batch& call, const HeadEntry& entry, const HeadEntry* teacher,
                        std::optional<HeadPin>* pin, const Here& here) override;
  absl::StatusOr<CommitResult> Commit(
      const StepCommit& commit, const std::function<absl::StatusOr<CommitResult>()>& here) override;

 private:
  HeadGroup* const group_;
  const v1::StepHeader header_;
  const int64_t session_;  // this request's id in the step commands
  core::VocabShard shard_;
  bool open_ = false;  // the other ranks hold scratch for it
};

// The other ranks: the requests the front is computing, each with this rank's scratch dW.
class GroupStepFollower {
 public:
  GroupStepFollower(HeadRegistry* registry, HeadGroup* group, torch::Device device)
      : registry_(registry), group_(group), device_(device) {}

  // Runs a step_batch or step_end command.
  absl::Status Follow(const v1::GroupCommand& command);

 private:
  absl::Status Batch(const v1::GroupStepBatch& batch);
  absl::Status End(const v1::GroupStepEnd& end);

  HeadRegistry* registry_;
  HeadGroup* group_;
  const torch::Device device_;
  std::map<int64_t, core::GradientBuffers> scratch_;  // by session
  // By session: the head's health its calls computed, the same as the front's (the engine
  // combines it over the group), committed with the scratch.
  std::map<int64_t, HealthWindow> health_;
};

}  // namespace remotehead::server
