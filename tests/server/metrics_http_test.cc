// The /metrics HTTP server (MetricsHttpServer) in a process that has loaded LibTorch and its CUDA
// libraries (this binary links them, as the server does): concurrent scrapes, clients that stall,
// hundreds of slow clients that trickle their requests and reconnect when dropped (a scrape is
// still answered within Prometheus' timeout), the connection limit, a prompt stop, 404 / 405,
// the bearer token, and the exposure rule next to TLS.
#include "remotehead/server/service/metrics_http.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "remotehead/core/torch_api.h"
#include "support/http_client.h"

namespace remotehead::server {
namespace {

using Clock = std::chrono::steady_clock;
using remotehead::testing::Connect;
using remotehead::testing::Get;
using remotehead::testing::Request;
using remotehead::testing::Response;

constexpr char kToken[] = "rh-metrics-token-0b1c";

class MetricsHttpTest : public ::testing::Test {
 protected:
  MetricsHttpTest() : registry_(std::make_shared<prometheus::Registry>()) {
    prometheus::BuildCounter()
        .Name("remotehead_test_scrapes_total")
        .Help("a counter for the test")
        .Register(*registry_)
        .Add({{"head", "lm"}})
        .Increment(3);
  }

  std::unique_ptr<MetricsHttpServer> Start(std::string token = "") {
    auto server = MetricsHttpServer::Start(
        {.address = "127.0.0.1:0", .bearer_token = std::move(token)}, {registry_});
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  std::shared_ptr<prometheus::Registry> registry_;
};

TEST_F(MetricsHttpTest, ServesTheCollectablesNextToLibTorch) {
  // LibTorch (and CUDA's libraries, whose static TLS made civetweb's 100 KiB thread stacks fail)
  // are loaded and in use in this process.
  ASSERT_EQ(torch::ones({2, 2}).sum().item<float>(), 4.0f);
  auto server = Start();
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  const Response response = Get(server->port());
  EXPECT_EQ(response.status, 200) << response.text;
  EXPECT_NE(response.text.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(response.text.find("remotehead_test_scrapes_total{head=\"lm\"} 3"), std::string::npos)
      << response.text;
}

TEST_F(MetricsHttpTest, OtherPathsAre404AndOtherMethods405) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  for (const std::string path : {"/", "/metricsx", "/metrics/x", "/index.html", "/../etc/passwd"}) {
    const Response response = Get(server->port(), path);
    EXPECT_EQ(response.status, 404) << path << "\n" << response.text;
    EXPECT_EQ(response.text.find("remotehead_test"), std::string::npos) << path;
  }
  const Response post =
      Request(server->port(), "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(post.status, 405) << post.text;
  EXPECT_NE(post.text.find("Allow: GET"), std::string::npos) << post.text;
}

TEST_F(MetricsHttpTest, AClientThatStallsDoesNotBlockAScrape) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  // One connects and sends nothing; another sends half a request; a third sends a request and
  // does not read the answer.
  const int idle = Connect(server->port());
  const int half = Connect(server->port());
  const int unread = Connect(server->port());
  ASSERT_GE(idle, 0);
  ASSERT_GE(half, 0);
  ASSERT_GE(unread, 0);
  ASSERT_GT(::send(half, "GET /metr", 9, MSG_NOSIGNAL), 0);
  const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_GT(::send(unread, request.data(), request.size(), MSG_NOSIGNAL), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));

  const auto start = Clock::now();
  const Response response = Get(server->port());
  EXPECT_EQ(response.status, 200);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  ::close(idle);
  ::close(half);
  ::close(unread);
}

// Slow clients, each trickling a request that never ends (a byte every 100 ms) and connecting
// again as soon as it is dropped, on non-blocking sockets driven by one thread.
class SlowClients {
 public:
  SlowClients(int port, int count) : port_(port), count_(count) {
    thread_ = std::thread([this] { Run(); });
  }
  ~SlowClients() {
    stop_.store(true);
    thread_.join();
  }
  int reconnects() const { return reconnects_.load(); }

 private:
  int Open() const {
    const int fd = Connect(port_);
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
  }
  void Run() {
    std::vector<int> fds(static_cast<size_t>(count_), -1);
    const std::string trickle = "GET /metrics HTTP/1.1\r\nX-Slow: ";
    std::vector<size_t> sent(fds.size(), 0);
    while (!stop_.load()) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i] < 0) {
          fds[i] = Open();
          sent[i] = 0;
          if (fds[i] >= 0 && i > 0) reconnects_.fetch_add(1);
          continue;
        }
        const char byte = sent[i] < trickle.size() ? trickle[sent[i]] : 'x';
        char sink[256];
        const bool closed = ::recv(fds[i], sink, sizeof(sink), 0) == 0;
        if (closed || ::send(fds[i], &byte, 1, MSG_NOSIGNAL) < 0) {
          ::close(fds[i]);
          fds[i] = -1;  // dropped by the server: connect again next round
          continue;
        }
        ++sent[i];
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    for (const int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }

  const int port_;
  const int count_;
  std::atomic<bool> stop_{false};
  std::atomic<int> reconnects_{0};
  std::thread thread_;
};

TEST_F(MetricsHttpTest, ScrapesAreAnsweredPromptlyUnderManySlowClientsThatReconnect) {
  auto server = MetricsHttpServer::Start(
      {.address = "127.0.0.1:0", .bearer_token = kToken, .request_timeout_ms = 1000}, {registry_});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  SlowClients slow(port, 300);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // dropped once, back again
  const std::string token = std::string("Authorization: Bearer ") + kToken + "\r\n";
  for (int scrape = 0; scrape < 10; ++scrape) {
    const auto start = Clock::now();
    const Response response = Get(port, "/metrics", token);
    EXPECT_EQ(response.status, 200) << response.text;
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(2)) << "scrape " << scrape;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_GT(slow.reconnects(), 0) << "no slow client was ever dropped (request timeout)";
}

TEST_F(MetricsHttpTest, AtTheConnectionLimitTheOldestStalledClientMakesRoom) {
  auto server =
      MetricsHttpServer::Start({.address = "127.0.0.1:0", .max_connections = 8}, {registry_});
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> stalled;
  for (int i = 0; i < 40; ++i) {
    const int fd = Connect((*server)->port());
    ASSERT_GE(fd, 0);
    ASSERT_GT(::send(fd, "GET", 3, MSG_NOSIGNAL), 0);
    stalled.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto start = Clock::now();
  const Response response = Get((*server)->port());
  EXPECT_EQ(response.status, 200) << response.text;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  for (const int fd : stalled) ::close(fd);
}

TEST_F(MetricsHttpTest, ConcurrentScrapesAllSucceed) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  constexpr int kScrapes = 32;
  std::vector<std::future<Response>> scrapes;
  for (int i = 0; i < kScrapes; ++i) {
    scrapes.push_back(std::async(std::launch::async, [&] { return Get(server->port()); }));
  }
  for (auto& scrape : scrapes) {
    const Response response = scrape.get();
    EXPECT_EQ(response.status, 200) << response.text;
    EXPECT_NE(response.text.find("remotehead_test_scrapes_total"), std::string::npos);
  }
}

TEST_F(MetricsHttpTest, StopIsPromptWithAnIdleConnectionOpen) {
  auto server = Start();
  ASSERT_NE(server, nullptr);
  const int idle = Connect(server->port());
  const int half = Connect(server->port());
  ASSERT_GE(idle, 0);
  ASSERT_GE(half, 0);
  ASSERT_GT(::send(half, "GET /metr", 9, MSG_NOSIGNAL), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // both accepted by now
  const auto start = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  ::close(idle);
  ::close(half);
}

// Counts its collections.
class CountingCollectable : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    ++collections;
    return {};
  }
  mutable std::atomic<int> collections{0};
};

TEST_F(MetricsHttpTest, NoScrapeReadsTheCollectablesOnceStopped) {
  auto counting = std::make_shared<CountingCollectable>();
  auto server = MetricsHttpServer::Start({.address = "127.0.0.1:0"}, {counting});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_EQ(Get(port).status, 200);
  EXPECT_EQ(counting->collections.load(), 1);
  server->reset();
  // The port is closed: no answer at all, never metrics.
  const Response late = Get(port);
  EXPECT_NE(late.status, 200) << late.text;
  EXPECT_EQ(counting->collections.load(), 1);
}

TEST_F(MetricsHttpTest, WithATokenMetricsNeedIt) {
  auto server = Start(kToken);
  ASSERT_NE(server, nullptr);
  const std::string right = std::string("Authorization: Bearer ") + kToken + "\r\n";
  for (const std::string& headers :
       {std::string(""), std::string("Authorization: Bearer wrong\r\n"),
        std::string("Authorization: Basic cm9vdDpyb290\r\n"),
        std::string("Authorization: Bearer ") + kToken + "x\r\n"}) {
    const Response response = Get(server->port(), "/metrics", headers);
    EXPECT_EQ(response.status, 401) << headers << "\n" << response.text;
    EXPECT_NE(response.text.find("WWW-Authenticate: Bearer"), std::string::npos);
    EXPECT_EQ(response.text.find("remotehead_test"), std::string::npos) << headers;
  }
  EXPECT_EQ(Get(server->port(), "/metrics", right).status, 200);
  EXPECT_EQ(Get(server->port(), "/metrics", std::string("authorization: bearer ") + kToken + "\r\n")
                .status,
            200);
}

TEST_F(MetricsHttpTest, BadAddressesAreRefused) {
  for (const std::string address : {"9464", "localhost:9464", "127.0.0.1:65536", "::1:9464"}) {
    const auto server = MetricsHttpServer::Start({.address = address}, {registry_});
    ASSERT_FALSE(server.ok()) << address;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_NE(server.status().message().find("--metrics_address"), std::string::npos);
  }
  auto first = Start();
  ASSERT_NE(first, nullptr);
  const auto taken = MetricsHttpServer::Start(
      {.address = "127.0.0.1:" + std::to_string(first->port())}, {registry_});
  ASSERT_FALSE(taken.ok());
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable) << taken.status();
  EXPECT_NE(taken.status().message().find("--metrics_address"), std::string::npos);
}

TEST(MetricsExposureTest, TlsWithoutATokenKeepsMetricsOnLoopback) {
  EXPECT_TRUE(CheckMetricsExposure("0.0.0.0:9464", /*tls=*/false, /*bearer_token=*/false).ok());
  EXPECT_TRUE(CheckMetricsExposure("127.0.0.1:9464", true, false).ok());
  EXPECT_TRUE(CheckMetricsExposure("127.0.0.2:0", true, false).ok());
  EXPECT_TRUE(CheckMetricsExposure("0.0.0.0:9464", true, true).ok());
  for (const std::string address : {"0.0.0.0:9464", "10.1.2.3:9464", "128.0.0.1:9464"}) {
    const absl::Status refused = CheckMetricsExposure(address, true, false);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_NE(refused.message().find("--metrics_address"), std::string::npos);
  }
}

}  // namespace
}  // namespace remotehead::server
