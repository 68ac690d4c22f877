#include "remotehead/server/metrics_http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>
#include <pthread.h>

#include <cstring>
#include <sstream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/credentials.h"

// civetweb's threads next to LibTorch. Debian's libcivetweb gives every thread it starts a
// 100 KiB stack (USE_STACK_SIZE=102400, compiled in, no run-time option), and glibc carves the
// static TLS of every library loaded at start out of a thread's requested stack (glibc bug 11787):
// LibTorch with its CUDA libraries needs ~250 KiB of it (libcublasLt alone 92 KiB), so
// pthread_create answers EINVAL and mg_start fails ("Cannot create first worker thread: error 0":
// civetweb prints errno, not pthread_create's result), which made prometheus-cpp's Exposer
// throw. For civetweb's calls only, the requested size is raised by what glibc itself needs
// besides the stack (__pthread_get_minstack: static TLS, guard, minimum), as Rust's std does for
// its threads; every other caller gets exactly what it asked for.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) noexcept {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  using GetMinStack = size_t (*)(const pthread_attr_t*);
  static const auto real =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  static const auto min_stack =
      reinterpret_cast<GetMinStack>(dlsym(RTLD_DEFAULT, "__pthread_get_minstack"));
  Dl_info caller{};
  if (dladdr(__builtin_return_address(0), &caller) != 0 && caller.dli_fname != nullptr &&
      std::strstr(caller.dli_fname, "libcivetweb") != nullptr) {
    size += min_stack != nullptr ? min_stack(attr) : size_t{1} << 20;
  }
  return real(attr, size);
}

namespace remotehead::server {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

struct Address {
  in_addr host{};
  int port = -1;
};

absl::StatusOr<Address> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  Address parsed;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &parsed.port) ||
      parsed.port < 0 || parsed.port > 65535 ||
      ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &parsed.host) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address: expected IPv4 host:port (e.g. 0.0.0.0:9464); got \"", address, "\""));
  }
  return parsed;
}

void Reply(mg_connection* conn, int status, const char* reason, const std::string& body,
           const std::string& extra_headers = "") {
  const std::string head =
      absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: ", kContentType,
                   "\r\nContent-Length: ", body.size(), "\r\nCache-Control: no-store",
                   "\r\nConnection: close\r\n", extra_headers, "\r\n");
  mg_write(conn, head.data(), head.size());
  mg_write(conn, body.data(), body.size());
}

// What civetweb's handler reads. Shared with the thread that stops civetweb, which outlives the
// MetricsHttpServer: once `stopping`, no request reads the collectables any more.
struct Exposition {
  Exposition(std::string t, std::vector<std::weak_ptr<prometheus::Collectable>> c)
      : token(std::move(t)), collectables(std::move(c)) {}

  const std::string token;
  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables;
  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  int answering ABSL_GUARDED_BY(mu) = 0;

  static int Handle(mg_connection* conn, void* self) {
    auto* exposition = static_cast<Exposition*>(self);
    {
      absl::MutexLock lock(&exposition->mu);
      if (exposition->stopping) {
        Reply(conn, 503, "Service Unavailable", "remotehead-server is stopping\n");
        return 503;
      }
      ++exposition->answering;
    }
    const int status = exposition->Answer(conn);
    absl::MutexLock lock(&exposition->mu);
    --exposition->answering;
    return status;
  }

  // Until it returns, no request is being answered and none will read the collectables.
  void Stop() {
    absl::MutexLock lock(&mu);
    stopping = true;
    mu.Await(absl::Condition(
        +[](int* answering) { return *answering == 0; }, &answering));
  }

  int Answer(mg_connection* conn) const {
    const mg_request_info* request = mg_get_request_info(conn);
    if (request->local_uri == nullptr || std::strcmp(request->local_uri, "/metrics") != 0) {
      Reply(conn, 404, "Not Found", "remotehead-server serves GET /metrics only\n");
      return 404;
    }
    if (std::strcmp(request->request_method, "GET") != 0) {
      Reply(conn, 405, "Method Not Allowed", "remotehead-server serves GET /metrics only\n",
            "Allow: GET\r\n");
      return 405;
    }
    if (!token.empty()) {
      const char* authorization = mg_get_header(conn, "Authorization");
      if (authorization == nullptr || !IsBearerToken(authorization, token)) {
        Reply(conn, 401, "Unauthorized",
              "expected \"Authorization: Bearer <token>\" matching the server's "
              "--auth_token_file\n",
              "WWW-Authenticate: Bearer realm=\"remotehead-metrics\"\r\n");
        return 401;
      }
    }
    Reply(conn, 200, "OK", Text());
    return 200;
  }

  std::string Text() const {
    std::vector<prometheus::MetricFamily> families;
    for (const auto& weak : collectables) {
      if (auto collectable = weak.lock()) {
        auto collected = collectable->Collect();
        families.insert(families.end(), std::make_move_iterator(collected.begin()),
                        std::make_move_iterator(collected.end()));
      }
    }
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, families);
    return out.str();
  }
};

}  // namespace

class MetricsHttpServer::Impl {
 public:
  explicit Impl(std::shared_ptr<Exposition> exposition) : exposition_(std::move(exposition)) {}

  // civetweb's own stop takes up to 2 s (its threads poll in 2 s quanta) with a connection idle
  // or not; it runs on a thread of its own, after the handler is closed, so that the destructor
  // returns at once. The port is released when that thread is done.
  ~Impl() {
    if (context_ == nullptr) return;
    exposition_->Stop();
    std::thread([context = context_, exposition = exposition_] { mg_stop(context); }).detach();
  }

  absl::Status Start(const MetricsHttpOptions& options) {
    const std::string threads = absl::StrCat(options.num_threads);
    const std::string timeout = absl::StrCat(options.request_timeout_ms);
    // No document_root: nothing but the handler is served.
    const char* config[] = {"listening_ports",
                            options.address.c_str(),
                            "num_threads",
                            threads.c_str(),
                            "request_timeout_ms",
                            timeout.c_str(),
                            "enable_keep_alive",
                            "no",
                            nullptr};
    mg_callbacks callbacks{};
    callbacks.log_message = [](const mg_connection*, const char*) { return 1; };  // quiet
    mg_init_data init{
        .callbacks = &callbacks, .user_data = nullptr, .configuration_options = config};
    char error_text[256] = "";
    unsigned error_code = 0;
    mg_error_data error{
        .code = &error_code, .text = error_text, .text_buffer_size = sizeof(error_text)};
    context_ = mg_start2(&init, &error);
    if (context_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("--metrics_address: cannot serve on \"",
                                                 options.address, "\": ", error_text));
    }
    mg_server_port port{};
    if (mg_get_server_ports(context_, 1, &port) != 1) {
      return absl::UnavailableError(absl::StrCat("--metrics_address: cannot serve on \"",
                                                 options.address, "\": no listening port"));
    }
    port_ = port.port;
    mg_set_request_handler(context_, "**", &Exposition::Handle, exposition_.get());
    return absl::OkStatus();
  }

  int port() const { return port_; }

 private:
  const std::shared_ptr<Exposition> exposition_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options,
    std::vector<std::weak_ptr<prometheus::Collectable>> collectables) {
  RETURN_IF_ERROR(ParseAddress(options.address).status());
  auto impl = std::make_unique<Impl>(
      std::make_shared<Exposition>(options.bearer_token, std::move(collectables)));
  RETURN_IF_ERROR(impl->Start(options));
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl)));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsHttpServer::~MetricsHttpServer() = default;
int MetricsHttpServer::port() const { return impl_->port(); }

absl::Status CheckMetricsExposure(const std::string& address, bool tls, bool bearer_token) {
  ASSIGN_OR_RETURN(const Address parsed, ParseAddress(address));
  if (!tls || bearer_token || (ntohl(parsed.host.s_addr) >> 24) == 127) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--metrics_address: expected a loopback address (127.0.0.1:PORT) when TLS is on without "
      "--auth_token_file (the metrics port is plain HTTP and names every head; with a token, "
      "/metrics requires \"Authorization: Bearer <token>\"); got \"",
      address, "\""));
}

}  // namespace remotehead::server
