// What a HeadService is configured with (the server's flags, main.cc; the tests' in-process
// services): where heads live, streaming and admission limits, the event log and metrics, the
// durable state and checkpoint directory, the head group this process is a rank of.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>

#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/service/admission.h"
#include "remotehead/server/service/metrics.h"
#include "remotehead/server/service/state_store.h"

namespace remotehead::server {

struct ServiceOptions {
  torch::Device device = torch::kCPU;               // where new heads live
  int64_t response_chunk_bytes = int64_t{1} << 20;  // size of each streamed tensor chunk
  int compute_threads = 1;  // threads running the engine for streaming calls
  // Streaming calls: messages read ahead of the one being computed, and results buffered
  // before compute pauses for a slow reader. Together they bound a call's in-flight bytes.
  int read_ahead_messages = 4;
  int64_t max_pending_response_bytes = int64_t{16} << 20;
  // A step striped over several streams (StepHeader.stripe) fails when its streams have not all
  // joined within this many seconds of its first: one lost before its header never comes.
  double stripe_join_seconds = 30;
  AdmissionOptions admission;       // memory budget and request limits
  double max_retain_seconds = 600;  // cap on StepHeader.retain_inputs_seconds
  // One line per head lifecycle event (created, uploaded, dropped, saved, gradients zeroed,
  // optimizer step); nullptr = silent.
  std::ostream* event_log = nullptr;
  ServerMetrics* metrics = nullptr;  // Prometheus metrics; nullptr = none
  // Durable training state (--state_dir); nullptr = none (Save/RestoreHeadState are refused).
  // Every `checkpoint_every_steps` weight versions an optimizer step saves the head's state.
  StateStore* state_store = nullptr;
  int checkpoint_every_steps = 0;
  // The only directory that file RPCs (CreateHead from safetensors, SaveWeights) read and write,
  // their paths relative to it (--checkpoint_dir); nullptr = those RPCs are refused.
  std::shared_ptr<const core::CheckpointDir> checkpoint_dir;
  // This process is one rank of a head group (head_group.h): its heads hold its rows of the
  // vocabulary; rank 0 serves the calls and runs each on every rank, the others FollowGroup.
  // nullptr: a server on its own.
  HeadGroup* group = nullptr;
  // This process (its group, or itself) is one replica of a mesh (head_mesh.h); nullptr: none.
  HeadMesh* mesh = nullptr;
  // Every process of the group or mesh (liveness.h): once it is down, every call is refused and
  // the synchronous steps waiting are answered with its verdict. nullptr: a server on its own.
  Liveness* liveness = nullptr;
  // How long the ranks of a synchronous optimizer step wait for the missing ones (from the
  // first arrival) before every waiting rank gets ABORTED naming them.
  double sync_step_timeout_seconds = 300;
  // The engine computes cross_entropy, token_logprobs (without a sampler) and entropy with its
  // fused kernel (core::StepOptions::fused_blocks; docs/engine.md "Fused blocks") on heads that
  // are not split across a group.
  bool fused_blocks = false;
};

}  // namespace remotehead::server
