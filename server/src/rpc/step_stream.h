// The protobuf side of a step call: reads each StepRequest into the session's types
// (step_call.h) and writes what the session gives back as StepResponses — dX, outputs and token
// ids in row chunks of at most `response_chunk_bytes` (their bytes left in the results:
// step_response_out.h), then the summary. The one place where a
// step's wire messages meet StepSession, which itself includes no protobuf.
//
// Not thread-safe, like the session: the reactor hands it one message at a time, in order.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/v1/head_service.pb.h"
#include "rpc/row_staging.h"
#include "rpc/step_response_out.h"
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
  // With `group` (the front of a head group), the session runs every engine call and the
  // commit on every rank, forwarding the request's own header to them.
  StepStream(HeadRegistry* registry, RetainedInputStore* retained, core::CallMode mode,
             int64_t response_chunk_bytes, HeadGroup* group = nullptr)
      : session_(registry, retained, mode),
        response_chunk_bytes_(response_chunk_bytes),
        mode_(mode),
        group_(group) {}

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
  void set_timings(const v1::StepTimings& timings) { timings_ = timings; }
  // The call in core types: admission's estimate, the metrics, cancellation.
  StepSession& session() { return session_; }
  const StepSession& session() const { return session_; }

 private:
  absl::Status OnHeader(const v1::StepHeader& header);
  // Each result tensor as TensorChunk responses into `responses`.
  StepResultSink SinkInto(std::vector<StepResponseOut>* responses) const;

  StepSession session_;
  const int64_t response_chunk_bytes_;
  const core::CallMode mode_;
  HeadGroup* const group_;
  v1::StepTimings timings_;
};

}  // namespace remotehead::server
