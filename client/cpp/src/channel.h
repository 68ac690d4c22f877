// A Client's connection to its server: the channel it opens (its options checked, TLS and bearer
// token, the reconnection pace), the stub every call goes through, the connections a striped
// step's other streams take, a mesh's leader, and the retry policy every call runs under —
// UNAVAILABLE retried with jittered exponential backoff, within the attempts and the deadline.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/client/options.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "status.h"

namespace remotehead::client::internal {

using Stub = v1::HeadService::Stub;

class Channel {
 public:
  // Checks `options` (INVALID_ARGUMENT naming the field) and, given ClientOptions::fronts, sets
  // its target to this trainer's front (fronts[rank mod R]). Returns the mesh's leader, fronts[0],
  // when that is another front than the target; "" otherwise.
  static absl::StatusOr<std::string> CheckOptions(ClientOptions* options);

  // Opens the channel to options.target (and to `leader`, when not empty) with the options'
  // credentials and arguments; does not wait for a connection. `options`, checked, must outlive
  // the Channel.
  Channel(const ClientOptions& options, const std::string& leader);
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const ClientOptions& options() const { return options_; }
  // The stub of the client's own server (ClientOptions::target).
  Stub& stub() { return *stub_; }
  // Stream `i` of a striped step (ClientOptions::streams): 0 is the client's own channel, each
  // other stream has a connection of its own.
  grpc::ChannelInterface* stream(int i) {
    return i == 0 ? channel_.get() : stripe_channels_[i - 1].get();
  }

  // Runs `attempt` until it returns anything but UNAVAILABLE, or the attempts or the deadline
  // run out. `already_done` (optional) is asked before every retry whether the failed attempt
  // took effect after all (for calls that are not idempotent): true ends the call with OK;
  // UNAVAILABLE counts as that attempt's failure.
  using Attempt = std::function<absl::Status(grpc::ClientContext*)>;
  using AlreadyDone = std::function<absl::StatusOr<bool>(grpc::ClientContext*)>;
  absl::Status WithRetries(const char* rpc, const Attempt& attempt,
                           const AlreadyDone& already_done = nullptr);

  // A unary call under the retry policy, on `on` (the client's own stub when null).
  template <typename Request, typename Response>
  absl::Status Unary(const char* rpc,
                     grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                     const Request& request, Response* response, Stub* on = nullptr) {
    Stub* target = on != nullptr ? on : stub_.get();
    return WithRetries(rpc, [&](grpc::ClientContext* context) {
      response->Clear();
      return FromGrpc((target->*method)(context, request, response));
    });
  }

  // `call` on the leader's stub (the client's own when no other is known); after a
  // NOT_THE_LEADER that names the leader, connected to it and run once more there.
  absl::Status ToLeader(const std::function<absl::Status(Stub*)>& call);

  // The calls, attempts and retries so far (Client::stats).
  ClientStats stats() const;

 private:
  // The backoff `ms`, spread by the retry policy's jitter.
  std::chrono::milliseconds Jittered(double ms);
  // Connects the mesh's leader at `address` (the operations that change every replica).
  void ConnectLeader(const std::string& address);

  const ClientOptions& options_;
  // What every channel to the server is opened with.
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  grpc::ChannelArguments args_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Stub> stub_;
  // Streams 1..C-1 of a striped step (ClientOptions::streams), each on its own connection.
  std::vector<std::shared_ptr<grpc::Channel>> stripe_channels_;
  // A mesh's leader, when it is not `stub_`'s server (known from ClientOptions::fronts or from
  // a NOT_THE_LEADER): the operations that change every replica go there.
  std::mutex leader_mu_;
  std::shared_ptr<grpc::Channel> leader_channel_;
  std::shared_ptr<Stub> leader_stub_;
  std::atomic<int64_t> calls_{0}, attempts_{0}, retries_{0};
  std::mutex rng_mu_;
  std::mt19937_64 rng_{std::random_device{}()};
};

}  // namespace remotehead::client::internal
