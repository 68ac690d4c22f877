#include "step_frames.h"

#include <string>
#include <utility>

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
      grpc::internal::ClientReaderWriterFactory<FramedRequest, RawResponse>::Create(channel, rpc,
                                                                                    context));
}

}  // namespace remotehead::client::internal

grpc::Status grpc::SerializationTraits<remotehead::client::internal::FramedRequest>::Serialize(
    const remotehead::client::internal::FramedRequest& request, grpc::ByteBuffer* buffer,
    bool* own_buffer) {
  grpc::ByteBuffer framed = remotehead::wire::ToByteBuffer(request.frames);
  buffer->Swap(&framed);
  *own_buffer = true;
  return grpc::Status::OK;
}

grpc::Status grpc::SerializationTraits<remotehead::client::internal::FramedRequest>::Deserialize(
    grpc::ByteBuffer* /*buffer*/, remotehead::client::internal::FramedRequest* /*request*/) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "a framed request is never read");
}

grpc::Status grpc::SerializationTraits<remotehead::client::internal::RawResponse>::Serialize(
    const remotehead::client::internal::RawResponse& /*response*/, grpc::ByteBuffer* /*buffer*/,
    bool* /*own_buffer*/) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "a raw response is never sent");
}

grpc::Status grpc::SerializationTraits<remotehead::client::internal::RawResponse>::Deserialize(
    grpc::ByteBuffer* buffer, remotehead::client::internal::RawResponse* response) {
  // gRPC forgets its buffer after this (it does not destroy it): this takes it over. The message
  // a reused response still holds is freed first — swapped back into gRPC's buffer it would be
  // forgotten with it, every message of a stream but the last leaked.
  response->bytes.Clear();
  response->bytes.Swap(buffer);
  return grpc::Status::OK;
}
