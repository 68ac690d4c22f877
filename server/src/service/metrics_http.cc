#include "remotehead/server/service/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/service/operator_files.h"

namespace remotehead::server {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr size_t kMaxRequestHead = 8192;
// After its answer, how long a connection waits for the client to close first (so that unread
// request bytes never turn the close into a reset that loses the answer).
constexpr std::chrono::milliseconds kLinger{1000};
// With no descriptor left to accept a connection, how long accepting pauses.
constexpr std::chrono::milliseconds kAcceptPause{100};
constexpr int kMaxEvents = 64;

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

std::string Reply(int status, const char* reason, const std::string& body,
                  const std::string& extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: ", kContentType,
                      "\r\nContent-Length: ", body.size(), "\r\nCache-Control: no-store",
                      "\r\nConnection: close\r\n", extra_headers, "\r\n", body);
}

// The end of a request head ("\r\n\r\n", or bare "\n\n"), or npos while it is incomplete.
size_t HeadEnd(const std::string& in) {
  const size_t crlf = in.find("\r\n\r\n");
  const size_t lf = in.find("\n\n");
  return std::min(crlf, lf);
}

// What the server answers to one request head: the collectables' text, or why not.
class Exposition {
 public:
  Exposition(std::string token, std::vector<std::weak_ptr<prometheus::Collectable>> collectables)
      : token_(std::move(token)), collectables_(std::move(collectables)) {}

  std::string Answer(absl::string_view head) const {
    const std::vector<absl::string_view> lines =
        absl::StrSplit(head, absl::ByAnyChar("\r\n"), absl::SkipEmpty());
    const std::vector<absl::string_view> request_line =
        lines.empty() ? std::vector<absl::string_view>()
                      : absl::StrSplit(lines[0], ' ', absl::SkipEmpty());
    if (request_line.size() != 3 || !absl::StartsWith(request_line[2], "HTTP/")) {
      return Reply(400, "Bad Request", "expected \"GET /metrics HTTP/1.1\"\n");
    }
    const absl::string_view path = request_line[1].substr(0, request_line[1].find('?'));
    if (path != "/metrics") {
      return Reply(404, "Not Found", "remotehead-server serves GET /metrics only\n");
    }
    if (request_line[0] != "GET") {
      return Reply(405, "Method Not Allowed", "remotehead-server serves GET /metrics only\n",
                   "Allow: GET\r\n");
    }
    if (!token_.empty() && !Authorized(lines)) {
      return Reply(401, "Unauthorized",
                   "expected \"Authorization: Bearer <token>\" matching the server's "
                   "--auth_token_file\n",
                   "WWW-Authenticate: Bearer realm=\"remotehead-metrics\"\r\n");
    }
    return Reply(200, "OK", Text());
  }

 private:
  bool Authorized(const std::vector<absl::string_view>& lines) const {
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == absl::string_view::npos) continue;
      if (!absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(lines[i].substr(0, colon)),
                                  "authorization")) {
        continue;
      }
      const absl::string_view value = absl::StripAsciiWhitespace(lines[i].substr(colon + 1));
      return IsBearerToken(std::string_view(value.data(), value.size()), token_);
    }
    return false;
  }

  std::string Text() const {
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
    return out.str();
  }

  const std::string token_;
  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
};

// One client's connection: its request head coming in, then its answer going out, then the
// wait for the client to close.
struct Connection {
  enum class State { kReading, kWriting, kLingering };
  State state = State::kReading;
  uint64_t serial = 0;  // accept order: the oldest stalled one is dropped first
  Clock::time_point deadline;
  std::string in;
  std::string out;
  size_t written = 0;
};

}  // namespace

class MetricsHttpServer::Impl {
 public:
  Impl(Exposition exposition, const MetricsHttpOptions& options)
      : exposition_(std::move(exposition)),
        max_connections_(std::max(1, options.max_connections)),
        timeout_(std::max(1, options.request_timeout_ms)) {}

  ~Impl() {
    if (loop_.joinable()) {
      stopping_.store(true);
      const uint64_t one = 1;
      [[maybe_unused]] const ssize_t n = ::write(wake_, &one, sizeof(one));
      loop_.join();
    }
    for (const auto& [fd, connection] : connections_) ::close(fd);
    for (const int fd : {listen_, wake_, epoll_}) {
      if (fd >= 0) ::close(fd);
    }
  }

  absl::Status Start(const Address& address, const std::string& text) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    const int on = 1;
    ::setsockopt(listen_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr = address.host;
    addr.sin_port = htons(static_cast<uint16_t>(address.port));
    socklen_t length = sizeof(addr);
    if (listen_ < 0 || ::bind(listen_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_, SOMAXCONN) != 0 ||
        ::getsockname(listen_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
      return absl::UnavailableError(absl::StrCat("--metrics_address: cannot serve on \"", text,
                                                 "\": ", std::strerror(errno)));
    }
    port_ = ntohs(addr.sin_port);
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_ < 0 || wake_ < 0 || !Watch(listen_, EPOLLIN, EPOLL_CTL_ADD) ||
        !Watch(wake_, EPOLLIN, EPOLL_CTL_ADD)) {
      return absl::UnavailableError(absl::StrCat("--metrics_address: cannot serve on \"", text,
                                                 "\": ", std::strerror(errno)));
    }
    loop_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  int port() const { return port_; }

 private:
  bool Watch(int fd, uint32_t events, int op) {
    epoll_event event{};
    event.events = events;
    event.data.fd = fd;
    return ::epoll_ctl(epoll_, op, fd, &event) == 0;
  }

  void Loop() {
    epoll_event events[kMaxEvents];
    while (!stopping_.load()) {
      const int n = ::epoll_wait(epoll_, events, kMaxEvents, /*timeout_ms=*/50);
      for (int i = 0; i < n && !stopping_.load(); ++i) {
        const int fd = events[i].data.fd;
        if (fd == wake_) continue;
        if (fd == listen_) {
          Accept();
          continue;
        }
        const auto it = connections_.find(fd);
        if (it != connections_.end()) Serve(fd, it->second, events[i].events);
      }
      Expire();
    }
  }

  void Accept() {
    for (;;) {
      const int fd = ::accept4(listen_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // No descriptor for it: make room from the stalled, or pause accepting a moment.
          if (!DropOldestStalled()) {
            Watch(listen_, 0, EPOLL_CTL_MOD);
            accept_paused_until_ = Clock::now() + kAcceptPause;
            return;
          }
          continue;
        }
        return;  // EAGAIN: all taken; anything else: the client is gone already
      }
      if (connections_.size() >= static_cast<size_t>(max_connections_)) DropOldestStalled();
      if (connections_.size() >= static_cast<size_t>(max_connections_) ||
          !Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD)) {
        ::close(fd);
        continue;
      }
      Connection& c = connections_[fd];
      c.serial = next_serial_++;
      c.deadline = Clock::now() + timeout_;
    }
  }

  // Closes the oldest connection still sending its request; false if there is none.
  bool DropOldestStalled() {
    auto oldest = connections_.end();
    for (auto it = connections_.begin(); it != connections_.end(); ++it) {
      if (it->second.state == Connection::State::kReading &&
          (oldest == connections_.end() || it->second.serial < oldest->second.serial)) {
        oldest = it;
      }
    }
    if (oldest == connections_.end()) return false;
    Close(oldest->first);
    return true;
  }

  void Serve(int fd, Connection& c, uint32_t events) {
    if (c.state == Connection::State::kReading && (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP))) {
      if (!Read(fd, c)) return;
    }
    if (c.state == Connection::State::kWriting && (events & (EPOLLOUT | EPOLLHUP | EPOLLERR))) {
      if (!Write(fd, c)) return;
    }
    if (c.state == Connection::State::kLingering && (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP))) {
      char discard[4096];
      ssize_t n;
      while ((n = ::recv(fd, discard, sizeof(discard), 0)) > 0) {
      }
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) Close(fd);
    }
  }

  // Reads what came; answers once the request head is complete. False if the connection closed.
  bool Read(int fd, Connection& c) {
    char buffer[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n > 0) {
        c.in.append(buffer, static_cast<size_t>(n));
        if (HeadEnd(c.in) != std::string::npos || c.in.size() > kMaxRequestHead) break;
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // more later
      Close(fd);  // the client closed (or failed) before its request was complete
      return false;
    }
    const size_t end = HeadEnd(c.in);
    c.out = end == std::string::npos || end > kMaxRequestHead
                ? Reply(431, "Request Header Fields Too Large",
                        absl::StrCat("expected a request head of at most ", kMaxRequestHead,
                                     " bytes\n"))
                : exposition_.Answer(absl::string_view(c.in).substr(0, end));
    c.in.clear();
    c.state = Connection::State::kWriting;
    c.deadline = Clock::now() + timeout_;
    Watch(fd, EPOLLOUT | EPOLLRDHUP, EPOLL_CTL_MOD);
    return Write(fd, c);
  }

  // Writes what the socket takes; once all is out, waits for the client to close. False if the
  // connection closed.
  bool Write(int fd, Connection& c) {
    while (c.written < c.out.size()) {
      const ssize_t n =
          ::send(fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
      if (n > 0) {
        c.written += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // when it drains
      Close(fd);
      return false;
    }
    ::shutdown(fd, SHUT_WR);
    c.out.clear();
    c.state = Connection::State::kLingering;
    c.deadline = Clock::now() + kLinger;
    Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
    return true;
  }

  // Closes every connection past its deadline; resumes accepting after a pause.
  void Expire() {
    const auto now = Clock::now();
    std::vector<int> expired;
    for (const auto& [fd, c] : connections_) {
      if (c.deadline <= now) expired.push_back(fd);
    }
    for (const int fd : expired) Close(fd);
    if (accept_paused_until_.has_value() && *accept_paused_until_ <= now) {
      accept_paused_until_.reset();
      Watch(listen_, EPOLLIN, EPOLL_CTL_MOD);
    }
  }

  void Close(int fd) {
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    connections_.erase(fd);
  }

  const Exposition exposition_;
  const int max_connections_;
  const std::chrono::milliseconds timeout_;
  int listen_ = -1;
  int epoll_ = -1;
  int wake_ = -1;  // an eventfd: wakes the loop to stop
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread loop_;
  // Only the loop's thread touches these.
  std::unordered_map<int, Connection> connections_;
  uint64_t next_serial_ = 0;
  std::optional<Clock::time_point> accept_paused_until_;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options,
    std::vector<std::weak_ptr<prometheus::Collectable>> collectables) {
  ASSIGN_OR_RETURN(const Address address, ParseAddress(options.address));
  auto impl =
      std::make_unique<Impl>(Exposition(options.bearer_token, std::move(collectables)), options);
  RETURN_IF_ERROR(impl->Start(address, options.address));
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
