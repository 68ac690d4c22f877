// The gRPC HeadService of remotehead (callback API). What a caller sees is this small interface:
// the service to register with a grpc::ServerBuilder, and its admission controller. The
// implementation is private (server/src/): unary handlers in head_service.cc, the streaming step
// reactor in step_reactor.cc, the upload / export / gradient streams in stream_reactors.cc; all
// of them translate protobuf ⇄ core and statuses only, while the work is done by StepSession
// (one step call) and HeadOperations (everything else), and every number by core/.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <ostream>

#include "absl/status/status.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/server/admission.h"
#include "remotehead/server/head_group.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/server/metrics.h"
#include "remotehead/server/state_store.h"
#include "remotehead/v1/head_service.grpc.pb.h"

namespace remotehead::server {

struct ServiceOptions {
  torch::Device device = torch::kCPU;               // where new heads live
  int64_t response_chunk_bytes = int64_t{1} << 20;  // size of each streamed tensor chunk
  int compute_threads = 1;  // threads running the engine for streaming calls
  // Streaming calls: messages read ahead of the one being computed, and results buffered
  // before compute pauses for a slow reader. Together they bound a call's in-flight bytes.
  int read_ahead_messages = 4;
  int64_t max_pending_response_bytes = int64_t{16} << 20;
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
  // How long the ranks of a synchronous optimizer step wait for the missing ones (from the
  // first arrival) before every waiting rank gets ABORTED naming them.
  double sync_step_timeout_seconds = 300;
};

class HeadService {
 public:
  // Serves the heads of `registry`, which must outlive the service.
  static std::unique_ptr<HeadService> Create(HeadRegistry* registry, ServiceOptions options);
  // Destroy after the grpc::Server has shut down (no call may still be running).
  virtual ~HeadService() = default;

  // Register with a grpc::ServerBuilder.
  virtual v1::HeadService::CallbackService& service() = 0;
  virtual AdmissionController& admission() = 0;
  // Reserves, in admission's memory budget, the bytes of the heads put in the registry before
  // the service existed (--head); RESOURCE_EXHAUSTED if they do not fit it. Heads created
  // through the service reserve theirs before they are allocated.
  virtual absl::Status ReserveLoadedHeads() = 0;
  // Saves the state of every head in the state store (the SIGTERM drain); OK without one.
  virtual absl::Status SaveAllStates() = 0;
  // A head group's rank other than the front: executes the group's commands on this service's
  // heads, in order, until `stop` is set (OK) or the front is gone (UNAVAILABLE).
  virtual absl::Status FollowGroup(const std::atomic<bool>& stop) = 0;
  // The server begins to drain: the ranks waiting at synchronous optimizer steps get
  // UNAVAILABLE now (nothing applied) instead of holding the drain until their timeout.
  virtual void Drain() = 0;
};

}  // namespace remotehead::server
