// What every call of one HeadService shares: the heads, the options, admission, the retained
// inputs of two-phase steps, the head operations and the threads that run the engine. One per
// service, created by HeadService::Create and passed to every reactor.
#pragma once

#include "compute_pool.h"
#include "group/group_follower.h"
#include "head_operations.h"
#include "remotehead/server/admission.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/server/head_service.h"
#include "step/retained_inputs.h"
#include "sync_steps.h"

namespace remotehead::server {

struct ServiceContext {
  ServiceContext(HeadRegistry* registry, const ServiceOptions& options)
      : registry(registry),
        options(options),
        admission(options.admission),
        retained(&admission, options.max_retain_seconds),
        operations(registry, &admission, options.device, options.event_log, options.checkpoint_dir,
                   options.state_store, options.checkpoint_every_steps, options.group),
        follower(&operations, registry, options.group, options.device),
        sync_steps(
            [this](const std::string& id, const OptimizerStepSpec& spec) {
              return operations.OptimizerStep(id, spec);
            },
            [this](const std::string& id) { return operations.Describe(id); },
            std::chrono::milliseconds(
                static_cast<int64_t>(options.sync_step_timeout_seconds * 1000)),
            options.metrics),
        compute(options.compute_threads) {}

  HeadRegistry* const registry;
  const ServiceOptions options;
  AdmissionController admission;
  RetainedInputStore retained;
  HeadOperations operations;
  GroupFollower follower;       // a head group's other ranks: every command of the log
  SynchronousSteps sync_steps;  // the optimizer steps of data-parallel trainers
  // Last, so destroyed first: the pool's threads finish their tasks while the rest is alive.
  ComputePool compute;
};

}  // namespace remotehead::server
