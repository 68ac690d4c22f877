// How a Client connects and retries (ClientOptions, given to Client::Create): the server or a
// mesh's replica fronts, TLS and the bearer token, the retry policy every call runs under, the
// sizes of the messages and the streams a step is striped over; and what the client reports of
// its calls (RetryEvent, the client's own error reason, ClientStats).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "remotehead/wire/http2_settings.h"

namespace remotehead::client {

// TLS towards the server. An empty root_certs_pem uses gRPC's default roots; client_cert_pem
// with client_key_pem presents a client certificate (mutual TLS).
struct TlsOptions {
  std::string root_certs_pem;
  std::string client_cert_pem;
  std::string client_key_pem;
  // Host name the server's certificate is checked against, when it differs from the target's
  // (e.g. connecting to 127.0.0.1 with a certificate issued for "localhost").
  std::string server_name_override;
};

// Exponential backoff between attempts of a call that failed with UNAVAILABLE.
struct RetryPolicy {
  int max_attempts = 5;  // attempts in all, the first included; 1 = never retry
  std::chrono::milliseconds initial_backoff{50};
  double backoff_multiplier = 2.0;
  std::chrono::milliseconds max_backoff{2000};
  // Each wait is scaled by a random factor in [1 − jitter, 1 + jitter], so that many trainers
  // cut off by one server restart do not all reconnect in the same millisecond.
  double jitter = 0.1;
};

// Reported to ClientOptions::on_retry before each backoff wait.
struct RetryEvent {
  std::string rpc;                    // e.g. "ForwardBackward"
  int failed_attempt;                 // 1-based number of the attempt that just failed
  absl::Status status;                // its status (always UNAVAILABLE)
  std::chrono::milliseconds backoff;  // the wait before the next attempt
};

struct ClientOptions {
  std::string target = "127.0.0.1:50051";  // anything grpc::CreateChannel accepts
  // A mesh's replica fronts [replica 0's, replica 1's, …] (head-groups.md): when set, the client
  // dials fronts[rank mod R] (`target` is set to it) for its calls, and sends the operations
  // that change every replica (CreateHead, UploadHead, DropHead, ZeroGradients, an
  // unsynchronized OptimizerStep) to the leader, fronts[0]. A front that is not the leader
  // names the leader (reason NOT_THE_LEADER), and the client follows it once by itself.
  // On a mesh that evicts a lost replica (--mesh_min_replicas), a call of a head at this
  // trainer's front — a step, DescribeHead, a synchronous OptimizerStep, an embedding's lookup
  // or gradient — that fails for good there (the front gone, down, evicted, or naming another
  // replica) follows the mesh: the client asks the fronts which serves this trainer now, dials
  // it from then on (Client::replica) and returns UNAVAILABLE, reason REPLICA_MOVED (client.h).
  std::vector<std::string> fronts;
  // This trainer's rank for `fronts`; -1: RANK from the environment, else 0 (Client::options()
  // holds the rank resolved).
  int rank = -1;
  std::optional<TlsOptions> tls;  // unset: an insecure (plaintext) channel
  // Sent as `authorization: Bearer <token>` on every call. Only over TLS: Client::Create
  // refuses a token on an insecure channel rather than send it in clear text.
  std::string bearer_token;
  RetryPolicy retry;
  // How long a call waits out a mesh that changes epochs after losing a replica (UNAVAILABLE,
  // reason MESH_RECONFIGURING: nothing of the call was applied), asking again with the retry
  // policy's backoff without counting those attempts; and how long a call that follows the mesh
  // probes its fronts for the one that serves this trainer now.
  std::chrono::milliseconds reconfigure_timeout = std::chrono::seconds(120);
  // Wall-clock limit of one call, all of its attempts and backoff waits included. Unset: none.
  std::optional<std::chrono::milliseconds> deadline;
  // Largest request message: rows of X (with their targets, weights, aux, grad_output) and
  // uploaded weight rows are split so that no message exceeds it. Far below gRPC's 4 MiB
  // default receive limit of a server.
  int64_t chunk_bytes = int64_t{1} << 20;
  // Largest response message accepted (the server's streamed chunks are 1 MiB by default).
  int max_receive_message_bytes = 16 << 20;
  // The connections' HTTP/2 frame size and windows (wire/http2_settings.h); 0s: gRPC's own.
  wire::Http2Settings http2;
  // Parallel streams each step call is striped over (StepHeader.stripe), 1 to 64: row message
  // i goes on stream i mod `streams`, and results come back on all of them, so one step is not
  // bound to what one HTTP/2 stream moves. Streams after the first each have a connection of
  // their own. Results are exactly those of one stream; a failed or cancelled stream fails the
  // whole attempt, which is retried as a whole.
  int streams = 1;
  // Called before each retry wait (logging, metrics, tests). May be called from any thread
  // that issues calls.
  std::function<void(const RetryEvent&)> on_retry;
};

namespace reason {
// The client's own reason (core/error_reason.h lists the server's): this trainer's replica of a
// mesh was evicted (or its front is gone) and the Client now dials the front of the replica that
// serves it in the mesh's new epoch; the call that noticed it returns UNAVAILABLE with this
// reason, nothing of it done at the new front. The dW its calls added since its last optimizer
// step went with the old replica: resend those calls (RemoteHead replays them by itself) pinned
// to the new front's incarnation. Metadata: "from_replica", "to_replica", and the head as the new
// front describes it: "incarnation", "weight_version" (past the trainer's: the step in flight
// was applied after all, and nothing is to be resent).
inline constexpr char kReplicaMoved[] = "REPLICA_MOVED";
}  // namespace reason

// What one Client has done so far (all calls, all threads).
struct ClientStats {
  int64_t calls = 0;     // typed calls started
  int64_t attempts = 0;  // RPC attempts, retries included
  int64_t retries = 0;   // attempts after an UNAVAILABLE
  int64_t moves = 0;     // times this trainer moved to another replica's front (REPLICA_MOVED)
  int64_t replays = 0;   // calls resent after a move (RemoteHead's replay journal)
};

}  // namespace remotehead::client
