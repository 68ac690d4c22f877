// One ForwardBackward call, independent of gRPC: validates the header, turns each StepRows
// message into an engine call whose dX goes back to the trainer, accumulates dW into scratch
// buffers, and commits them to the head only when the whole request succeeded — so a failed,
// cancelled or disconnected request leaves the head's gradients bit-identical, and a replayed
// gradient id is recognised and not added twice.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::server {

class StepSession {
 public:
  // kFused: ForwardBackward; kForward: outputs only, nothing accumulated; kBackward: the
  // two-phase backward (rows re-sent with dL/dy for reduction NONE; for a scalar reduction
  // dL/dloss is header.upstream_scale).
  enum class Mode { kFused, kForward, kBackward };

  StepSession(HeadRegistry* registry, Mode mode, int64_t response_chunk_bytes)
      : registry_(registry), mode_(mode), response_chunk_bytes_(response_chunk_bytes) {}

  // Handles one client message; appends what goes back to the client to `responses`.
  absl::Status OnRequest(const v1::StepRequest& request, std::vector<v1::StepResponse>* responses);
  // The client has sent everything: checks completeness, commits, appends the summary.
  absl::Status OnClientDone(std::vector<v1::StepResponse>* responses);

 private:
  absl::Status OnHeader(const v1::StepHeader& header);
  absl::Status OnRows(const v1::StepRows& rows, std::vector<v1::StepResponse>* responses);

  // Runs the engine for one rows message in this session's mode; fills dX / outputs.
  absl::Status Compute(const core::TokenBatch& batch, const torch::Tensor& grad_output,
                       torch::Tensor* grad_hidden, torch::Tensor* outputs);

  HeadRegistry* registry_;
  Mode mode_;
  int64_t response_chunk_bytes_;
  std::shared_ptr<HeadEntry> entry_;
  std::optional<v1::StepHeader> header_;
  core::StepOptions options_;
  std::optional<GradientKey> key_;
  core::GradientBuffers scratch_;
  int64_t next_row_ = 0;
  int64_t valid_tokens_ = 0;
  double loss_ = 0;
  int64_t chunk_rows_ = 0;
  int64_t num_chunks_ = 0;
  std::map<std::string, double> extras_;
};

}  // namespace remotehead::server
