#include "remotehead/server/service/metrics.h"

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
#include "remotehead/server/group/metric_source.h"
#include "remotehead/server/service/head_registry.h"

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

// gRPC's canonical code names (INVALID_ARGUMENT, …): absl::StatusCode shares the codes and
// absl::StatusCodeToString spells them the same way; codes outside the canonical range are
// reported as UNKNOWN.
std::string CodeName(int code) {
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
struct ServerMetrics::RpcObservation::Counters {
  prometheus::Histogram* duration;
  prometheus::Gauge* inflight;
  prometheus::Counter* received_bytes;
  prometheus::Counter* sent_bytes;
};

class ServerMetrics::Impl : public prometheus::Collectable {
 public:
  using RpcMetrics = RpcObservation::Counters;

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

  void CountRequest(const std::string& rpc, int code) {
    requests_.Add({{"rpc", rpc}, {"code", CodeName(code)}}).Increment();
  }

  void ObserveStep(const std::string& rpc, const std::string& head, const std::string& function,
                   int64_t valid_tokens, const StepPhaseSeconds& t, int64_t logits_chunk_bytes) {
    tokens_.Add({{"head", head}, {"function", function}}).Increment(double(valid_tokens));
    const std::pair<const char*, double> phases[] = {
        {"queue", t.queue}, {"receive", t.receive}, {"compute", t.compute}, {"send", t.send}};
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
    CollectSources(out);
    return out;
  }

  // The families of the sources (a head group's rank, a mesh's), as they are now.
  void CollectSources(std::vector<prometheus::MetricFamily>& out) const {
    std::lock_guard<std::mutex> lock(sources_mu_);
    for (const MetricSource* source : sources_) {
      for (const MetricFamilySamples& f : source->Metrics()) {
        prometheus::MetricFamily family{
            .name = f.name,
            .help = f.help,
            .type = f.counter ? prometheus::MetricType::Counter : prometheus::MetricType::Gauge,
            .metric = {}};
        for (const MetricSample& sample : f.samples) {
          prometheus::ClientMetric m;
          for (const auto& [name, value] : sample.labels) m.label.push_back({name, value});
          (f.counter ? m.counter.value : m.gauge.value) = sample.value;
          family.metric.push_back(std::move(m));
        }
        out.push_back(std::move(family));
      }
    }
  }

  void AddSource(const MetricSource* source) {
    std::lock_guard<std::mutex> lock(sources_mu_);
    sources_.push_back(source);
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
    HealthFamilies health;
    const auto entries = heads_->List();
    AddGauge(count, {}, double(entries.size()));
    for (const auto& entry : entries) {
      const HeadDescription d = entry->Describe();
      const std::vector<prometheus::ClientMetric::Label> head = {{"head", d.id}};
      AddGauge(version, head, double(d.weight_version));
      AddGauge(micro_batches, head, double(d.accumulated_micro_batches));
      if (d.last_loss.has_value()) AddGauge(loss, head, *d.last_loss);
      health.Add(head, d);
    }
    for (auto* family : {&count, &version, &micro_batches, &loss}) out.push_back(*family);
    health.MoveTo(out);
  }

  // The head's health at its last optimizer step (HeadDescription::step_health): means over
  // the step window's training tokens, the GRPO family's only where its calls reported them.
  struct HealthFamilies {
    prometheus::MetricFamily entropy = Gauges(
        "remotehead_head_entropy_mean",
        "Mean entropy (nats) of the head's predicted distribution over the training tokens of "
        "its last optimizer step's micro-batches");
    prometheus::MetricFamily logit_max = Gauges(
        "remotehead_head_logit_max",
        "Largest logit (after logit scale, softcap and temperature) over the training tokens "
        "of the head's last optimizer step");
    prometheus::MetricFamily logit_max_mean = Gauges(
        "remotehead_head_logit_max_mean", "Mean over those tokens of each token's largest logit");
    prometheus::MetricFamily z_loss =
        Gauges("remotehead_head_z_loss_mean",
               "Mean lse² (the z-loss without its coefficient) over those tokens");
    prometheus::MetricFamily clipped =
        Gauges("remotehead_head_clipped_fraction",
               "Fraction of the clipping (GRPO-family) calls' tokens whose ratio was clipped, last "
               "optimizer step");
    prometheus::MetricFamily kl = Gauges(
        "remotehead_head_kl_mean",
        "Mean KL to the reference policy over the tokens of the calls that reported it, last "
        "optimizer step");
    prometheus::MetricFamily tokens{
        .name = "remotehead_head_step_tokens_total",
        .help =
            "Training tokens (valid tokens of calls that accumulated dW) of the micro-batches "
            "the head's optimizer steps applied",
        .type = prometheus::MetricType::Counter,
        .metric = {}};

    void Add(const std::vector<prometheus::ClientMetric::Label>& head, const HeadDescription& d) {
      prometheus::ClientMetric total;
      total.label = head;
      total.counter.value = double(d.step_tokens_total);
      tokens.metric.push_back(std::move(total));
      if (!d.step_health.has_value()) return;
      const HealthWindow& w = *d.step_health;
      const double n = double(w.health.tokens);
      AddGauge(entropy, head, w.health.entropy_sum / n);
      AddGauge(logit_max, head, w.health.logit_max);
      AddGauge(logit_max_mean, head, w.health.logit_max_sum / n);
      AddGauge(z_loss, head, w.health.lse_sq_sum / n);
      if (w.clipped_tokens > 0) AddGauge(clipped, head, w.clipped_sum / double(w.clipped_tokens));
      if (w.kl_tokens > 0) AddGauge(kl, head, w.kl_sum / double(w.kl_tokens));
    }
    void MoveTo(std::vector<prometheus::MetricFamily>& out) {
      for (auto* family :
           {&entropy, &logit_max, &logit_max_mean, &z_loss, &clipped, &kl, &tokens}) {
        out.push_back(std::move(*family));
      }
    }
  };

  const HeadRegistry* heads_;
  const torch::Device device_;
  const int64_t budget_;
  std::atomic<const AdmissionController*> admission_{nullptr};
  mutable std::mutex sources_mu_;
  std::vector<const MetricSource*> sources_;  // guarded by sources_mu_
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

ServerMetrics::RpcObservation::RpcObservation(std::shared_ptr<Impl> metrics, const std::string& rpc)
    : metrics_(std::move(metrics)),
      rpc_(rpc),
      counters_(&metrics_->ForRpc(rpc)),
      start_(Clock::now()) {
  counters_->inflight->Increment();
}

ServerMetrics::RpcObservation::~RpcObservation() {
  if (!done_) Finish(static_cast<int>(absl::StatusCode::kCancelled));
}

void ServerMetrics::RpcObservation::Received(int64_t bytes) {
  counters_->received_bytes->Increment(double(bytes));
}

void ServerMetrics::RpcObservation::Sent(int64_t bytes) {
  counters_->sent_bytes->Increment(double(bytes));
}

void ServerMetrics::RpcObservation::Finish(int code) {
  if (done_) return;
  done_ = true;
  counters_->inflight->Decrement();
  counters_->duration->Observe(std::chrono::duration<double>(Clock::now() - start_).count());
  metrics_->CountRequest(rpc_, code);
}

std::unique_ptr<ServerMetrics::RpcObservation> ServerMetrics::StartRpc(const std::string& rpc) {
  return std::make_unique<RpcObservation>(impl_, rpc);
}

ServerMetrics::ServerMetrics(const HeadRegistry* registry, torch::Device device,
                             int64_t memory_budget_bytes)
    : impl_(std::make_shared<Impl>(registry, device, memory_budget_bytes)) {}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::set_admission(const AdmissionController* admission) {
  impl_->admission_.store(admission);
}

void ServerMetrics::AddSource(const MetricSource* source) { impl_->AddSource(source); }

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

void ServerMetrics::ObserveStep(const std::string& rpc, const std::string& head,
                                const std::string& function, int64_t valid_tokens,
                                const StepPhaseSeconds& phases, int64_t logits_chunk_bytes) {
  impl_->ObserveStep(rpc, head, function, valid_tokens, phases, logits_chunk_bytes);
}

}  // namespace remotehead::server
