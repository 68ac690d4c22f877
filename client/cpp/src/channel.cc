// The channel a Client opens (its options checked, TLS and bearer token, the reconnection pace),
// the front it dials and follows on a mesh, and the retry policy every call runs under:
// UNAVAILABLE retried with jittered exponential backoff, within the attempts and the deadline.
#include "channel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::client::internal {
namespace {

using Clock = std::chrono::system_clock;

// The options' fields, each checked (INVALID_ARGUMENT naming it).
absl::Status CheckFields(const ClientOptions& o) {
  for (const std::string& front : o.fronts) {
    if (front.empty()) {
      return absl::InvalidArgumentError(
          "fronts: expected every replica front's host:port; got an empty one");
    }
  }
  if (o.target.empty() && o.fronts.empty()) {
    return absl::InvalidArgumentError("target: expected host:port (or any gRPC target); got \"\"");
  }
  if (!o.bearer_token.empty() && !o.tls.has_value()) {
    return absl::InvalidArgumentError(
        "bearer_token: expected a TLS channel (options.tls) to send a token over; got an "
        "insecure channel");
  }
  if (o.tls.has_value() && o.tls->client_cert_pem.empty() != o.tls->client_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "tls.client_cert_pem, tls.client_key_pem: expected both (mutual TLS) or neither; got "
        "only one");
  }
  RETURN_IF_ERROR(wire::CheckHttp2Settings(o.http2, "http2."));
  if (o.streams < 1 || o.streams > 64) {
    return absl::InvalidArgumentError(absl::StrCat("streams: expected 1 to 64; got ", o.streams));
  }
  const RetryPolicy& r = o.retry;
  if (r.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.max_attempts: expected >= 1; got ", r.max_attempts));
  }
  if (r.initial_backoff.count() < 0 || r.max_backoff < r.initial_backoff) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.initial_backoff, retry.max_backoff: expected 0 <= initial <= max; got ",
                     r.initial_backoff.count(), " ms and ", r.max_backoff.count(), " ms"));
  }
  if (!(r.backoff_multiplier >= 1.0) || !std::isfinite(r.backoff_multiplier)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retry.backoff_multiplier: expected a finite value >= 1; got ", r.backoff_multiplier));
  }
  if (!(r.jitter >= 0.0 && r.jitter < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.jitter: expected a value in [0, 1); got ", r.jitter));
  }
  if (o.reconfigure_timeout.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reconfigure_timeout: expected >= 0 ms; got ", o.reconfigure_timeout.count()));
  }
  if (o.deadline.has_value() && o.deadline->count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("deadline: expected > 0 ms when set; got ", o.deadline->count()));
  }
  if (o.chunk_bytes < 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: expected >= 1024; got ", o.chunk_bytes));
  }
  if (o.max_receive_message_bytes <= 0 && o.max_receive_message_bytes != -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_receive_message_bytes: expected > 0 or -1 (no limit); got ",
                     o.max_receive_message_bytes));
  }
  return absl::OkStatus();
}

// This trainer's rank for ClientOptions::fronts: `rank`, else RANK from the environment, else 0.
absl::StatusOr<int> TrainerRank(int rank) {
  if (rank >= 0) return rank;
  if (rank != -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: expected >= 0, or -1 (RANK from the environment); got ", rank));
  }
  const char* env = std::getenv("RANK");
  int parsed = 0;
  if (env == nullptr || *env == '\0') return 0;
  if (!absl::SimpleAtoi(env, &parsed) || parsed < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RANK: expected a rank >= 0 in the environment; got \"", env, "\""));
  }
  return parsed;
}

}  // namespace

absl::StatusOr<std::string> Channel::CheckOptions(ClientOptions* options) {
  RETURN_IF_ERROR(CheckFields(*options));
  if (options->fronts.empty()) return "";
  ASSIGN_OR_RETURN(const int rank, TrainerRank(options->rank));
  options->rank = rank;
  options->target = options->fronts[static_cast<size_t>(rank) % options->fronts.size()];
  return options->target != options->fronts[0] ? options->fronts[0] : "";
}

Channel::Channel(const ClientOptions& options, const std::string& leader)
    : options_(options),
      fronts_(options.fronts.empty() ? std::vector<std::string>{options.target} : options.fronts,
              std::max(options.rank, 0)) {
  if (options.tls.has_value()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls->root_certs_pem;
    ssl.pem_private_key = options.tls->client_key_pem;
    ssl.pem_cert_chain = options.tls->client_cert_pem;
    credentials_ = grpc::SslCredentials(ssl);
    if (!options.bearer_token.empty()) {
      credentials_ = grpc::CompositeChannelCredentials(
          credentials_, grpc::AccessTokenCredentials(options.bearer_token));
    }
    if (!options.tls->server_name_override.empty()) {
      args_.SetSslTargetNameOverride(options.tls->server_name_override);
    }
  } else {
    credentials_ = grpc::InsecureChannelCredentials();
  }
  args_.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  for (const auto& [name, value] : wire::Http2ChannelArgs(options.http2)) args_.SetInt(name, value);
  // While the server is unreachable, calls fail at once with UNAVAILABLE until the channel's
  // next reconnection attempt; gRPC's default first reconnection comes after 1 s. Pacing the
  // channel like our retries lets a retry find a server that came back in between.
  args_.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
               static_cast<int>(std::max<int64_t>(options.retry.initial_backoff.count(), 1)));
  args_.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
               static_cast<int>(std::max<int64_t>(options.retry.max_backoff.count(), 1)));
  front_ = OpenFront(fronts_.meshed() ? fronts_.first_replica() : 0, options.target);
  if (!leader.empty()) ConnectLeader(leader);
}

std::shared_ptr<grpc::Channel> Channel::Open(const std::string& address,
                                             const grpc::ChannelArguments& args) const {
  return grpc::CreateCustomChannel(address, credentials_, args);
}

std::shared_ptr<const Front> Channel::OpenFront(int replica, const std::string& target) const {
  auto front = std::make_shared<Front>();
  front->replica = replica;
  front->target = target;
  front->channel = Open(target, args_);
  front->stub = v1::HeadService::NewStub(front->channel);
  // A striped step's other streams, each on a connection of its own (a channel that shares no
  // subchannel), so that they do not queue behind one another on one socket.
  grpc::ChannelArguments own_connection = args_;
  own_connection.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (int i = 1; i < options_.streams; ++i) {
    front->stripe_channels.push_back(Open(target, own_connection));
  }
  return front;
}

std::shared_ptr<const Front> Channel::front() const {
  std::lock_guard<std::mutex> lock(front_mu_);
  return front_;
}

std::shared_ptr<Stub> Channel::stub() const {
  std::shared_ptr<const Front> now = front();
  Stub* raw = now->stub.get();
  return std::shared_ptr<Stub>(std::move(now), raw);
}

std::chrono::milliseconds Channel::Jittered(double ms) {
  double factor = 1.0;
  if (options_.retry.jitter > 0) {
    std::lock_guard<std::mutex> lock(rng_mu_);
    factor = std::uniform_real_distribution<double>(1.0 - options_.retry.jitter,
                                                    1.0 + options_.retry.jitter)(rng_);
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(ms * factor)));
}

namespace {

// A mesh changing epochs: nothing of the call was applied, and it is to be asked again.
bool MeshReconfiguring(const absl::Status& status) {
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  return status.code() == absl::StatusCode::kUnavailable && reason.has_value() &&
         reason->reason == core::reason::kMeshReconfiguring;
}

// UNAVAILABLE with `message`, and the reason (every payload) of `last`, the attempt that failed
// last: what a program branches on survives the retries.
absl::Status GaveUp(const absl::Status& last, const std::string& message) {
  absl::Status status = absl::UnavailableError(message);
  last.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { status.SetPayload(url, payload); });
  return status;
}

}  // namespace

absl::Status Channel::WithRetries(const char* rpc, const Attempt& attempt,
                                  const AlreadyDone& already_done) {
  ++calls_;
  return Attempts(rpc, attempt, already_done);
}

absl::Status Channel::Attempts(const char* rpc, const Attempt& attempt,
                               const AlreadyDone& already_done) {
  std::optional<Clock::time_point> deadline;
  if (options_.deadline.has_value()) deadline = Clock::now() + *options_.deadline;
  std::optional<Clock::time_point> reconfiguring_until;
  double backoff_ms = static_cast<double>(options_.retry.initial_backoff.count());
  int counted = 0;  // the attempts counted against max_attempts
  for (int n = 1;; ++n) {
    ++attempts_;
    absl::Status status;
    bool run = true;
    if (n > 1 && already_done) {
      grpc::ClientContext context;
      if (deadline) context.set_deadline(*deadline);
      absl::StatusOr<bool> done = already_done(&context);
      if (done.ok() && *done) return absl::OkStatus();
      if (!done.ok()) {
        status = done.status();
        run = false;
      }
    }
    if (run) {
      grpc::ClientContext context;
      if (deadline) context.set_deadline(*deadline);
      status = attempt(&context);
    }
    if (status.code() != absl::StatusCode::kUnavailable) return status;
    ++counted;
    if (MeshReconfiguring(status)) {
      if (!reconfiguring_until) reconfiguring_until = Clock::now() + options_.reconfigure_timeout;
      if (Clock::now() < *reconfiguring_until) --counted;  // the mesh's change is waited out
    }
    if (counted >= options_.retry.max_attempts) {
      return GaveUp(status,
                    absl::StrCat(status.message(), " (", rpc, ": gave up after ", n, " attempts)"));
    }
    const std::chrono::milliseconds wait = Jittered(backoff_ms);
    if (deadline && Clock::now() + wait >= *deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          rpc, ": the deadline of ", options_.deadline->count(), " ms leaves no time for attempt ",
          n + 1, "; attempt ", n, " failed with: ", status.message()));
    }
    ++retries_;
    if (options_.on_retry) options_.on_retry({rpc, n, status, wait});
    std::this_thread::sleep_for(wait);
    backoff_ms = std::min(backoff_ms * options_.retry.backoff_multiplier,
                          static_cast<double>(options_.retry.max_backoff.count()));
  }
}

absl::Status Channel::AtOwnFront(const char* rpc, const std::string& head_id,
                                 const Attempt& attempt) {
  ++calls_;
  const absl::Status status = Attempts(rpc, attempt, nullptr);
  if (status.ok() || !fronts_.MayFollow(status)) return status;
  RETURN_IF_ERROR(FollowMesh(head_id, status));
  return Attempts(rpc, attempt, nullptr);  // the same front serves this trainer still: once more
}

absl::Status Channel::FollowMesh(const std::string& head_id, const absl::Status& failed) {
  std::lock_guard<std::mutex> follow(follow_mu_);
  const std::shared_ptr<const Front> was = front();
  const std::optional<MeshFronts::Found> found = fronts_.Follow(
      head_id, was->replica, [this](const std::string& address) { return Open(address, args_); },
      {.patience = options_.reconfigure_timeout,
       .initial_backoff = options_.retry.initial_backoff,
       .max_backoff = options_.retry.max_backoff});
  if (!found.has_value()) return failed;
  if (found->replica == was->replica) return absl::OkStatus();
  std::shared_ptr<const Front> now = OpenFront(found->replica, fronts_.address(found->replica));
  const std::string target = now->target;
  {
    std::lock_guard<std::mutex> lock(front_mu_);
    front_ = std::move(now);  // calls in flight keep the old front until they end
  }
  ++moves_;
  // The old front answered that another replica serves this trainer: it serves, and keeps the
  // dW this trainer's calls added there (the mesh admitted the trainer's replica again).
  const std::optional<core::ErrorReason> why = core::GetReason(failed);
  if (why.has_value() && why->reason == core::reason::kWrongReplica) {
    return core::WithReason(
        absl::UnavailableError(
            absl::StrCat("replica ", was->replica, "'s front serves this trainer no more (",
                         failed.message(), "); this trainer (rank ", fronts_.trainer(),
                         ") now dials replica ", found->replica, "'s front at ", target,
                         "; the dW its calls added at replica ", was->replica, " stays there")),
        reason::kReplicaMoved,
        {{"from_replica", absl::StrCat(was->replica)},
         {"to_replica", absl::StrCat(found->replica)},
         {"incarnation", found->info.incarnation()},
         {"weight_version", absl::StrCat(found->info.weight_version())},
         {"kept", "true"}});
  }
  return core::WithReason(absl::UnavailableError(absl::StrCat(
                              "replica ", was->replica, "'s front is gone or evicted (",
                              failed.message(), "); this trainer (rank ", fronts_.trainer(),
                              ") now dials replica ", found->replica, "'s front at ", target,
                              ": the dW its calls added since its last optimizer step went "
                              "with replica ",
                              was->replica, "; resend them (RemoteHead replays them by itself)")),
                          reason::kReplicaMoved,
                          {{"from_replica", absl::StrCat(was->replica)},
                           {"to_replica", absl::StrCat(found->replica)},
                           {"incarnation", found->info.incarnation()},
                           {"weight_version", absl::StrCat(found->info.weight_version())}});
}

void Channel::ConnectLeader(const std::string& address) {
  std::lock_guard<std::mutex> lock(leader_mu_);
  leader_channel_ = Open(address, args_);
  leader_stub_ = v1::HeadService::NewStub(leader_channel_);
  leader_target_ = address;
}

std::string Channel::LeaderAddress() const {
  {
    std::lock_guard<std::mutex> lock(leader_mu_);
    if (leader_stub_ != nullptr) return leader_target_;
  }
  return front()->target;
}

absl::Status Channel::OnLeader(const std::function<absl::Status(Stub*)>& call) {
  std::shared_ptr<Stub> leader;
  {
    std::lock_guard<std::mutex> lock(leader_mu_);
    leader = leader_stub_;
  }
  const std::string known = LeaderAddress();
  const std::shared_ptr<const Front> own = leader != nullptr ? nullptr : front();
  const absl::Status status = call(leader != nullptr ? leader.get() : own->stub.get());
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  if (!reason.has_value() || reason->reason != core::reason::kNotTheLeader) return status;
  const auto address = reason->metadata.find("leader");
  if (address == reason->metadata.end() || address->second.empty() || address->second == known) {
    return status;
  }
  ConnectLeader(address->second);
  std::lock_guard<std::mutex> lock(leader_mu_);
  leader = leader_stub_;
  return call(leader.get());
}

absl::Status Channel::ToLeader(const std::function<absl::Status(Stub*)>& call) {
  const absl::Status status = OnLeader(call);
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  if (!fronts_.meshed() || status.code() != absl::StatusCode::kUnavailable ||
      (reason.has_value() && reason->reason == core::reason::kServerDraining)) {
    return status;
  }
  // The leader is gone: with its store in a process of its own a mesh survives that, led by
  // its next serving replica; the other fronts each serve the call or name the leader.
  const std::string tried = LeaderAddress();
  for (int r = 0; r < fronts_.replicas(); ++r) {
    if (fronts_.address(r) == tried) continue;
    ConnectLeader(fronts_.address(r));
    const absl::Status again = OnLeader(call);
    const std::optional<core::ErrorReason> why = core::GetReason(again);
    if (again.code() != absl::StatusCode::kUnavailable &&
        !(why.has_value() && why->reason == core::reason::kNotTheLeader)) {
      return again;
    }
  }
  return status;
}

ClientStats Channel::stats() const {
  return {.calls = calls_.load(),
          .attempts = attempts_.load(),
          .retries = retries_.load(),
          .moves = moves_.load(),
          .replays = replays_.load()};
}

}  // namespace remotehead::client::internal
