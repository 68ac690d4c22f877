#include "step_frames.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace remotehead::client::internal {

FramedRequest Framed(const google::protobuf::MessageLite& message) {
  wire::Frames frames;
  frames.AppendMessage(message);
  return Framed(std::move(frames));
}

FramedRequest Framed(wire::Frames frames) {
  return {std::make_shared<const wire::Frames>(std::move(frames))};
}

std::unique_ptr<StepStream> OpenStep(grpc::ChannelInterface* channel, grpc::ClientContext* context,
                                     core::CallMode mode) {
  const char* method = mode == core::CallMode::kFused     ? "ForwardBackward"
                       : mode == core::CallMode::kForward ? "Forward"
                                                          : "Backward";
  // The path the generated stub uses: "/<package>.<Service>/<Method>".
  const std::string path = absl::StrCat("/", v1::HeadService::service_full_name(), "/", method);
  const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  return std::unique_ptr<StepStream>(
      grpc::internal::ClientReaderWriterFactory<FramedRequest, v1::StepResponse>::Create(
          channel, rpc, context));
}

}  // namespace remotehead::client::internal

namespace {

// A slice's hold on its frames: released when gRPC is done with the slice.
void ReleaseFrames(void* hold) { delete static_cast<std::shared_ptr<const remotehead::wire::Frames>*>(hold); }

}  // namespace

grpc::Status grpc::SerializationTraits<remotehead::client::internal::FramedRequest>::Serialize(
    const remotehead::client::internal::FramedRequest& request, grpc::ByteBuffer* buffer,
    bool* own_buffer) {
  std::vector<grpc::Slice> slices;
  slices.reserve(request.frames->pieces().size());
  for (const remotehead::wire::Frames::Piece& piece : request.frames->pieces()) {
    slices.emplace_back(const_cast<char*>(piece.data), piece.size, ReleaseFrames,
                        new std::shared_ptr<const remotehead::wire::Frames>(request.frames));
  }
  grpc::ByteBuffer framed(slices.data(), slices.size());
  buffer->Swap(&framed);
  *own_buffer = true;
  return grpc::Status::OK;
}

grpc::Status grpc::SerializationTraits<remotehead::client::internal::FramedRequest>::Deserialize(
    grpc::ByteBuffer* /*buffer*/, remotehead::client::internal::FramedRequest* /*request*/) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "a framed request is never read");
}
