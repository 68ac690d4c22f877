// The server's life once it listens: it serves until SIGTERM / SIGINT, then drains. A server on
// its own drains by itself (health NOT_SERVING, new calls refused, up to the grace for the calls
// in flight, then every head's state saved). A rank of a head group or mesh drains with every
// other rank, whichever rank got the signal (replication/cluster_drain.h); until then it follows
// its log (a rank other than a front, and a mesh's fronts other than the leader).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <ostream>
#include <string>

#include "remotehead/server/rpc/head_service.h"

namespace remotehead::server {

struct Cluster;  // group/join.h (not included: main.cc reaches this header from its own folder)

struct ServingOptions {
  std::chrono::milliseconds grace;  // --shutdown_grace_seconds: for the calls in flight
  std::chrono::milliseconds save;   // --drain_save_seconds: a group's or mesh's saves after them
  int global_rank = 0;
  std::string state_dir;        // where this process's head states are saved ("": no --state_dir)
  std::ostream* out = nullptr;  // lifecycle lines
  std::ostream* err = nullptr;  // failures
  // The process's own command line: a process of a mesh replica that was evicted starts again
  // with it, as a new process that joins the running mesh (join.h); nullptr: it stays down.
  char** restart_argv = nullptr;
};

// Serves until `signal` (the signal received, 0 until then) or, on a group or mesh, until the
// drain says stop or the group ends; returns the process's exit code (0: a clean stop with
// every state saved, if any is to be). A live process of a replica evicted from a mesh restarts
// itself (options.restart_argv) to join it again, unless its own heal failed: then it exits. On a
// mesh that evicts, a signal to a process of a replica other than 0 makes it leave (exit 0, no
// drain): the others go on, and started again it rejoins.
int ServeUntilStopped(grpc::Server& server, HeadService& service, const Cluster& cluster,
                      const std::atomic<int>& signal, const ServingOptions& options);

}  // namespace remotehead::server
