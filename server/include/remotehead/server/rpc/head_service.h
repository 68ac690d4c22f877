// The gRPC HeadService of remotehead (callback API). What a caller sees is this small interface:
// the service to register with a grpc::ServerBuilder, and its admission controller. The
// implementation is private (server/src/): unary handlers in head_service.cc, the streaming step
// reactor in step_reactor.cc, the upload / export / gradient streams in stream_reactors.cc; all
// of them translate protobuf ⇄ core and statuses only, while the work is done by StepSession
// (one step call) and HeadOperations (everything else), and every number by core/.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <memory>

#include "absl/status/status.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/server/service/admission.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/server/service/service_options.h"
#include "remotehead/v1/head_service.grpc.pb.h"

namespace remotehead::server {

class ClusterDrain;

class HeadService {
 public:
  // Serves the heads of `registry`, which must outlive the service.
  static std::unique_ptr<HeadService> Create(HeadRegistry* registry, ServiceOptions options);
  // Destroy after the grpc::Server has shut down (no call may still be running).
  virtual ~HeadService() = default;

  // Register with a grpc::ServerBuilder.
  virtual v1::HeadService::CallbackService& service() = 0;
  // A new call of the step RPC of `mode` (ForwardBackward, Forward or Backward), as service()
  // serves it: raw, on gRPC ByteBuffers (it parses the requests and frames the results around
  // their bytes itself). For a service that wraps this one and registers the step methods raw
  // too (MarkMethodRawCallback, at the method's index in the proto's HeadService).
  virtual grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Step(
      grpc::CallbackServerContext* context, core::CallMode mode) = 0;
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
  // A mesh's replica front other than the leader: runs the mesh's commands on its replica, in
  // order, until `stop` is set (OK) or the leader is gone (UNAVAILABLE).
  virtual absl::Status FollowMesh(const std::atomic<bool>& stop) = 0;
  // The server begins to drain: every new call is refused (UNAVAILABLE, reason
  // SERVER_DRAINING), and the ranks waiting at synchronous optimizer steps get the same now
  // (nothing applied) instead of holding the drain until their timeout.
  virtual void Drain() = 0;
  // Drain(), then waits until `deadline` for the calls in flight; whether none runs.
  virtual bool Quiesce(std::chrono::steady_clock::time_point deadline) = 0;
  // Add to the grpc::ServerBuilder's interceptors: counts the calls in flight (for Quiesce).
  virtual std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallCounter() = 0;
  // A head group's or mesh's drain at SIGTERM (server/src/replication/cluster_drain.h).
  virtual ClusterDrain& cluster_drain() = 0;
};

}  // namespace remotehead::server
