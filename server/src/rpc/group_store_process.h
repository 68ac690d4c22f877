// remotehead-server --serve_group_store: a process that serves a mesh's (or a head group's)
// store and nothing else — the one arbiter of the mesh's epochs and commit decisions kept apart
// from every replica, so that the loss of any replica, replica 0's included, is survived
// (--group_store_external on every rank; mesh_epoch.h). It answers gRPC health only (SERVING
// while the store listens) and stops at SIGTERM / SIGINT: the mesh that uses it goes down then.
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <atomic>
#include <memory>
#include <ostream>
#include <string>

#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

// Serves `config`'s store (its --group_store port, on --group_store_bind else its host) and gRPC
// health on `listen` until `signal` is set; the process's exit code (2: cannot listen).
int ServeGroupStore(const GroupConfig& config, const std::string& listen,
                    const std::shared_ptr<grpc::ServerCredentials>& credentials,
                    const std::atomic<int>& signal, std::ostream& out, std::ostream& err);

}  // namespace remotehead::server
