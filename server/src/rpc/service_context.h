// What every call of one HeadService shares: the heads, the options, admission, the retained
// inputs of two-phase steps, the head operations (this process's and as every rank and replica
// runs them), the followers of a group's and a mesh's logs, and the threads that run the
// engine. One per service, created by HeadService::Create and passed to every reactor.
#pragma once

#include <algorithm>
#include <chrono>

#include "remotehead/server/group/placement.h"
#include "remotehead/server/service/admission.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/server/service/service_options.h"
#include "replication/cluster_drain.h"
#include "replication/group_follower.h"
#include "replication/mesh_counts.h"
#include "replication/mesh_steps.h"
#include "replication/replicated_head_operations.h"
#include "rpc/call_gate.h"
#include "rpc/stripe_joins.h"
#include "service/compute_pool.h"
#include "service/head_operations.h"
#include "service/sync_steps.h"
#include "step/retained_inputs.h"

namespace remotehead::server {

struct ServiceContext {
  ServiceContext(HeadRegistry* registry, const ServiceOptions& options)
      : registry(registry),
        options(options),
        placement(options.group, options.mesh),
        admission(options.admission),
        retained(&admission, options.max_retain_seconds),
        stripes(std::chrono::milliseconds(
            static_cast<int64_t>(std::max(options.stripe_join_seconds, 0.001) * 1000))),
        local(registry, &admission, options.device, options.event_log, options.checkpoint_dir,
              options.state_store, options.group, options.mesh),
        operations(&local, options.group, options.mesh, options.checkpoint_every_steps,
                   MeshWait(options, placement)),
        drain(&operations, options.group, options.mesh, options.event_log),
        follower(&local, registry, options.group, options.device, &drain),
        mesh_follower(options.mesh, options.group, &follower, &operations.mesh_steps(),
                      &operations),
        mesh_counts(options.mesh, &local),
        sync_steps(
            [this](const SyncStepRequest& first, const OptimizerStepSpec& spec) {
              return operations.StepOptimizer(first.head_id, first, spec);
            },
            [this](const std::string& id) { return local.Describe(id); },
            std::chrono::milliseconds(
                static_cast<int64_t>(options.sync_step_timeout_seconds * 1000)),
            options.metrics),
        compute(options.compute_threads) {
    // A mesh's front waits for its replica's trainers and names every replica's (MeshSteps)
    // when a step waited too long.
    if (placement.is_replica_front()) {
      sync_steps.set_trainers(&operations.mesh_steps());
    }
    // Every replica's count of micro-batches, for HeadInfo at any front (MeshCounts).
    if (mesh_counts.active()) {
      registry->set_count_observer([this](const std::string& id) { mesh_counts.Publish(id); });
      for (const auto& entry : registry->List()) mesh_counts.Publish(entry->id());
    }
  }

  // How long a replica's front waits for its own trainers once the leader's step came: the
  // synchronous step's timeout, within half the mesh log's (whose replies wait that long).
  static std::chrono::milliseconds MeshWait(const ServiceOptions& options,
                                            const Placement& placement) {
    const auto wait =
        std::chrono::milliseconds(static_cast<int64_t>(options.sync_step_timeout_seconds * 1000));
    const std::chrono::milliseconds reply = placement.mesh_reply_timeout();
    return reply.count() > 0 ? std::min(wait, reply / 2) : wait;
  }

  ~ServiceContext() { registry->set_count_observer(nullptr); }

  // OK while this process serves; once its group or mesh is down, UNAVAILABLE (reason
  // GROUP_UNAVAILABLE) with the verdict: no new call runs, not even on a replica whose own ranks
  // are fine (its dW could never be applied).
  absl::Status Serving() const { return operations.Serving(); }

  HeadRegistry* const registry;
  const ServiceOptions options;
  const Placement placement;  // alone, a group's rank or a mesh's (options.group, options.mesh)
  AdmissionController admission;
  RetainedInputStore retained;
  StripeJoins stripes;   // the streams of striped steps, joining by key
  CallGate gate;         // new calls refused while the server drains; the calls in flight
  HeadOperations local;  // this process's part of every head operation
  ReplicatedHeadOperations operations;  // every operation as the service runs it
  ClusterDrain drain;                   // a group's or mesh's drain at SIGTERM
  GroupFollower follower;               // a head group's other ranks: every command of the log
  MeshFollower mesh_follower;           // a mesh's fronts other than the leader: the mesh's log
  MeshCounts mesh_counts;               // a mesh's accumulated micro-batches, every replica's
  SynchronousSteps sync_steps;          // the optimizer steps of data-parallel trainers
  // Last, so destroyed first: the pool's threads finish their tasks while the rest is alive.
  ComputePool compute;
};

}  // namespace remotehead::server
