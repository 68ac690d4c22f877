// A request's engine calls on a head group: the front sends one command per engine call (the
// step options it resolved, the pin, the batch's shapes), every rank joins the broadcast of the
// batch and runs the engine on its shard (core::StepOptions::shard), and a last command commits
// or discards every rank's scratch dW. The one home of the step commands' encoding; the
// front's side is StepSession's, the other ranks' GroupStepFollower.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/v1/head_group.pb.h"

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
};

}  // namespace remotehead::server
