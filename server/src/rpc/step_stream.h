// The protobuf side of a step call: reads each StepRequest into the session's types
// (step_call.h) and writes what the session gives back as StepResponses — dX, outputs and token
// ids in row chunks of at most `response_chunk_bytes` (their bytes left in the results:
// step_response_out.h), then the summary. The one place where a
// step's wire messages meet StepSession, which itself includes no protobuf.
//
// It is the `Call` a StreamPipeline runs for a step (stream_pipeline.h): the pipeline hands it
// one message at a time, in order (not thread-safe, like the session; only Decode runs on the
// streams' threads, into the staging). Its static functions read and frame the step's messages
// for the streams (StreamReactor).
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/service/metrics.h"
#include "remotehead/v1/head_service.pb.h"
#include "rpc/row_staging.h"
#include "rpc/service_context.h"
#include "rpc/step_response_out.h"
#include "rpc/stream_pipeline.h"
#include "step/step_session.h"

namespace remotehead::server {

// One client message as a stream received it: the message, and where its hidden rows were
// staged when they were (row_staging.h: then the message's rows.hidden has no data).
struct InboundRequest {
  v1::StepRequest message;
  std::vector<StagedHidden> staged;
};

class StepStream {
 public:
  using Request = InboundRequest;
  using Response = StepResponseOut;
  using First = v1::StepRequest;

  // With `group` (the front of a head group), the session runs every engine call and the
  // commit on every rank, forwarding the request's own header to them.
  StepStream(HeadRegistry* registry, RetainedInputStore* retained, core::CallMode mode,
             int64_t response_chunk_bytes, HeadGroup* group = nullptr)
      : session_(registry, retained, mode),
        response_chunk_bytes_(response_chunk_bytes),
        mode_(mode),
        group_(group) {}
  // A step of `service` in its pipeline: the session grows its reservation and stops through
  // `hooks`; the metrics observe it once complete.
  StepStream(ServiceContext* service, core::CallMode mode, CallHooks hooks);

  // Handles one client message; appends what goes back to the client to `responses`. Takes the
  // message: the rows it carries are computed from its bytes (or where they were staged) without
  // a copy.
  absl::Status OnRequest(InboundRequest request, std::vector<StepResponseOut>* responses);
  absl::Status OnRequest(v1::StepRequest request, std::vector<StepResponseOut>* responses) {
    return OnRequest(InboundRequest{.message = std::move(request)}, responses);
  }
  // The client has sent everything: the session finishes; the summary is appended last.
  absl::Status OnClientDone(std::vector<StepResponseOut>* responses);

  // Reported in the summary.
  void set_timings(const CallTimings& timings) { timings_ = timings; }
  // The call in core types: admission's estimate, the metrics, cancellation.
  StepSession& session() { return session_; }
  const StepSession& session() const { return session_; }

  // What its StreamPipeline asks of it (stream_pipeline.h).
  bool begun() const { return session_.has_begun(); }
  MemoryEstimate EstimateMemory(int64_t pipeline_bytes) const {
    return session_.EstimateMemory(pipeline_bytes);
  }
  // Admitted: the streams stage the rows they read straight into their batches' buffers.
  void Admitted() { staging_.Configure(session_.row_layout()); }
  // A request of the running call: its hidden rows straight into the staging buffers where they
  // can go there (row_staging.h), else parsed whole. On the stream's thread.
  absl::Status Decode(grpc::ByteBuffer* bytes, InboundRequest* into);
  // Complete: the metrics observe it.
  void Complete(const CallTimings& timings) const;

  // The step's messages, as the streams read and write them.
  // A request as gRPC's own protobuf serialization would have parsed it.
  static absl::Status ParseFirst(grpc::ByteBuffer* bytes, v1::StepRequest* into);
  static InboundRequest FromFirst(v1::StepRequest first) {
    return InboundRequest{.message = std::move(first)};
  }
  // One stream unless the first message is a header whose stripe.count > 1; INVALID_ARGUMENT
  // naming the field when the stripe is malformed, or when a stream other than 0 sends more
  // than its stripe (the header is stream 0's).
  static absl::StatusOr<StripeOf> ReadStripe(const v1::StepRequest& first);
  // The stripe the first message states, unchecked.
  static StripeOf StripeAsSent(const v1::StepRequest& first);
  // A striped stream carries rows only after its header: their row_offset, or INVALID_ARGUMENT.
  static absl::StatusOr<int64_t> StripedRowOffset(const InboundRequest& request,
                                                  const std::string& stream);
  static int64_t RowOffset(const InboundRequest& request) {
    return request.message.rows().row_offset();
  }
  // The summary goes to every stream of a striped step.
  static bool ToEveryStream(const StepResponseOut& response) {
    return response.message.part_case() == v1::StepResponse::kSummary;
  }
  // Framed around the rows' bytes (StepResponseOut::Frames): nothing copies them.
  static grpc::ByteBuffer Serialize(const StepResponseOut& response);

 private:
  absl::Status OnHeader(const v1::StepHeader& header);
  // Each result tensor as TensorChunk responses into `responses`.
  StepResultSink SinkInto(std::vector<StepResponseOut>* responses) const;

  StepSession session_;
  const int64_t response_chunk_bytes_;
  const core::CallMode mode_;
  HeadGroup* const group_;
  ServerMetrics* metrics_ = nullptr;  // a service's step: observed once complete
  RowStaging staging_;  // where the streams decode the hidden rows they read, once admitted
  CallTimings timings_;
};

}  // namespace remotehead::server
