// The reactor of one streaming step call (ForwardBackward, Forward, Backward): gRPC in, gRPC out,
// a StepSession in between. See step_reactor.cc.
#pragma once

#include <grpcpp/grpcpp.h>

#include "remotehead/core/call_plan.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "rpc/service_context.h"

namespace remotehead::server {

// A new reactor for one step call in `mode`; it deletes itself when the call is done.
grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* NewStepReactor(
    grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service);

}  // namespace remotehead::server
