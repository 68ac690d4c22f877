#include "remotehead/server/metrics.h"

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "remotehead/core/memory_stats.h"
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

std::string CodeName(grpc::StatusCode code) {
  static const std::map<grpc::StatusCode, std::string> names = {
      {grpc::StatusCode::OK, "OK"},
      {grpc::StatusCode::CANCELLED, "CANCELLED"},
      {grpc::StatusCode::UNKNOWN, "UNKNOWN"},
      {grpc::StatusCode::INVALID_ARGUMENT, "INVALID_ARGUMENT"},
      {grpc::StatusCode::DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"},
      {grpc::StatusCode::NOT_FOUND, "NOT_FOUND"},
      {grpc::StatusCode::ALREADY_EXISTS, "ALREADY_EXISTS"},
      {grpc::StatusCode::PERMISSION_DENIED, "PERMISSION_DENIED"},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
      {grpc::StatusCode::FAILED_PRECONDITION, "FAILED_PRECONDITION"},
      {grpc::StatusCode::ABORTED, "ABORTED"},
      {grpc::StatusCode::OUT_OF_RANGE, "OUT_OF_RANGE"},
      {grpc::StatusCode::UNIMPLEMENTED, "UNIMPLEMENTED"},
      {grpc::StatusCode::INTERNAL, "INTERNAL"},
      {grpc::StatusCode::UNAVAILABLE, "UNAVAILABLE"},
      {grpc::StatusCode::DATA_LOSS, "DATA_LOSS"},
      {grpc::StatusCode::UNAUTHENTICATED, "UNAUTHENTICATED"}};
  const auto it = names.find(code);
  return it == names.end() ? "UNKNOWN" : it->second;
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
                      .Register(*registry_)) {}

  RpcMetrics& ForRpc(const std::string& rpc) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rpcs_.find(rpc);
    if (it == rpcs_.end()) {
      const prometheus::Labels labels = {{"rpc", rpc}};
      it = rpcs_
               .emplace(rpc, RpcMetrics{&duration_.Add(labels, LatencyBuckets()),
                                        &inflight_.Add(labels), &received_.Add(labels),
                                        &sent_.Add(labels)})
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
    const std::vector<prometheus::ClientMetric::Label> device = {{"device", device_.str()}};
    if (auto stats = core::GetMemoryStats(device_); stats.ok()) {
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
    auto chunk = Gauges("remotehead_logits_chunk_max_bytes",
                        "Largest logits chunk a step has held since the server started");
    AddGauge(chunk, {}, double(largest_logits_chunk_.load()));
    out.push_back(std::move(chunk));

    const AdmissionController* admission = admission_.load();
    if (admission != nullptr) {
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
      const std::vector<prometheus::ClientMetric::Label> head = {{"head", entry->id}};
      std::lock_guard<std::mutex> lock(entry->mu);
      AddGauge(version, head, double(entry->head->version()));
      AddGauge(micro_batches, head, double(entry->applied.size()));
      if (entry->last_loss.has_value()) AddGauge(loss, head, *entry->last_loss);
    }
    for (auto* family : {&count, &version, &micro_batches, &loss}) out.push_back(*family);
    return out;
  }

  const HeadRegistry* heads_;
  const torch::Device device_;
  const int64_t budget_;
  std::atomic<const AdmissionController*> admission_{nullptr};
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Histogram>& phases_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Counter>& received_;
  prometheus::Family<prometheus::Counter>& sent_;
  prometheus::Family<prometheus::Gauge>& inflight_;
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

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::vector<std::weak_ptr<prometheus::Collectable>> collectables) {
  const size_t colon = address.rfind(':');
  int port = -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535 ||
      ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address: expected IPv4 host:port (e.g. 0.0.0.0:9464); got \"", address, "\""));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string reason = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("--metrics_address: cannot listen on \"", address, "\": ", reason));
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(fd, ntohs(addr.sin_port), std::move(collectables)));
}

MetricsHttpServer::MetricsHttpServer(int fd, int port,
                                     std::vector<std::weak_ptr<prometheus::Collectable>> c)
    : fd_(fd), port_(port), collectables_(std::move(c)) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_.store(true);
  thread_.join();
  ::close(fd_);
}

void MetricsHttpServer::Serve() {
  while (!stop_.load()) {
    pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, /*timeout_ms=*/200) <= 0) continue;  // re-checks stop_ 5 times a second
    const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    // A client that stalls cannot hold the one serving thread for long.
    const timeval timeout{.tv_sec = 2, .tv_usec = 0};
    ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    ::setsockopt(client, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    Answer(client);
    ::close(client);
  }
}

void MetricsHttpServer::Answer(int client) const {
  std::string request;
  char buffer[2048];
  while (!absl::StrContains(request, "\r\n\r\n") && request.size() < 16384) {
    const ssize_t n = ::recv(client, buffer, sizeof(buffer), 0);
    if (n <= 0) return;
    request.append(buffer, static_cast<size_t>(n));
  }
  std::string status = "200 OK";
  std::string body;
  if (absl::StartsWith(request, "GET /metrics ") || absl::StartsWith(request, "GET /metrics?")) {
    std::vector<prometheus::MetricFamily> families;
    for (const auto& weak : collectables_) {
      if (auto collectable = weak.lock()) {
        auto collected = collectable->Collect();
        families.insert(families.end(), std::make_move_iterator(collected.begin()),
                        std::make_move_iterator(collected.end()));
      }
    }
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, families);
    body = out.str();
  } else {
    status = "404 Not Found";
    body = "remotehead-server serves GET /metrics only\n";
  }
  const std::string response =
      absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8",
                   "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace remotehead::server
