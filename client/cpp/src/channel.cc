// The channel a Client opens (its options checked, TLS and bearer token, the reconnection pace)
// and the retry policy every call runs under: UNAVAILABLE retried with jittered exponential
// backoff, within the attempts and the deadline.
#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "client_impl.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::client {
namespace {

using Clock = std::chrono::system_clock;

absl::Status CheckOptions(const ClientOptions& o) {
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

std::chrono::milliseconds Client::Impl::Jittered(double ms) {
  double factor = 1.0;
  if (options.retry.jitter > 0) {
    std::lock_guard<std::mutex> lock(rng_mu);
    factor = std::uniform_real_distribution<double>(1.0 - options.retry.jitter,
                                                    1.0 + options.retry.jitter)(rng);
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(ms * factor)));
}

absl::Status Client::Impl::WithRetries(const char* rpc, const Attempt& attempt,
                                       const AlreadyDone& already_done) {
  ++calls;
  std::optional<Clock::time_point> deadline;
  if (options.deadline.has_value()) deadline = Clock::now() + *options.deadline;
  double backoff_ms = static_cast<double>(options.retry.initial_backoff.count());
  for (int n = 1;; ++n) {
    ++attempts;
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
    if (n >= options.retry.max_attempts) {
      return absl::UnavailableError(
          absl::StrCat(status.message(), " (", rpc, ": gave up after ", n, " attempts)"));
    }
    const std::chrono::milliseconds wait = Jittered(backoff_ms);
    if (deadline && Clock::now() + wait >= *deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          rpc, ": the deadline of ", options.deadline->count(), " ms leaves no time for attempt ",
          n + 1, "; attempt ", n, " failed with: ", status.message()));
    }
    ++retries;
    if (options.on_retry) options.on_retry({rpc, n, status, wait});
    std::this_thread::sleep_for(wait);
    backoff_ms = std::min(backoff_ms * options.retry.backoff_multiplier,
                          static_cast<double>(options.retry.max_backoff.count()));
  }
}

void Client::Impl::ConnectLeader(const std::string& address) {
  std::lock_guard<std::mutex> lock(leader_mu);
  leader_channel = open(address);
  leader_stub = v1::HeadService::NewStub(leader_channel);
}

absl::Status Client::Impl::ToLeader(const std::function<absl::Status(Stub*)>& call) {
  std::shared_ptr<Stub> leader;
  {
    std::lock_guard<std::mutex> lock(leader_mu);
    leader = leader_stub;
  }
  const absl::Status status = call(leader != nullptr ? leader.get() : stub.get());
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  if (leader != nullptr || !reason.has_value() || reason->reason != core::reason::kNotTheLeader) {
    return status;
  }
  const auto address = reason->metadata.find("leader");
  if (address == reason->metadata.end() || address->second.empty()) return status;
  ConnectLeader(address->second);
  std::lock_guard<std::mutex> lock(leader_mu);
  leader = leader_stub;
  return call(leader.get());
}

Client::Client(ClientOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}

Client::~Client() = default;

absl::StatusOr<std::shared_ptr<Client>> Client::Create(ClientOptions options) {
  RETURN_IF_ERROR(CheckOptions(options));
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments args;
  if (options.tls.has_value()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls->root_certs_pem;
    ssl.pem_private_key = options.tls->client_key_pem;
    ssl.pem_cert_chain = options.tls->client_cert_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.bearer_token.empty()) {
      credentials = grpc::CompositeChannelCredentials(
          credentials, grpc::AccessTokenCredentials(options.bearer_token));
    }
    if (!options.tls->server_name_override.empty()) {
      args.SetSslTargetNameOverride(options.tls->server_name_override);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  for (const auto& [name, value] : wire::Http2ChannelArgs(options.http2)) args.SetInt(name, value);
  // While the server is unreachable, calls fail at once with UNAVAILABLE until the channel's
  // next reconnection attempt; gRPC's default first reconnection comes after 1 s. Pacing the
  // channel like our retries lets a retry find a server that came back in between.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::max<int64_t>(options.retry.initial_backoff.count(), 1)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::max<int64_t>(options.retry.max_backoff.count(), 1)));
  std::string leader;
  if (!options.fronts.empty()) {
    ASSIGN_OR_RETURN(const int rank, TrainerRank(options.rank));
    options.target = options.fronts[static_cast<size_t>(rank) % options.fronts.size()];
    if (options.target != options.fronts[0]) leader = options.fronts[0];
  }
  std::shared_ptr<Client> client(new Client(std::move(options), nullptr));
  client->impl_ = std::make_unique<Impl>(client->options_);
  client->impl_->open = [credentials, args](const std::string& address) {
    return grpc::CreateCustomChannel(address, credentials, args);
  };
  client->impl_->channel = client->impl_->open(client->options_.target);
  client->impl_->stub = v1::HeadService::NewStub(client->impl_->channel);
  // A striped step's other streams, each on a connection of its own (a channel that shares no
  // subchannel), so that they do not queue behind one another on one socket.
  grpc::ChannelArguments own_connection = args;
  own_connection.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (int i = 1; i < client->options_.streams; ++i) {
    client->impl_->stripe_channels.push_back(
        grpc::CreateCustomChannel(client->options_.target, credentials, own_connection));
  }
  if (!leader.empty()) client->impl_->ConnectLeader(leader);
  return client;
}

ClientStats Client::stats() const {
  return {.calls = impl_->calls.load(),
          .attempts = impl_->attempts.load(),
          .retries = impl_->retries.load()};
}

}  // namespace remotehead::client
