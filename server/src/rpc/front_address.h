// Where clients go on a head group: only its front (rank 0) serves HeadService. The front
// announces the address clients dial through the group's sealed log once it listens, and every
// other rank answers a HeadService call with FAILED_PRECONDITION, reason NOT_THE_FRONT and that
// address in the status details (metadata "front"), instead of gRPC's bare UNIMPLEMENTED.
#pragma once

#include <grpcpp/generic/async_generic_service.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "remotehead/server/group/head_group.h"

namespace remotehead::server {

// The address the front of replica `replica` is dialled at: `given` (--group_front_address, e.g.
// a Kubernetes Service; "{replica}" in it replaced by `replica`) when set; else the host of
// `listen` with the port the server bound, where that host is a wildcard (0.0.0.0, [::], empty)
// `store_host` (rank 0's host, where the store runs).
std::string FrontAddress(const std::string& given, int replica, const std::string& listen,
                         const std::string& store_host, int port);

// This process's own address (named when it is lost: liveness.h): the host of `listen` with the
// port bound, where that host is a wildcard this machine's host name.
std::string ProcessAddress(const std::string& listen, int port);

// The front: records `address` as the group's and sends it to every other rank.
absl::Status AnnounceFront(HeadGroup& group, const std::string& address);

// The other ranks: a gRPC service for every method not otherwise registered, refusing a
// HeadService call with NOT_THE_FRONT (the group's front_address() at the time of the call), and
// any other method with UNIMPLEMENTED, as gRPC would.
std::unique_ptr<grpc::CallbackGenericService> NewNotTheFrontService(const HeadGroup* group);

}  // namespace remotehead::server
