// Prometheus metrics of a remotehead server (prometheus-cpp). Protocol metrics (requests by RPC
// and status code, latency, bytes, in-flight calls) come from one gRPC interceptor, so no
// handler counts its own calls; step metrics (tokens, latency by phase, logits chunk) are
// reported by the step reactor; state (device memory, admission, per-head version, micro-
// batches and last loss) is read at scrape time. Every name is listed in docs/metrics.md. The
// exposition over HTTP is metrics_http.h's.
#pragma once

#include <c10/core/Device.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/server/admission.h"

namespace prometheus {
class Collectable;
}

namespace remotehead::v1 {
class StepTimings;
}

namespace remotehead::server {

class HeadGroup;
class HeadMesh;
class HeadRegistry;

class ServerMetrics {
 public:
  // `registry` and `admission` are read at scrape time and must outlive this object;
  // `admission` may be set later (the service owns it).
  ServerMetrics(const HeadRegistry* registry, c10::Device device, int64_t memory_budget_bytes);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  void set_admission(const AdmissionController* admission);
  // A head group's rank: its rank, whether the group is up, and the bytes its collectives
  // moved are read at scrape time (`group` must outlive this object).
  void set_group(HeadGroup* group);
  // A mesh's rank: its replica, whether the mesh is up, the bytes summed over the replicas, the
  // weight checksums compared.
  void set_mesh(const HeadMesh* mesh);

  // What an Exposer serves: the metrics recorded here and the scrape-time state.
  std::vector<std::weak_ptr<prometheus::Collectable>> Collectables() const;
  // Add to the grpc::ServerBuilder (experimental().SetInterceptorCreators).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // A step RPC (ForwardBackward, Forward, Backward) that succeeded.
  void ObserveStep(const std::string& rpc, const std::string& head, const std::string& function,
                   int64_t valid_tokens, const v1::StepTimings& timings,
                   int64_t logits_chunk_bytes);

  // A head group command's part on this rank (HeadGroup::set_observer).
  void ObserveGroupCommand(const std::string& command, double seconds);
  // Synchronous optimizer steps (sync_steps.h): how long a rank waited for the others, how
  // many wait now, the steps applied and those aborted (reason: timeout, disagreement,
  // refused — the step itself failed —, draining).
  void ObserveSyncStepWait(double seconds);
  void SetSyncStepRanksWaiting(int64_t ranks);
  void CountSyncStepApplied();
  void CountSyncStepAborted(const std::string& reason);

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace remotehead::server
