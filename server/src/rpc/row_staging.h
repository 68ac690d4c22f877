// A step call's rows.hidden, copied once by the stream that received them, straight into the
// buffer the engine computes from: one buffer per batch of the call (the session's fixed batch
// boundaries, StepSession::row_layout), each message's rows at their row offset in it (page-locked
// host memory for a CUDA head, whose copy to the device then needs no bounce). The compute thread
// no longer copies a request's bytes: protobuf does not parse them into a string, and a batch
// made of several messages' rows is one view of its buffer, not a concatenation
// (TokenBatch::Concat).
//
// Thread-safe: the call's streams decode concurrently (each on its own gRPC thread, into rows
// no other stream sends). A batch's buffer is dropped from here once all of its rows came; the
// views the messages hold keep it until computed. Rows sent twice (a client's error, which fails
// the call: the session takes rows in order) may overwrite each other here before that failure;
// nothing of a failed call is committed.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/split_rows.h"
#include "step/row_batcher.h"

namespace remotehead::server {

// Rows [first_row, first_row + hidden.size(0)) of a message's hidden, where they were staged.
struct StagedHidden {
  int64_t first_row = 0;
  torch::Tensor hidden;
};

class RowStaging {
 public:
  // The call's rows (StepSession::row_layout), once its header has been run, before any rows are
  // read. Until then nothing is staged.
  void Configure(const RowLayout& layout);

  // One request: true when its hidden rows were staged (into `message` the rest of it, with
  // rows.hidden's dtype and shape but no data; into `staged` where its rows went, one piece per
  // batch they fall in, in row order). False when it is not a request this stages — no hidden
  // rows, rows outside the call, another width or dtype than the layout's — and `message` must
  // be parsed whole, as before (the session then names what is wrong).
  bool Decode(const std::vector<wire::BytePiece>& pieces, v1::StepRequest* message,
              std::vector<StagedHidden>* staged);

 private:
  struct Batch {
    torch::Tensor buffer;  // [rows of this batch, width]
    int64_t staged = 0;    // rows copied into it so far
  };
  // Batch `index`'s buffer, made on first use (under mu_).
  torch::Tensor BufferLocked(int64_t index);

  std::mutex mu_;
  std::optional<RowLayout> layout_;   // unset: not configured
  std::map<int64_t, Batch> batches_;  // by batch index: those not yet whole
};

}  // namespace remotehead::server
