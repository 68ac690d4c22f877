// Prometheus metrics of a remotehead server (prometheus-cpp): the registry and its families.
// Protocol metrics (requests by RPC and status code, latency, bytes, in-flight calls) are
// recorded by one gRPC interceptor (rpc/metrics_interceptor.h) through RpcObservation, so no
// handler counts its own calls; step metrics (tokens, latency by phase, logits chunk) are
// reported by the step pipeline; state (device memory, admission, per-head version, micro-
// batches and last loss, a head group's and a mesh's families through MetricSource) is read at
// scrape time. Every name is listed in docs/metrics.md. The exposition over HTTP is
// metrics_http.h's.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/server/service/admission.h"

namespace prometheus {
class Collectable;
}

namespace remotehead::server {

class HeadRegistry;
class MetricSource;

// The phases of a successful step call, in seconds (StepTimings on the wire).
struct StepPhaseSeconds {
  double queue = 0;    // waiting for admission
  double receive = 0;  // compute idle, waiting for the client's rows
  double compute = 0;  // engine time
  double send = 0;     // compute paused: results not yet taken
};

class ServerMetrics {
 public:
  // `registry` and `admission` are read at scrape time and must outlive this object;
  // `admission` may be set later (the service owns it).
  ServerMetrics(const HeadRegistry* registry, c10::Device device, int64_t memory_budget_bytes);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  void set_admission(const AdmissionController* admission);
  // Families read at scrape time from `source` (a head group's rank, a mesh's; it must outlive
  // this object).
  void AddSource(const MetricSource* source);

  // What an Exposer serves: the metrics recorded here and the scrape-time state.
  std::vector<std::weak_ptr<prometheus::Collectable>> Collectables() const;

  class Impl;
  // One RPC as the interceptor sees it: in flight from construction, its messages' bytes as
  // they pass, counted once with its status code (Finish, or CANCELLED if it never comes).
  class RpcObservation {
   public:
    struct Counters;  // one RPC's families' children, cached in Impl
    RpcObservation(std::shared_ptr<Impl> metrics, const std::string& rpc);
    ~RpcObservation();
    RpcObservation(const RpcObservation&) = delete;
    RpcObservation& operator=(const RpcObservation&) = delete;
    void Received(int64_t bytes);
    void Sent(int64_t bytes);
    // `code`: the gRPC status code (absl::StatusCode shares its values).
    void Finish(int code);

   private:
    std::shared_ptr<Impl> metrics_;
    const std::string rpc_;
    Counters* counters_;  // stable: Impl keeps them for its lifetime
    const std::chrono::steady_clock::time_point start_;
    bool done_ = false;
  };
  std::unique_ptr<RpcObservation> StartRpc(const std::string& rpc);

  // A step RPC (ForwardBackward, Forward, Backward) that succeeded.
  void ObserveStep(const std::string& rpc, const std::string& head, const std::string& function,
                   int64_t valid_tokens, const StepPhaseSeconds& phases,
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

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace remotehead::server
