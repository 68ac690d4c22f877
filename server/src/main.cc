// remotehead-server: serves LM heads over gRPC.
//
//   remotehead-server --listen 127.0.0.1:50051 --device auto --checkpoint_dir /ckpt
//
// Logs one line per lifecycle event; SIGTERM / SIGINT drain in-flight calls (up to
// --shutdown_grace_seconds), save the heads' states (--state_dir) and exit 0; on a head group or
// mesh a signal on any rank drains every rank together (rpc/serving.h).
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "group/join.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/device.h"
#include "remotehead/core/head.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/rpc/credentials.h"
#include "remotehead/server/rpc/head_service.h"
#include "remotehead/server/service/metrics.h"
#include "remotehead/server/service/metrics_http.h"
#include "remotehead/wire/http2_settings.h"
#include "rpc/front_address.h"
#include "rpc/group_store_process.h"
#include "rpc/metrics_interceptor.h"
#include "rpc/port_hold.h"
#include "rpc/serving.h"
#include "service/heap_policy.h"
#include "service/omp_wait_policy.h"
#include "service/state_restore.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address:port to serve on");
ABSL_FLAG(std::string, device, "auto", "auto (cuda:0 if available, else cpu), cpu or cuda:N");
ABSL_FLAG(std::vector<std::string>, head, {},
          "heads to create at start, id:vocab:hidden[:dtype[:seed]]; repeatable (--head a:.. "
          "--head b:..) and each may be a comma list");
ABSL_FLAG(int32_t, max_message_bytes, 16 << 20, "largest gRPC message accepted or sent");
ABSL_FLAG(int32_t, http2_max_frame_bytes, 0,
          "largest HTTP/2 DATA frame the server accepts (16384 to 16777215; 0 = gRPC's 16384)");
ABSL_FLAG(int32_t, http2_stream_window_bytes, 0,
          "a stream's initial HTTP/2 flow-control window (0 = gRPC's 64 KiB, grown by its "
          "bandwidth-delay probe)");
ABSL_FLAG(int32_t, http2_write_buffer_bytes, 0,
          "what a stream may queue in gRPC before its write completes (0 = gRPC's)");
ABSL_FLAG(int32_t, shutdown_grace_seconds, 30, "how long SIGTERM waits for in-flight calls");
ABSL_FLAG(int32_t, drain_save_seconds, 60,
          "on a head group or mesh: how long the drain at SIGTERM may take to save every head's "
          "state on every rank once the calls in flight finished; a rank that was signalled and "
          "does not see the drain end within --shutdown_grace_seconds plus this (plus 5 s) stops "
          "without it (exit 1)");
ABSL_FLAG(int64_t, memory_budget_bytes, -1,
          "bytes that running requests may hold (estimated at admission); -1 = auto (90% of the "
          "device's free memory after the heads are loaded; on CPU half the RAM), 0 = unlimited");
ABSL_FLAG(int32_t, max_active_requests, 0, "requests computing at once (0 = no limit)");
ABSL_FLAG(int32_t, max_queued_requests, 64,
          "requests waiting for admission; beyond this, RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, compute_threads, 1, "threads running the engine for streaming calls");
ABSL_FLAG(int32_t, torch_threads, 0,
          "LibTorch intra-op threads per engine call (0 = LibTorch's default: all cores)");
ABSL_FLAG(int32_t, read_ahead_messages, 4,
          "rows messages a streaming call reads ahead of the one being computed");
ABSL_FLAG(int64_t, response_chunk_bytes, int64_t{1} << 20,
          "largest chunk of rows (dX, outputs, weights) in one streamed response message");
ABSL_FLAG(double, stripe_join_seconds, 30,
          "how long the streams of a striped step (StepHeader.stripe) may take to join after its "
          "first; then the step fails (ABORTED), nothing committed");
ABSL_FLAG(double, max_retain_seconds, 600,
          "longest a Forward's inputs are kept for a Backward (StepHeader.retain_inputs_seconds)");
ABSL_FLAG(
    double, sync_step_timeout_seconds, 300,
    "how long the ranks of a synchronous optimizer step (data-parallel trainers) wait for the "
    "missing ones before each gets ABORTED naming them; nothing is applied");
ABSL_FLAG(bool, fused_blocks, false,
          "compute cross_entropy, token_logprobs (no sampler) and entropy with the engine's fused "
          "kernel (docs/engine.md, Fused blocks): not yet run on a GPU, so off by default");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of the server (turns TLS on)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA(s) for client certificates (turns mTLS on)");
ABSL_FLAG(bool, tls_require_client_cert, true,
          "with --tls_client_ca: refuse clients without a certificate (false: verify if given)");
ABSL_FLAG(std::string, metrics_address, "",
          "IPv4 host:port serving Prometheus metrics at GET /metrics (port 0: a free one); "
          "empty = off. Plain HTTP; with --auth_token_file it needs that bearer token, with TLS "
          "and no token only a loopback address is accepted");
ABSL_FLAG(std::string, state_dir, "",
          "directory of the heads' durable training state: restored at start, saved every "
          "--checkpoint_every_steps optimizer steps, on SaveHeadState and on SIGTERM; empty = off");
ABSL_FLAG(int32_t, checkpoint_every_steps, 0,
          "with --state_dir: save a head's state every N optimizer steps (0 = only on request "
          "and at shutdown)");
ABSL_FLAG(int32_t, state_keep, 5, "with --state_dir: states kept per head (older are deleted)");
ABSL_FLAG(std::string, state_secret_file, "",
          "with --state_dir: file holding a secret (16+ bytes) that seals every saved state "
          "(HMAC-SHA256): a state that does not verify under it (forged, sealed with another "
          "secret, or saved unsealed) is refused at start and by RestoreHeadState. Empty: on a "
          "head group or mesh its --group_secret_file seals them, else they are NOT sealed");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding one bearer token that every call must carry (needs TLS)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "the only directory CreateHead (from safetensors) and SaveWeights read and write; "
          "their paths are relative to it, never through '..' or symbolic links. "
          "Empty = those RPCs are refused (FAILED_PRECONDITION)");

ABSL_FLAG(int32_t, group_size, 0,
          "processes of a head group (one per GPU), each holding a range of every head's "
          "vocabulary rows; 0 = WORLD_SIZE from the environment, else 1 (no group)");
ABSL_FLAG(int32_t, group_rank, -1,
          "this process's rank in the head group (0 = the front, which serves HeadService); "
          "-1 = RANK from the environment, else 0");
ABSL_FLAG(std::string, group_store, "",
          "host:port of the group's TCPStore (rank 0 serves it, the others dial it); empty = "
          "MASTER_ADDR:MASTER_PORT from the environment, else 127.0.0.1:29500");
ABSL_FLAG(bool, group_store_external, false,
          "the group's TCPStore is served by a process of its own (remotehead-server "
          "--serve_group_store at --group_store), which every rank dials, rank 0 too: on a mesh "
          "with --mesh_min_replicas the loss of replica 0 is then survived like any other's");
ABSL_FLAG(bool, serve_group_store, false,
          "run as a head group's or mesh's store only: serve the TCPStore at --group_store (on "
          "--group_store_bind, else its host) and gRPC health at --listen, until SIGTERM; the "
          "ranks run with --group_store_external");
ABSL_FLAG(std::string, group_store_bind, "",
          "the address rank 0's TCPStore listens on (empty: the host of --group_store; never "
          "every interface unless this names 0.0.0.0 or ::)");
ABSL_FLAG(std::string, group_transport_host, "",
          "this rank's address (or a name resolving to it) for the group's Gloo collectives: they "
          "listen there (on an ephemeral port) and the other ranks connect there, e.g. a name "
          "only the group's own network resolves (empty: GLOO_SOCKET_IFNAME's interface, else "
          "127.0.0.1 for a store on loopback, else the host name's address)");
ABSL_FLAG(std::string, group_secret_file, "",
          "file holding the head group's shared secret (16+ bytes, the same on every rank): every "
          "command and reply of the group's log is sealed with it (HMAC-SHA256), so nobody who "
          "merely reaches the store can run commands. Required for a store beyond loopback "
          "unless --group_trusted_network");
ABSL_FLAG(bool, group_trusted_network, false,
          "accept a head group beyond loopback without --group_secret_file: only the group's "
          "ranks can reach its store (a private network)");
ABSL_FLAG(std::string, group_front_address, "",
          "the address clients dial for the head group (its front's, e.g. a Kubernetes Service); "
          "other ranks name it to a caller that dialled them (reason NOT_THE_FRONT). On a mesh, "
          "\"{replica}\" in it is this process's replica (one Service per replica front, e.g. "
          "remotehead-replica-{replica}:50051). Empty: --listen's host (or, for a wildcard, "
          "--group_store's) with the front's port");
ABSL_FLAG(int32_t, group_replicas, 1,
          "replicas of every head on a mesh: the --group_size (or WORLD_SIZE) processes form "
          "this many replicas of size / replicas ranks each (global rank g: rank g mod K of "
          "replica g / K); trainer t dials replica t mod R's front; 1 = one replica");
ABSL_FLAG(std::string, mesh_reduce_dtype, "float32",
          "on a mesh: the dtype dW travels in when it is summed over the replicas at an "
          "optimizer step (float32: exact; bfloat16: half the bytes, rounded sums)");
ABSL_FLAG(
    int32_t, mesh_checksum_every_steps, 100,
    "on a mesh: every this many weight versions the replicas compare a checksum of their "
    "weights (a mismatch fails the step with DATA_LOSS, reason REPLICAS_DIVERGED); 0 = never");
ABSL_FLAG(int32_t, mesh_min_replicas, 0,
          "on a mesh: the fewest replicas it goes on with (1 to --group_replicas; 0 = every "
          "replica). Below --group_replicas, losing a process of a replica other than replica 0 "
          "(of any replica with --group_store_external; the next replica then leads) evicts "
          "that replica and the mesh goes on without it in its next epoch (its trainers move to "
          "the replicas that serve); the same on every process of the mesh. An evicted replica "
          "comes back when its processes start again with their flags (a live one restarts "
          "itself): the leader admits it between two steps and heals it from its own replica");
ABSL_FLAG(int32_t, mesh_max_evictions, 0,
          "on a mesh with --mesh_min_replicas: the most replicas evicted within "
          "--mesh_eviction_window_seconds; a loss past it takes the mesh down (a slow replica "
          "must not evict the others one after another); 0 = no cap but the minimum");
ABSL_FLAG(double, mesh_eviction_window_seconds, 3600,
          "the window of --mesh_max_evictions, in seconds");
ABSL_FLAG(std::string, testonly_mesh_pause, "",
          "tests only, refused unless the environment sets REMOTEHEAD_TESTONLY=1: "
          "\"after_sum|after_apply,<weight version>,<seconds>\" pauses every rank of a mesh at "
          "that point of the step that makes that version, so that a test can kill a process "
          "there; \"before_heal,<epoch>,<seconds>\" pauses the leader after it admitted a "
          "replica into that epoch, before the heal");
ABSL_FLAG(bool, testonly_mesh_corrupt_heal, false,
          "tests only, refused unless the environment sets REMOTEHEAD_TESTONLY=1: a process "
          "joining a running mesh flips a byte of the heads' states it receives (its heal must "
          "fail, and the mesh evict it again)");
ABSL_FLAG(double, group_timeout_seconds, 60,
          "how long a head group's collectives and commands wait for a rank before the group "
          "is declared down");

namespace {

namespace rh = remotehead;

// id:vocab:hidden[:dtype[:seed]]; on a head group, this rank's rows of it.
absl::Status PreloadHead(const std::string& spec, const torch::Device& device,
                         const rh::server::Placement& placement,
                         rh::server::HeadRegistry* registry) {
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  rh::core::HeadInit init;
  if (parts.size() < 3 || parts.size() > 5 || !absl::SimpleAtoi(parts[1], &init.vocab_size) ||
      !absl::SimpleAtoi(parts[2], &init.hidden_size) ||
      (parts.size() == 5 && !absl::SimpleAtoi(parts[4], &init.seed))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--head: expected id:vocab:hidden[:dtype[:seed]]; got \"", spec, "\""));
  }
  if (parts.size() >= 4) {
    ASSIGN_OR_RETURN(init.dtype, rh::core::ParseHeadDtype(parts[3]));
  }
  if (!placement.sharded()) {
    ASSIGN_OR_RETURN(auto head, rh::core::Head::Initialize(init, {.device = device}));
    return registry->Add(parts[0], std::move(head)).status();
  }
  ASSIGN_OR_RETURN(const std::vector<rh::core::ShardRange> shards,
                   placement.Ranges(init.vocab_size, "--head " + spec));
  const rh::core::ShardRange mine = shards.at(static_cast<size_t>(placement.rank()));
  ASSIGN_OR_RETURN(
      auto head, rh::core::Head::InitializeRows(init, {.device = device}, mine.offset, mine.rows));
  return registry->Add(parts[0], std::move(head), /*reservation=*/0, shards).status();
}

// Every value of a repeatable list flag (--name=a,b --name c): Abseil keeps only the last
// occurrence, so the values are gathered from argv before it parses them. Stops at "--".
std::vector<std::string> RepeatedFlagValues(int argc, char** argv, const std::string& name) {
  std::vector<std::string> values;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    for (const std::string& prefix : {"--" + name, "-" + name}) {
      if (arg == prefix && i + 1 < argc) {
        for (auto v : absl::StrSplit(argv[++i], ',', absl::SkipEmpty())) values.emplace_back(v);
      } else if (arg.starts_with(prefix + "=")) {
        for (auto v : absl::StrSplit(arg.substr(prefix.size() + 1), ',', absl::SkipEmpty())) {
          values.emplace_back(v);
        }
      }
    }
  }
  return values;
}

char** g_argv = nullptr;       // the command line, for a process that restarts itself (serving.h)
std::atomic<int> g_signal{0};  // the signal received (SIGTERM / SIGINT); 0 until one came
void OnSignal(int signal) { g_signal.store(signal); }

// The server's credentials from the --tls_* and --auth_token_file flags; logs the mode.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Security() {
  const rh::server::TlsOptions tls{
      .cert_file = absl::GetFlag(FLAGS_tls_cert),
      .key_file = absl::GetFlag(FLAGS_tls_key),
      .client_ca_file = absl::GetFlag(FLAGS_tls_client_ca),
      .require_client_cert = absl::GetFlag(FLAGS_tls_require_client_cert),
      .token_file = absl::GetFlag(FLAGS_auth_token_file)};
  ASSIGN_OR_RETURN(auto credentials, rh::server::BuildServerCredentials(tls));
  std::cout << "remotehead-server: security: " << rh::server::DescribeSecurityMode(tls)
            << std::endl;
  return credentials;
}

absl::Status LoadHeads(const torch::Device& device, const rh::server::Placement& placement,
                       rh::server::HeadRegistry* registry) {
  for (const std::string& spec : absl::GetFlag(FLAGS_head)) {
    const std::string id = std::string(spec.substr(0, spec.find(':')));
    if (registry->Get(id).ok()) {  // restored from --state_dir: its trained state wins
      std::cout << "remotehead-server: head not loaded: " << spec << " (restored from --state_dir)"
                << std::endl;
      continue;
    }
    RETURN_IF_ERROR(PreloadHead(spec, device, placement, registry));
    std::cout << "remotehead-server: head loaded: " << spec << " on " << device.str() << std::endl;
  }
  return absl::OkStatus();
}

// The bytes the --head heads hold (weights and gradients), which count against the budget.
int64_t LoadedHeadBytes(const rh::server::HeadRegistry& registry) {
  int64_t bytes = 0;
  for (const auto& entry : registry.List()) {
    bytes += entry->Read([](const rh::core::Head& head) {
      return rh::core::HeadMemoryBytes(head.vocab_size(), head.hidden_size(), head.dtype(),
                                       head.has_bias())
          .value_or(0);  // loaded, so within the limits
    });
  }
  return bytes;
}

// --memory_budget_bytes, with -1 resolved once the heads are loaded: what is free then, plus
// the heads themselves (they count against the budget).
absl::StatusOr<int64_t> MemoryBudget(const torch::Device& device,
                                     const rh::server::HeadRegistry& registry) {
  const int64_t budget = absl::GetFlag(FLAGS_memory_budget_bytes);
  if (budget >= 0) return budget;
  auto available = rh::core::AvailableMemoryBytes(device);
  if (!available.ok()) {
    return absl::Status(available.status().code(),
                        absl::StrCat("--memory_budget_bytes=-1: ", available.status().message()));
  }
  return (device.is_cuda() ? *available / 10 * 9 : *available / 2) + LoadedHeadBytes(registry);
}

struct Metrics {
  std::unique_ptr<rh::server::ServerMetrics> metrics;
  std::unique_ptr<rh::server::MetricsHttpServer> http;
};

// How --metrics_address is served, checked before anything is loaded: with --auth_token_file,
// /metrics needs the same bearer token; with TLS and no token, only a loopback address.
absl::StatusOr<rh::server::MetricsHttpOptions> MetricsOptions() {
  rh::server::MetricsHttpOptions options{.address = absl::GetFlag(FLAGS_metrics_address)};
  if (options.address.empty()) return options;
  const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
  if (!token_file.empty()) {
    ASSIGN_OR_RETURN(options.bearer_token, rh::server::ReadBearerToken(token_file));
  }
  RETURN_IF_ERROR(rh::server::CheckMetricsExposure(
      options.address, !absl::GetFlag(FLAGS_tls_cert).empty(), !options.bearer_token.empty()));
  return options;
}

// Prometheus metrics served on --metrics_address (none when it is empty).
absl::StatusOr<Metrics> StartMetrics(const rh::server::MetricsHttpOptions& options,
                                     const rh::server::HeadRegistry* registry,
                                     const torch::Device& device, int64_t budget) {
  Metrics m;
  if (options.address.empty()) return m;
  m.metrics = std::make_unique<rh::server::ServerMetrics>(registry, device, budget);
  ASSIGN_OR_RETURN(m.http,
                   rh::server::MetricsHttpServer::Start(options, m.metrics->Collectables()));
  return m;
}

// --checkpoint_dir, opened once (nullptr when it is empty: file RPCs are refused).
absl::StatusOr<std::shared_ptr<const rh::core::CheckpointDir>> OpenCheckpointDir() {
  const std::string root = absl::GetFlag(FLAGS_checkpoint_dir);
  if (root.empty()) {
    std::cout << "remotehead-server: checkpoints: no --checkpoint_dir; CreateHead from "
                 "safetensors and SaveWeights are refused"
              << std::endl;
    return nullptr;
  }
  auto dir = rh::core::CheckpointDir::Open(root);
  if (!dir.ok()) {
    return absl::Status(dir.status().code(),
                        absl::StrCat("--checkpoint_dir: ", dir.status().message()));
  }
  std::cout << "remotehead-server: checkpoints: read and written in " << root
            << " only (relative paths, no links followed, atomic writes)" << std::endl;
  return *std::move(dir);
}

rh::server::ServiceOptions MakeServiceOptions(
    const torch::Device& device, int64_t budget, rh::server::ServerMetrics* metrics,
    rh::server::StateStore* state_store,
    std::shared_ptr<const rh::core::CheckpointDir> checkpoint_dir,
    const rh::server::Cluster& cluster) {
  const rh::server::ServiceOptions options{
      .device = device,
      .response_chunk_bytes = std::max<int64_t>(1, absl::GetFlag(FLAGS_response_chunk_bytes)),
      .compute_threads = absl::GetFlag(FLAGS_compute_threads),
      .read_ahead_messages = std::max(1, absl::GetFlag(FLAGS_read_ahead_messages)),
      .stripe_join_seconds = absl::GetFlag(FLAGS_stripe_join_seconds),
      .admission = {.memory_budget_bytes = budget,
                    .max_active = absl::GetFlag(FLAGS_max_active_requests),
                    .max_queued = absl::GetFlag(FLAGS_max_queued_requests)},
      .max_retain_seconds = absl::GetFlag(FLAGS_max_retain_seconds),
      .event_log = &std::cout,
      .metrics = metrics,
      .state_store = state_store,
      .checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps),
      .checkpoint_dir = std::move(checkpoint_dir),
      .group = cluster.group.get(),
      .mesh = cluster.mesh.get(),
      .liveness = cluster.liveness.get(),
      .sync_step_timeout_seconds = absl::GetFlag(FLAGS_sync_step_timeout_seconds),
      .fused_blocks = absl::GetFlag(FLAGS_fused_blocks)};
  std::cout << "remotehead-server: admission: memory budget "
            << (budget == 0 ? std::string("unlimited") : absl::StrCat(budget >> 20, " MiB"))
            << ", max active " << options.admission.max_active << " (0 = no limit), max queued "
            << options.admission.max_queued << "; " << options.compute_threads
            << " compute thread(s), " << at::get_num_threads() << " LibTorch thread(s)"
            << std::endl;
  return options;
}

rh::wire::Http2Settings Http2FromFlags() {
  return {.max_frame_bytes = absl::GetFlag(FLAGS_http2_max_frame_bytes),
          .stream_window_bytes = absl::GetFlag(FLAGS_http2_stream_window_bytes),
          .write_buffer_bytes = absl::GetFlag(FLAGS_http2_write_buffer_bytes)};
}

// The gRPC server with the HeadService, health checking, reflection and (optionally) the
// metrics interceptor; nullptr when it cannot listen.
// A head group's rank other than the front serves health (and metrics) only: `not_the_front`
// tells a HeadService caller to dial the front.
std::unique_ptr<grpc::Server> StartServer(
    const std::shared_ptr<grpc::ServerCredentials>& credentials, rh::server::HeadService& service,
    grpc::CallbackGenericService* not_the_front, rh::server::ServerMetrics* metrics, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), credentials, port);
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  for (const auto& [name, value] : rh::wire::Http2ChannelArgs(Http2FromFlags())) {
    builder.AddChannelArgument(name, value);
  }
  if (not_the_front == nullptr) {
    builder.RegisterService(&service.service());
  } else {
    builder.RegisterCallbackGenericService(not_the_front);
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(service.CallCounter());  // the drain waits for the calls it counts
  if (metrics != nullptr) creators.push_back(rh::server::NewMetricsInterceptorFactory(metrics));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  return server != nullptr && *port != 0 ? std::move(server) : nullptr;
}

// The front of a head group (of a mesh's replica) tells the other ranks (the other fronts)
// where clients dial it (front_address.h).
std::string OwnFrontAddress(const rh::server::GroupConfig& config, int port) {
  return rh::server::FrontAddress(absl::GetFlag(FLAGS_group_front_address), config.replica(),
                                  absl::GetFlag(FLAGS_listen), config.store_host, port);
}

void AnnounceFront(rh::server::HeadGroup& group, const rh::server::GroupConfig& config, int port) {
  const std::string address = OwnFrontAddress(config, port);
  if (const absl::Status s = rh::server::AnnounceFront(group, address); !s.ok()) {
    std::cerr << "remotehead-server: head group: the front's address " << address
              << " was not announced: " << s.message() << std::endl;
    return;
  }
  std::cout << "remotehead-server: head group: clients dial the front at " << address << std::endl;
}

// From here on SIGTERM / SIGINT ask for a drain instead of ending the process. Installed before
// the server listens: a client may send requests, then SIGTERM, as soon as the port is open,
// and must still see a clean drain and exit 0. (Before this, nothing is in flight, and the
// default action ends a slow start at once.)
void DrainOnSignal() {
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
}

// Exit code 2 for a configuration the server refuses (the message names the flag); `code` 1 for
// a port it cannot listen on.
int Refuse(const absl::Status& status, int code = 2) {
  std::cerr << "remotehead-server: " << status.message() << std::endl;
  return code;
}

// The head group this process joins (--group_* flags, else torchrun's environment); nullptr
// for a server on its own. Bad flags: INVALID_ARGUMENT naming the flag.
absl::StatusOr<rh::server::GroupConfig> GroupConfigFromFlags(const torch::Device& device) {
  std::map<std::string, std::string> env;
  for (const char* name : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    if (const char* value = std::getenv(name); value != nullptr) env[name] = value;
  }
  ASSIGN_OR_RETURN(
      rh::server::GroupConfig config,
      rh::server::ResolveGroupConfig({.size = absl::GetFlag(FLAGS_group_size),
                                      .rank = absl::GetFlag(FLAGS_group_rank),
                                      .store = absl::GetFlag(FLAGS_group_store),
                                      .timeout_seconds = absl::GetFlag(FLAGS_group_timeout_seconds),
                                      .store_bind = absl::GetFlag(FLAGS_group_store_bind),
                                      .transport_host = absl::GetFlag(FLAGS_group_transport_host),
                                      .replicas = absl::GetFlag(FLAGS_group_replicas),
                                      .store_external = absl::GetFlag(FLAGS_group_store_external)},
                                     env));
  config.device = device;
  if (config.size > 1 && !absl::GetFlag(FLAGS_group_secret_file).empty()) {
    ASSIGN_OR_RETURN(
        config.secret,
        rh::server::ReadSecretFile("group_secret_file", absl::GetFlag(FLAGS_group_secret_file)));
  }
  config.trusted_network = absl::GetFlag(FLAGS_group_trusted_network);
  RETURN_IF_ERROR(rh::server::CheckGroupPlane(config));
  return config;
}

int Run() {
  auto credentials = Security();
  if (!credentials.ok()) return Refuse(credentials.status());
  const absl::StatusOr<rh::server::MetricsHttpOptions> metrics_options = MetricsOptions();
  if (!metrics_options.ok()) return Refuse(metrics_options.status());
  auto device = rh::core::ResolveDevice(absl::GetFlag(FLAGS_device), "--device");
  if (!device.ok()) return Refuse(device.status());
  if (const double t = absl::GetFlag(FLAGS_sync_step_timeout_seconds); !(t > 0 && t <= 86400)) {
    return Refuse(absl::InvalidArgumentError(absl::StrCat(
        "--sync_step_timeout_seconds: expected a number of seconds in (0, 86400]; got ", t)));
  }
  if (const absl::Status s = rh::wire::CheckHttp2Settings(Http2FromFlags(), "--http2_"); !s.ok()) {
    return Refuse(s);
  }
  if (const int32_t t = absl::GetFlag(FLAGS_drain_save_seconds); t < 0) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrCat("--drain_save_seconds: expected a number of seconds >= 0; got ", t)));
  }
  const absl::StatusOr<rh::server::GroupConfig> group_config = GroupConfigFromFlags(*device);
  if (!group_config.ok()) return Refuse(group_config.status());
  if (absl::GetFlag(FLAGS_serve_group_store)) {
    DrainOnSignal();
    return rh::server::ServeGroupStore(*group_config, absl::GetFlag(FLAGS_listen), *credentials,
                                       g_signal, std::cout, std::cerr);
  }
  // Held until the servers bind them: a group's rendezvous opens sockets of the kernel's choice.
  absl::StatusOr<rh::server::PortHold> listen_hold =
      rh::server::PortHold::Hold(absl::GetFlag(FLAGS_listen), "--listen");
  if (!listen_hold.ok()) return Refuse(listen_hold.status(), 1);
  absl::StatusOr<rh::server::PortHold> metrics_hold =
      rh::server::PortHold::Hold(absl::GetFlag(FLAGS_metrics_address), "--metrics_address");
  if (!metrics_hold.ok()) return Refuse(metrics_hold.status(), 1);
  // CPU memory is measured by a counting allocator, installed before any tensor exists.
  if (!absl::GetFlag(FLAGS_metrics_address).empty() && device->is_cpu()) {
    rh::core::InstallCpuMemoryTracker();
  }
  rh::server::HeadRegistry registry;
  auto opened = rh::server::OpenStateStore({.dir = absl::GetFlag(FLAGS_state_dir),
                                            .keep = absl::GetFlag(FLAGS_state_keep),
                                            .secret_file = absl::GetFlag(FLAGS_state_secret_file)},
                                           *group_config, std::cout);
  if (!opened.ok()) return Refuse(opened.status());
  std::unique_ptr<rh::server::StateStore> state_store = *std::move(opened);
  if (state_store != nullptr) {
    if (state_store->removed_temporary_files() > 0) {
      std::cout << "remotehead-server: state: removed " << state_store->removed_temporary_files()
                << " temporary file(s) of saves interrupted by a crash" << std::endl;
    }
  }
  const char* test_environment = std::getenv("REMOTEHEAD_TESTONLY");
  const absl::StatusOr<rh::server::MeshOptions> mesh_options = rh::server::ResolveMeshOptions(
      {.reduce_dtype = absl::GetFlag(FLAGS_mesh_reduce_dtype),
       .checksum_every_steps = absl::GetFlag(FLAGS_mesh_checksum_every_steps),
       .min_replicas = absl::GetFlag(FLAGS_mesh_min_replicas),
       .max_evictions = absl::GetFlag(FLAGS_mesh_max_evictions),
       .eviction_window_seconds = absl::GetFlag(FLAGS_mesh_eviction_window_seconds),
       .testonly_pause = absl::GetFlag(FLAGS_testonly_mesh_pause),
       .testonly_corrupt_heal = absl::GetFlag(FLAGS_testonly_mesh_corrupt_heal),
       .test_environment = test_environment != nullptr && std::string(test_environment) == "1"},
      group_config->replicas);
  if (!mesh_options.ok()) return Refuse(mesh_options.status());
  absl::StatusOr<rh::server::Cluster> cluster =
      rh::server::JoinCluster(*group_config, *mesh_options);
  if (!cluster.ok()) {
    std::cerr << "remotehead-server: " << cluster.status().message() << std::endl;
    return 1;
  }
  rh::server::HeadGroup* group = cluster->group.get();
  // A process that joined a running mesh gets its heads from the heal (head_mesh.h), not here.
  if (state_store != nullptr && !cluster->joined_running) {
    if (const absl::Status s =
            rh::server::RestoreHeadsAtStart(*state_store, *cluster, *device, &registry, std::cout);
        !s.ok()) {
      return Refuse(s);
    }
  }
  if (cluster->joined_running) {
    // nothing: the heal brings every head
  } else if (const absl::Status s = LoadHeads(*device, cluster->placement(), &registry); !s.ok()) {
    return Refuse(s);
  }
  if (absl::GetFlag(FLAGS_torch_threads) > 0) {
    at::set_num_threads(absl::GetFlag(FLAGS_torch_threads));
  }
  const absl::StatusOr<int64_t> budget = MemoryBudget(*device, registry);
  if (!budget.ok()) return Refuse(budget.status());
  auto checkpoint_dir = OpenCheckpointDir();
  if (!checkpoint_dir.ok()) return Refuse(checkpoint_dir.status());
  metrics_hold->Release();
  absl::StatusOr<Metrics> metrics = StartMetrics(*metrics_options, &registry, *device, *budget);
  if (!metrics.ok()) return Refuse(metrics.status());
  if (rh::server::ServerMetrics* m = metrics->metrics.get(); m != nullptr) {
    for (rh::server::MetricSource* source : cluster->metric_sources()) m->AddSource(source);
    cluster->ObserveGroupCommands([m](const std::string& command, double seconds) {
      m->ObserveGroupCommand(command, seconds);
    });
  }

  const std::unique_ptr<rh::server::HeadService> service = rh::server::HeadService::Create(
      &registry, MakeServiceOptions(*device, *budget, metrics->metrics.get(), state_store.get(),
                                    *std::move(checkpoint_dir), *cluster));
  if (const absl::Status s = service->ReserveLoadedHeads(); !s.ok()) {
    return Refuse(absl::Status(
        s.code(), absl::StrCat("--head, --memory_budget_bytes: ", std::string(s.message()))));
  }
  int port = 0;
  DrainOnSignal();
  const bool front = cluster->serves();
  const std::unique_ptr<grpc::CallbackGenericService> not_the_front =
      front ? nullptr : rh::server::NewNotTheFrontService(group);
  listen_hold->Release();
  std::unique_ptr<grpc::Server> server =
      StartServer(*credentials, *service, not_the_front.get(), metrics->metrics.get(), &port);
  if (server == nullptr) {
    std::cerr << "remotehead-server: cannot listen on " << absl::GetFlag(FLAGS_listen) << std::endl;
    return 1;
  }
  if (cluster->liveness != nullptr) {
    cluster->liveness->Announce(rh::server::ProcessAddress(absl::GetFlag(FLAGS_listen), port));
  }
  for (rh::server::HeadGroup* log : cluster->logs_led()) AnnounceFront(*log, *group_config, port);
  if (cluster->mesh != nullptr && cluster->mesh->is_front()) {  // any front may come to lead
    cluster->mesh->PublishFrontAddress(OwnFrontAddress(*group_config, port));
  }
  if (metrics->http != nullptr) {
    std::cout << "remotehead-server: metrics on port " << metrics->http->port() << " (/metrics, "
              << (metrics_options->bearer_token.empty() ? "no auth" : "bearer token required")
              << ")" << std::endl;
  }
  // SERVING only once the configured heads are loaded (they are, by now).
  server->GetHealthCheckService()->SetServingStatus(true);
  std::cout << "remotehead-server: listening on port " << port << " (device " << device->str()
            << ")" << std::endl;
  const int code = rh::server::ServeUntilStopped(
      *server, *service, *cluster, g_signal,
      {.grace = std::chrono::seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds)),
       .save = std::chrono::seconds(absl::GetFlag(FLAGS_drain_save_seconds)),
       .global_rank = group_config->rank,
       .state_dir = state_store != nullptr ? state_store->dir() : "",
       .out = &std::cout,
       .err = &std::cerr,
       .restart_argv = g_argv});
  metrics->http.reset();  // no scrape may read the service's state once it is gone
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  remotehead::server::RestartWithPassiveOmpWaitUnlessSet(argv);
  remotehead::server::KeepFreedHeapForReuseUnlessTuned();
  // A peer that closed its socket (a head group's rank or store gone, a metrics scraper that
  // hung up) makes a write fail with EPIPE, which the transport reports as a status; the default
  // SIGPIPE would instead end the process without a word (seen: a continued rank of a group).
  std::signal(SIGPIPE, SIG_IGN);
  absl::SetProgramUsageMessage("serves LM heads over gRPC; see docs/operators.md");
  const std::vector<std::string> heads = RepeatedFlagValues(argc, argv, "head");
  g_argv = argv;
  absl::ParseCommandLine(argc, argv);
  if (!heads.empty()) absl::SetFlag(&FLAGS_head, heads);
  return Run();
}
