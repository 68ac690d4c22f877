#include "rpc/call_gate.h"

#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::server {

// One per HeadService call: the call runs from its interceptor's creation (before the handler)
// to its destruction (once the call is done, its status sent or the call cancelled).
class CallCounter final : public grpc::experimental::Interceptor {
 public:
  explicit CallCounter(std::atomic<int64_t>* running) : running_(running) {
    running_->fetch_add(1);
  }
  ~CallCounter() override { running_->fetch_sub(1); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  std::atomic<int64_t>* const running_;
};

namespace {

class CallCounterFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallCounterFactory(std::atomic<int64_t>* running) : running_(running) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // Health checks and reflection are no work to wait for.
    const char* method = info->method();
    if (method == nullptr || !absl::StartsWith(method, "/remotehead.v1.HeadService/")) {
      return nullptr;
    }
    return new CallCounter(running_);
  }

 private:
  std::atomic<int64_t>* const running_;
};

}  // namespace

absl::Status CallGate::Admit() const {
  if (!closed_.load()) return absl::OkStatus();
  return core::WithReason(
      absl::UnavailableError(
          "the server is draining (SIGTERM): it takes no new calls; try again later or elsewhere"),
      core::reason::kServerDraining);
}

bool CallGate::AwaitIdle(std::chrono::steady_clock::time_point deadline) const {
  while (running_.load() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallGate::Counter() {
  return std::make_unique<CallCounterFactory>(&running_);
}

}  // namespace remotehead::server
