// A step call's request stream whose messages go out as wire::Frames: gRPC takes each piece as a
// slice of its own — the framing, and the rows' bytes where they lie in the caller's tensors
// (kept alive until gRPC has written them) — so no row is copied into a protobuf message and
// again into gRPC's buffer before the socket. The server parses the same StepRequest as from a
// message built and serialized whole (frames.h says why the pieces parse as one message).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "remotehead/core/call_mode.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/frames.h"

namespace remotehead::client::internal {

// One request message, framed.
struct FramedRequest {
  std::shared_ptr<const wire::Frames> frames;
};

// One response message as it arrived (gRPC's slices), not yet parsed: its dX rows are copied
// from there straight into the result (step_caller.cc), the rest parsed as a StepResponse.
struct RawResponse {
  grpc::ByteBuffer bytes;
};

FramedRequest Framed(const google::protobuf::MessageLite& message);
FramedRequest Framed(wire::Frames frames);

}  // namespace remotehead::client::internal

// gRPC's serialization of a FramedRequest: one slice per piece, each holding the frames.
template <>
class grpc::SerializationTraits<remotehead::client::internal::FramedRequest> {
 public:
  static grpc::Status Serialize(const remotehead::client::internal::FramedRequest& request,
                                grpc::ByteBuffer* buffer, bool* own_buffer);
  // Never called: the server sends StepResponses.
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer,
                                  remotehead::client::internal::FramedRequest* request);
};

// gRPC's deserialization of a RawResponse: the buffer taken as it is.
template <>
class grpc::SerializationTraits<remotehead::client::internal::RawResponse> {
 public:
  // Never called: the client sends framed requests.
  static grpc::Status Serialize(const remotehead::client::internal::RawResponse& response,
                                grpc::ByteBuffer* buffer, bool* own_buffer);
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer,
                                  remotehead::client::internal::RawResponse* response);
};

namespace remotehead::client::internal {

using StepStream = grpc::ClientReaderWriter<FramedRequest, RawResponse>;

// The step RPC of `mode` (HeadService's ForwardBackward, Forward or Backward) on `channel`, as
// the generated stub would open it, with framed requests.
std::unique_ptr<StepStream> OpenStep(grpc::ChannelInterface* channel, grpc::ClientContext* context,
                                     core::CallMode mode);

}  // namespace remotehead::client::internal
