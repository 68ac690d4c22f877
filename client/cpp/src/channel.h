// A Client's connection to its server: the channel it opens (its options checked, TLS and bearer
// token, the reconnection pace), the front it dials (the stub every call goes through, the
// connections a striped step's other streams take), a mesh's leader, and the retry policy every
// call runs under — UNAVAILABLE retried with jittered exponential backoff, within the attempts
// and the deadline; a mesh changing epochs waited out; a trainer's own front followed to another
// replica when the mesh evicted its own (mesh_fronts.h).
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
#include "mesh_fronts.h"
#include "remotehead/client/options.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "status.h"

namespace remotehead::client::internal {

using Stub = v1::HeadService::Stub;

// The connections to the front a trainer dials: replaced whole when the trainer moves to another
// replica's front, while a call in flight keeps the one it began on (shared).
struct Front {
  int replica = 0;  // of a mesh (0 off a mesh)
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<Stub> stub;
  // Streams 1..C-1 of a striped step (ClientOptions::streams), each on its own connection.
  std::vector<std::shared_ptr<grpc::Channel>> stripe_channels;

  // Stream `i` of a striped step: 0 is the front's own channel, each other stream has a
  // connection of its own.
  grpc::ChannelInterface* stream(int i) const {
    return i == 0 ? channel.get() : stripe_channels[i - 1].get();
  }
};

class Channel {
 public:
  // Checks `options` (INVALID_ARGUMENT naming the field) and, given ClientOptions::fronts, sets
  // its target to this trainer's front (fronts[rank mod R]) and its rank to the one resolved.
  // Returns the mesh's leader, fronts[0], when that is another front than the target; ""
  // otherwise.
  static absl::StatusOr<std::string> CheckOptions(ClientOptions* options);

  // Opens the channel to options.target (and to `leader`, when not empty) with the options'
  // credentials and arguments; does not wait for a connection. `options`, checked, must outlive
  // the Channel.
  Channel(const ClientOptions& options, const std::string& leader);
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const ClientOptions& options() const { return options_; }
  // The front this trainer dials now, for one attempt (it stays usable if the trainer moves).
  std::shared_ptr<const Front> front() const;
  // That front's stub (sharing the front's life).
  std::shared_ptr<Stub> stub() const;

  // Runs `attempt` until it returns anything but UNAVAILABLE, or the attempts or the deadline
  // run out; a mesh changing epochs (UNAVAILABLE, reason MESH_RECONFIGURING) is asked again
  // without counting attempts for up to ClientOptions::reconfigure_timeout. `already_done`
  // (optional) is asked before every retry whether the failed attempt took effect after all
  // (for calls that are not idempotent): true ends the call with OK; UNAVAILABLE counts as that
  // attempt's failure. A call that gives up keeps its last attempt's reason.
  using Attempt = std::function<absl::Status(grpc::ClientContext*)>;
  using AlreadyDone = std::function<absl::StatusOr<bool>(grpc::ClientContext*)>;
  absl::Status WithRetries(const char* rpc, const Attempt& attempt,
                           const AlreadyDone& already_done = nullptr);

  // A call of head `head_id` at this trainer's own front (`attempt` reads front() or stub()
  // anew each time): WithRetries, and if it failed for good in a way that may mean the mesh
  // moved this trainer (MeshFronts::MayFollow), the mesh followed once — the same front still
  // serving it: the call again; another: that front dialled from then on, and UNAVAILABLE with
  // reason REPLICA_MOVED (metadata from_replica, to_replica, and the new front's incarnation and
  // weight_version) returned; none answering: the call's own failure.
  absl::Status AtOwnFront(const char* rpc, const std::string& head_id, const Attempt& attempt);

  // A unary call under the retry policy, on `on` (this trainer's front's stub when null).
  template <typename Request, typename Response>
  absl::Status Unary(const char* rpc,
                     grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                     const Request& request, Response* response, Stub* on = nullptr) {
    return WithRetries(rpc, UnaryAttempt(method, request, response, on));
  }
  // A unary call of head `head_id` at this trainer's own front (AtOwnFront).
  template <typename Request, typename Response>
  absl::Status UnaryAtOwnFront(const char* rpc, const std::string& head_id,
                               grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Response*),
                               const Request& request, Response* response) {
    return AtOwnFront(rpc, head_id, UnaryAttempt(method, request, response, nullptr));
  }

  // `call` on the leader's stub (the client's own when no other is known); after a
  // NOT_THE_LEADER that names the leader, connected to it and run once more there. A leader that
  // is gone (UNAVAILABLE: with an external store the mesh goes on, led by another replica): the
  // other fronts asked in order, each of which serves the call or names the leader.
  absl::Status ToLeader(const std::function<absl::Status(Stub*)>& call);

  // Counts `calls` resent after a move (ClientStats::replays).
  void CountReplays(int64_t calls) { replays_ += calls; }
  // Whether the client knows a mesh's fronts (a list of addresses).
  bool meshed() const { return fronts_.meshed(); }
  // The calls, attempts, retries, moves and replays so far (Client::stats).
  ClientStats stats() const;

 private:
  template <typename Request, typename Response>
  Attempt UnaryAttempt(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                    Response*),
                       const Request& request, Response* response, Stub* on) {
    return [this, method, &request, response, on](grpc::ClientContext* context) {
      const std::shared_ptr<Stub> own = on != nullptr ? nullptr : stub();
      response->Clear();
      return FromGrpc(((on != nullptr ? on : own.get())->*method)(context, request, response));
    };
  }
  // WithRetries's attempts, the call counted by its caller.
  absl::Status Attempts(const char* rpc, const Attempt& attempt, const AlreadyDone& already_done);
  // The backoff `ms`, spread by the retry policy's jitter.
  std::chrono::milliseconds Jittered(double ms);
  // A channel to `address` with the options' credentials and arguments.
  std::shared_ptr<grpc::Channel> Open(const std::string& address,
                                      const grpc::ChannelArguments& args) const;
  // The connections to `replica`'s front at `target`.
  std::shared_ptr<const Front> OpenFront(int replica, const std::string& target) const;
  // After `failed` at this trainer's front: OK if that front still serves it; REPLICA_MOVED once
  // this channel dials the front that does; `failed` if none says so within reconfigure_timeout.
  absl::Status FollowMesh(const std::string& head_id, const absl::Status& failed);
  // Connects the mesh's leader at `address` (the operations that change every replica).
  void ConnectLeader(const std::string& address);
  // Where the client asks the leader now: the leader's stub's address, else its front's.
  std::string LeaderAddress() const;
  // ToLeader's one try at the leader as known, following one NOT_THE_LEADER.
  absl::Status OnLeader(const std::function<absl::Status(Stub*)>& call);

  const ClientOptions& options_;
  // What every channel to the server is opened with.
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  grpc::ChannelArguments args_;
  // The mesh's fronts (the one target off a mesh) and this trainer's rank among its trainers.
  MeshFronts fronts_;
  mutable std::mutex front_mu_;
  std::shared_ptr<const Front> front_;
  // One follow at a time: a call that failed while another followed the mesh probes from the
  // front that one found.
  std::mutex follow_mu_;
  // A mesh's leader, when it is not the front's server (known from ClientOptions::fronts or from
  // a NOT_THE_LEADER): the operations that change every replica go there.
  mutable std::mutex leader_mu_;
  std::shared_ptr<grpc::Channel> leader_channel_;
  std::shared_ptr<Stub> leader_stub_;
  std::string leader_target_;  // leader_stub_'s address
  std::atomic<int64_t> calls_{0}, attempts_{0}, retries_{0}, moves_{0}, replays_{0};
  std::mutex rng_mu_;
  std::mt19937_64 rng_{std::random_device{}()};
};

}  // namespace remotehead::client::internal
