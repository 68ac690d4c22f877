#include "remotehead/server/metrics.h"

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::server {
namespace {

using Clock = std::chrono::steady_clock;

// Latency buckets from 0.5 ms (a small unary call on loopback) to a minute (a large step
// queued behind others).
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const prometheus::Histogram::BucketBoundaries buckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
      0.25,   0.5,   1.0,    2.5,   5.0,  10.0,  30.0, 60.0};
  return buckets;
}

// "/remotehead.v1.HeadService/ForwardBackward" -> "ForwardBackward": low cardinality.
std::string RpcName(const char* method) {
  const std::string full = method != nullptr ? method : "";
  const size_t slash = full.rfind('/');
  return slash == std::string::npos ? full : full.substr(slash + 1);
}

// gRPC's canonical code names (INVALID_ARGUMENT, …): absl::StatusCode shares the codes and
// absl::StatusCodeToString spells them the same way; codes outside the canonical range are
// reported as UNKNOWN.
std::string CodeName(grpc::StatusCode code) {
  const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

prometheus::MetricFamily Gauges(const std::string& name, const std::string& help) {
  return {.name = name, .help = help, .type = prometheus::MetricType::Gauge, .metric = {}};
}

void AddGauge(prometheus::MetricFamily& family, std::vector<prometheus::ClientMetric::Label> labels,
              double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  family.metric.push_back(std::move(m));
}

}  // namespace

// The recorded metrics, with references cached per RPC, and the scrape-time state.
class ServerMetrics::Impl : public prometheus::Collectable {
 public:
  struct RpcMetrics {
    prometheus::Histogram* duration;
    prometheus::Gauge* inflight;
    prometheus::Counter* received_bytes;
    prometheus::Counter* sent_bytes;
  };

  Impl(const HeadRegistry* heads, torch::Device device, int64_t budget)
      : heads_(heads),
        device_(device),
        budget_(budget),
        registry_(std::make_shared<prometheus::Registry>()),
        requests_(prometheus::BuildCounter()
                      .Name("remotehead_requests_total")
                      .Help("Finished RPCs by method and gRPC status code")
                      .Register(*registry_)),
        duration_(prometheus::BuildHistogram()
                      .Name("remotehead_request_duration_seconds")
                      .Help("RPC latency, first byte received to status sent, by method")
                      .Register(*registry_)),
        phases_(prometheus::BuildHistogram()
                    .Name("remotehead_step_phase_seconds")
                    .Help("Time of a successful step RPC in each phase: queue (admission), "
                          "receive (compute idle, waiting for rows), compute (engine), send "
                          "(compute paused, results not yet taken)")
                    .Register(*registry_)),
        tokens_(prometheus::BuildCounter()
                    .Name("remotehead_tokens_total")
                    .Help("Valid tokens (targets != ignore_index) of successful step RPCs, by "
                          "head and function")
                    .Register(*registry_)),
        received_(prometheus::BuildCounter()
                      .Name("remotehead_received_bytes_total")
                      .Help("Serialized bytes of the messages received, by method")
                      .Register(*registry_)),
        sent_(prometheus::BuildCounter()
                  .Name("remotehead_sent_bytes_total")
                  .Help("Serialized bytes of the messages sent, by method")
                  .Register(*registry_)),
        inflight_(prometheus::BuildGauge()
                      .Name("remotehead_inflight_requests")
                      .Help("RPCs in progress (queued for admission included), by method")
                      .Register(*registry_)),
        group_commands_(prometheus::BuildHistogram()
                            .Name("remotehead_group_command_seconds")
                            .Help("Time this head group rank spent on its part of each group "
                                  "command (step_batch: one engine call on its shard), by command")
                            .Register(*registry_)),
        sync_wait_(prometheus::BuildHistogram()
                       .Name("remotehead_sync_step_wait_seconds")
                       .Help("Time a trainer rank waited at a synchronous optimizer step, from its "
                             "arrival to its answer")
                       .Register(*registry_)
                       .Add({}, LatencyBuckets())),
        sync_waiting_(prometheus::BuildGauge()
                          .Name("remotehead_sync_step_ranks_waiting")
                          .Help("Trainer ranks waiting now at synchronous optimizer steps")
                          .Register(*registry_)
                          .Add({})),
        sync_applied_(prometheus::BuildCounter()
                          .Name("remotehead_sync_steps_applied_total")
                          .Help("Synchronous optimizer steps applied (once for all their ranks)")
                          .Register(*registry_)
                          .Add({})),
        sync_aborted_(prometheus::BuildCounter()
                          .Name("remotehead_sync_steps_aborted_total")
                          .Help("Synchronous optimizer steps not applied, by reason: timeout (a "
                                "rank missing), disagreement, refused (the step failed), "
                                "draining")
                          .Register(*registry_)) {}

  RpcMetrics& ForRpc(const std::string& rpc) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rpcs_.find(rpc);
    if (it == rpcs_.end()) {
      const prometheus::Labels labels = {{"rpc", rpc}};
      it = rpcs_
               .emplace(rpc,
                        RpcMetrics{&duration_.Add(labels, LatencyBuckets()), &inflight_.Add(labels),
                                   &received_.Add(labels), &sent_.Add(labels)})
               .first;
    }
    return it->second;
  }

  void CountRequest(const std::string& rpc, grpc::StatusCode code) {
    requests_.Add({{"rpc", rpc}, {"code", CodeName(code)}}).Increment();
  }

  void ObserveStep(const std::string& rpc, const std::string& head, const std::string& function,
                   int64_t valid_tokens, const v1::StepTimings& t, int64_t logits_chunk_bytes) {
    tokens_.Add({{"head", head}, {"function", function}}).Increment(double(valid_tokens));
    const std::pair<const char*, double> phases[] = {{"queue", t.queue_seconds()},
                                                     {"receive", t.receive_wait_seconds()},
                                                     {"compute", t.compute_seconds()},
                                                     {"send", t.send_wait_seconds()}};
    for (const auto& [phase, seconds] : phases) {
      phases_.Add({{"rpc", rpc}, {"phase", phase}}, LatencyBuckets()).Observe(seconds);
    }
    int64_t seen = largest_logits_chunk_.load();
    while (logits_chunk_bytes > seen &&
           !largest_logits_chunk_.compare_exchange_weak(seen, logits_chunk_bytes)) {
    }
  }

  // Scrape time: device memory (peak since the previous scrape), admission, heads.
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    CollectMemory(out);
    auto chunk = Gauges("remotehead_logits_chunk_max_bytes",
                        "Largest logits chunk a step has held since the server started");
    AddGauge(chunk, {}, double(largest_logits_chunk_.load()));
    out.push_back(std::move(chunk));
    CollectAdmission(out);
    CollectHeads(out);
    CollectGroup(out);
    CollectMesh(out);
    return out;
  }

  // One unlabelled counter.
  static prometheus::MetricFamily Counter(const std::string& name, const std::string& help,
                                          double value) {
    prometheus::MetricFamily family{
        .name = name, .help = help, .type = prometheus::MetricType::Counter, .metric = {}};
    prometheus::ClientMetric m;
    m.counter.value = value;
    family.metric.push_back(std::move(m));
    return family;
  }

  // Bytes sent and received by collective operation, as one counter family.
  static prometheus::MetricFamily BytesByOp(const std::string& name, const std::string& help,
                                            const std::map<std::string, CollectiveBytes>& moved) {
    prometheus::MetricFamily family{
        .name = name, .help = help, .type = prometheus::MetricType::Counter, .metric = {}};
    for (const auto& [op, b] : moved) {
      for (const auto& [direction, value] : {std::pair{"sent", b.sent}, {"received", b.received}}) {
        prometheus::ClientMetric m;
        m.label = {{"op", op}, {"direction", direction}};
        m.counter.value = double(value);
        family.metric.push_back(std::move(m));
      }
    }
    return family;
  }

  // A mesh's rank: its replica, whether the mesh is up, dW summed over the replicas (the
  // all-reduce's payload and what it moved on the wire), the weight checksums compared.
  void CollectMesh(std::vector<prometheus::MetricFamily>& out) const {
    const HeadMesh* mesh = mesh_.load();
    if (mesh == nullptr) return;
    auto info = Gauges("remotehead_mesh_info",
                       "1, labelled with this process's replica and the mesh's replicas");
    AddGauge(info,
             {{"replica", std::to_string(mesh->replica())},
              {"replicas", std::to_string(mesh->replicas())}},
             1);
    out.push_back(std::move(info));
    auto up = Gauges("remotehead_mesh_up", "1 while the mesh's log works, 0 once it is down");
    AddGauge(up, {}, mesh->health().ok() ? 1 : 0);
    out.push_back(std::move(up));
    out.push_back(Counter("remotehead_mesh_reduced_bytes_total",
                          "Bytes of dW (and db) this rank summed over the replicas at optimizer "
                          "steps",
                          double(mesh->reduced_bytes())));
    out.push_back(Counter("remotehead_mesh_reduce_seconds_total",
                          "Time this rank spent summing dW over the replicas (both collectives)",
                          mesh->reduce_seconds()));
    out.push_back(BytesByOp("remotehead_mesh_collective_bytes_total",
                            "Bytes this rank's collectives with its shard peers in the other "
                            "replicas sent and received, by operation",
                            mesh->PeerBytes()));
    prometheus::MetricFamily checks{
        .name = "remotehead_mesh_checksums_total",
        .help = "Weight checksums compared across the replicas, by result",
        .type = prometheus::MetricType::Counter,
        .metric = {}};
    for (const bool matched : {true, false}) {
      prometheus::ClientMetric m;
      m.label = {{"result", matched ? "match" : "mismatch"}};
      m.counter.value = double(mesh->checksums(matched));
      checks.metric.push_back(std::move(m));
    }
    out.push_back(std::move(checks));
  }

  // A head group's rank: which one, whether the group is up, what its collectives moved.
  void CollectGroup(std::vector<prometheus::MetricFamily>& out) const {
    HeadGroup* group = group_.load();
    if (group == nullptr) return;
    auto info = Gauges("remotehead_group_info",
                       "1, labelled with this process's rank in its head group and the group size");
    AddGauge(info,
             {{"rank", std::to_string(group->rank())}, {"size", std::to_string(group->size())}}, 1);
    auto up = Gauges("remotehead_group_up", "1 while the head group works, 0 once it is down");
    AddGauge(up, {}, group->health().ok() ? 1 : 0);
    const std::map<std::string, CollectiveBytes> moved = group->collectives().Bytes();
    prometheus::MetricFamily bytes =
        BytesByOp("remotehead_group_collective_bytes_total",
                  "Bytes this rank's collectives sent and received, by operation", moved);
    prometheus::MetricFamily calls{.name = "remotehead_group_collectives_total",
                                   .help = "Collectives this rank ran, by operation",
                                   .type = prometheus::MetricType::Counter,
                                   .metric = {}};
    for (const auto& [op, b] : moved) {
      prometheus::ClientMetric m;
      m.label = {{"op", op}};
      m.counter.value = double(b.calls);
      calls.metric.push_back(std::move(m));
    }
    for (auto* family : {&info, &up, &bytes, &calls}) out.push_back(std::move(*family));
  }

  void CollectMemory(std::vector<prometheus::MetricFamily>& out) const {
    auto stats = core::GetMemoryStats(device_);
    if (!stats.ok()) return;
    const std::vector<prometheus::ClientMetric::Label> device = {{"device", device_.str()}};
    auto allocated = Gauges("remotehead_device_memory_allocated_bytes",
                            "Bytes held by live tensors on the device (CUDA caching allocator; "
                            "on CPU the server's counting allocator)");
    auto reserved = Gauges("remotehead_device_memory_reserved_bytes",
                           "Bytes the allocator holds from the system (CPU: = allocated)");
    auto peak = Gauges("remotehead_device_memory_peak_bytes",
                       "Peak of allocated bytes since the previous scrape");
    AddGauge(allocated, device, double(stats->allocated_bytes));
    AddGauge(reserved, device, double(stats->reserved_bytes));
    AddGauge(peak, device, double(stats->peak_allocated_bytes));
    // The next scrape sees the peak of its own interval.
    (void)core::ResetPeakMemory(device_);
    out.push_back(std::move(allocated));
    out.push_back(std::move(reserved));
    out.push_back(std::move(peak));
  }

  void CollectAdmission(std::vector<prometheus::MetricFamily>& out) const {
    const AdmissionController* admission = admission_.load();
    if (admission == nullptr) return;
    const AdmissionStats a = admission->Stats();
    const std::pair<const char*, const char*> names[] = {
        {"remotehead_admission_active_requests", "Step RPCs admitted and running"},
        {"remotehead_admission_queued_requests", "Step RPCs waiting for admission"},
        {"remotehead_admission_reserved_bytes",
         "Bytes reserved by running requests and retained inputs"},
        {"remotehead_admission_budget_bytes", "The memory budget (0 = unlimited)"}};
    const double values[] = {double(a.active), double(a.queued), double(a.bytes_in_use),
                             double(std::max<int64_t>(budget_, 0))};
    for (size_t i = 0; i < 4; ++i) {
      auto family = Gauges(names[i].first, names[i].second);
      AddGauge(family, {}, values[i]);
      out.push_back(std::move(family));
    }
  }

  void CollectHeads(std::vector<prometheus::MetricFamily>& out) const {
    auto count = Gauges("remotehead_heads", "Heads loaded");
    auto version = Gauges("remotehead_head_weight_version",
                          "Weight version of each head (optimizer steps and replacements)");
    auto micro_batches = Gauges("remotehead_head_accumulated_micro_batches",
                                "Micro-batches accumulated into each head's dW since its last "
                                "zeroing");
    auto loss = Gauges("remotehead_head_last_loss",
                       "Loss of the last successful ForwardBackward on each head");
    const auto entries = heads_->List();
    AddGauge(count, {}, double(entries.size()));
    for (const auto& entry : entries) {
      const HeadDescription d = entry->Describe();
      const std::vector<prometheus::ClientMetric::Label> head = {{"head", d.id}};
      AddGauge(version, head, double(d.weight_version));
      AddGauge(micro_batches, head, double(d.accumulated_micro_batches));
      if (d.last_loss.has_value()) AddGauge(loss, head, *d.last_loss);
    }
    for (auto* family : {&count, &version, &micro_batches, &loss}) out.push_back(*family);
  }

  const HeadRegistry* heads_;
  const torch::Device device_;
  const int64_t budget_;
  std::atomic<const AdmissionController*> admission_{nullptr};
  std::atomic<HeadGroup*> group_{nullptr};
  std::atomic<const HeadMesh*> mesh_{nullptr};
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Histogram>& phases_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Counter>& received_;
  prometheus::Family<prometheus::Counter>& sent_;
  prometheus::Family<prometheus::Gauge>& inflight_;
  prometheus::Family<prometheus::Histogram>& group_commands_;
  prometheus::Histogram& sync_wait_;
  prometheus::Gauge& sync_waiting_;
  prometheus::Counter& sync_applied_;
  prometheus::Family<prometheus::Counter>& sync_aborted_;
  std::atomic<int64_t> largest_logits_chunk_{0};
  std::mutex mu_;
  std::map<std::string, RpcMetrics> rpcs_;
};

namespace {

// One per RPC: counts it when its status goes out (or, if none does, when it is destroyed).
class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(std::shared_ptr<ServerMetrics::Impl> metrics, const std::string& rpc,
                     bool protobuf_messages)
      : metrics_(std::move(metrics)),
        rpc_(rpc),
        protobuf_messages_(protobuf_messages),
        m_(metrics_->ForRpc(rpc)),
        start_(Clock::now()) {
    m_.inflight->Increment();
  }

  ~MetricsInterceptor() override {
    if (!done_) Done(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    // remotehead.v1's messages are protobuf messages, whose MessageLite base sits at offset 0
    // (single inheritance). Other services may pass raw ByteBuffers (gRPC's default health
    // service does): their bytes are not counted.
    if (protobuf_messages_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (const void* message = methods->GetRecvMessage(); message != nullptr) {
        m_.received_bytes->Increment(
            double(static_cast<const google::protobuf::MessageLite*>(message)->ByteSizeLong()));
      }
    }
    if (protobuf_messages_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const void* message = methods->GetSendMessage(); message != nullptr) {
        m_.sent_bytes->Increment(
            double(static_cast<const google::protobuf::MessageLite*>(message)->ByteSizeLong()));
      } else if (grpc::ByteBuffer* buffer = methods->GetSerializedSendMessage();
                 buffer != nullptr) {
        m_.sent_bytes->Increment(double(buffer->Length()));
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      Done(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Done(grpc::StatusCode code) {
    done_ = true;
    m_.inflight->Decrement();
    m_.duration->Observe(std::chrono::duration<double>(Clock::now() - start_).count());
    metrics_->CountRequest(rpc_, code);
  }

  std::shared_ptr<ServerMetrics::Impl> metrics_;
  const std::string rpc_;
  const bool protobuf_messages_;
  ServerMetrics::Impl::RpcMetrics& m_;  // stable: std::map nodes do not move
  const Clock::time_point start_;
  bool done_ = false;
};

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(std::shared_ptr<ServerMetrics::Impl> metrics)
      : metrics_(std::move(metrics)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const std::string method = info->method() != nullptr ? info->method() : "";
    return new MetricsInterceptor(metrics_, RpcName(info->method()),
                                  absl::StartsWith(method, "/remotehead.v1.HeadService/"));
  }

 private:
  std::shared_ptr<ServerMetrics::Impl> metrics_;
};

}  // namespace

ServerMetrics::ServerMetrics(const HeadRegistry* registry, torch::Device device,
                             int64_t memory_budget_bytes)
    : impl_(std::make_shared<Impl>(registry, device, memory_budget_bytes)) {}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::set_admission(const AdmissionController* admission) {
  impl_->admission_.store(admission);
}

void ServerMetrics::set_group(HeadGroup* group) { impl_->group_.store(group); }
void ServerMetrics::set_mesh(const HeadMesh* mesh) { impl_->mesh_.store(mesh); }

void ServerMetrics::ObserveGroupCommand(const std::string& command, double seconds) {
  impl_->group_commands_.Add({{"command", command}}, LatencyBuckets()).Observe(seconds);
}

void ServerMetrics::ObserveSyncStepWait(double seconds) { impl_->sync_wait_.Observe(seconds); }

void ServerMetrics::SetSyncStepRanksWaiting(int64_t ranks) {
  impl_->sync_waiting_.Set(static_cast<double>(ranks));
}

void ServerMetrics::CountSyncStepApplied() { impl_->sync_applied_.Increment(); }

void ServerMetrics::CountSyncStepAborted(const std::string& reason) {
  impl_->sync_aborted_.Add({{"reason", reason}}).Increment();
}

std::vector<std::weak_ptr<prometheus::Collectable>> ServerMetrics::Collectables() const {
  return {impl_->registry_, impl_};
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ServerMetrics::InterceptorFactory() {
  return std::make_unique<MetricsInterceptorFactory>(impl_);
}

void ServerMetrics::ObserveStep(const std::string& rpc, const std::string& head,
                                const std::string& function, int64_t valid_tokens,
                                const v1::StepTimings& timings, int64_t logits_chunk_bytes) {
  impl_->ObserveStep(rpc, head, function, valid_tokens, timings, logits_chunk_bytes);
}

}  // namespace remotehead::server
