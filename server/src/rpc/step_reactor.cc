// A step call's streams: each served by a StreamReactor over StepStream (stream_reactor.h),
// which finds the call's StreamPipeline — a new one, or for a striped step (StepHeader.stripe)
// the one its other streams share, by key. The step methods are served raw (gRPC's
// ByteBuffers): StepStream parses each request as gRPC would, and frames each response around
// its rows' bytes (StepResponseOut::Frames), which nothing copies.
#include "rpc/step_reactor.h"

#include <google/protobuf/descriptor.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/step_stream.h"
#include "rpc/stream_pipeline_compute.h"
#include "rpc/stream_pipeline_reads.h"
#include "rpc/stream_reactor.h"

namespace remotehead::server {

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewStepReactor(
    grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service) {
  return new StreamReactor<StepStream>(context, mode, service);
}

namespace {

// The step methods by name, with their modes.
constexpr std::pair<const char*, core::CallMode> kStepMethods[] = {
    {"ForwardBackward", core::CallMode::kFused},
    {"Forward", core::CallMode::kForward},
    {"Backward", core::CallMode::kBackward}};

const google::protobuf::ServiceDescriptor& HeadServiceDescriptor() {
  return *google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
      v1::HeadService::service_full_name());
}

}  // namespace

void ForEachStepMethod(const std::function<void(int index, core::CallMode mode)>& f) {
  for (const auto& [name, mode] : kStepMethods) {
    f(HeadServiceDescriptor().FindMethodByName(name)->index(), mode);
  }
}

bool IsRawStepMethod(const std::string& method) {
  for (const auto& [name, mode] : kStepMethods) {
    if (method == absl::StrCat("/", v1::HeadService::service_full_name(), "/", name)) return true;
  }
  return false;
}

}  // namespace remotehead::server
