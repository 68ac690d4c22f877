// One stream of a StepPipeline, as the pipeline keeps it under its lock: the pipeline's private
// state shared by its two files (step_pipeline.cc: compute, results and failure;
// step_pipeline_reads.cc: the streams' joins and reads, merged in row order).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>

#include "rpc/step_pipeline.h"

namespace remotehead::server {

struct StepPipeline::Lane {
  StepPort* port = nullptr;  // null until the stream joins, and again once it is done
  bool attached = false;
  InboundRequest incoming;              // target of the read in flight
  std::deque<InboundRequest> inbox;     // read, not yet computed
  std::deque<StepResponseOut> outbox;   // produced, not yet written (front: in flight)
  int64_t pending_bytes = 0;            // bytes in outbox
  int64_t last_row_offset = -1;         // striped: each stream's rows come in increasing order
  bool reading = false;
  bool writing = false;
  bool landing = false;  // the outbox's front waits for its rows' copy from the device
  bool client_done = false;
  bool finished = false;
  std::optional<int64_t> announced;  // StripeSpec.messages
  int64_t received = 0;              // rows messages read
};

}  // namespace remotehead::server
