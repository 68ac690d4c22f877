// The reactor of one streaming step call (ForwardBackward, Forward, Backward): gRPC in, gRPC out,
// a StepSession in between. See step_reactor.cc.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>

#include "remotehead/core/call_plan.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "rpc/service_context.h"

namespace remotehead::server {

// A new reactor for one step call in `mode`; it deletes itself when the call is done. The step
// methods are registered raw (HeadService's WithRawCallbackMethod_*): their messages are gRPC
// ByteBuffers, which the reactor parses and frames itself.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewStepReactor(
    grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service);

// Calls `f` with each of them: its index among HeadService's methods (the generated service's,
// which is the proto's order) and its mode.
void ForEachStepMethod(const std::function<void(int index, core::CallMode mode)>& f);

// Whether `method` ("/remotehead.v1.HeadService/ForwardBackward") is one of them: what an
// interceptor sees of its messages is a ByteBuffer, not a protobuf message.
bool IsRawStepMethod(const std::string& method);

}  // namespace remotehead::server
