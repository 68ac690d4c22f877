// StreamPipeline's reading side (stream_pipeline.h): the streams joining (Attach, and a call
// whose streams did not all join in time), their reads with read-ahead, each message accepted
// into its stream's inbox (a striped stream's rows in increasing order, complete at the rows
// messages it announced), and the merge of the inboxes in row order that the compute takes its
// next message from. Included by the .cc that serves a call.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "rpc/stream_pipeline.h"

namespace remotehead::server {

template <typename Call>
void StreamPipeline<Call>::Attach(int index, int count, core::CallMode mode,
                                  std::chrono::system_clock::time_point deadline, Port* port,
                                  std::optional<First> first, std::optional<int64_t> messages) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status fits;
  if (count != streams_) {
    fits = absl::InvalidArgumentError(absl::StrCat("header.stripe.count: expected ", streams_,
                                                   " (the step's other streams); got ", count));
  } else if (mode != mode_) {
    fits = absl::InvalidArgumentError(
        absl::StrCat("header.stripe: expected a ", core::CallModeName(mode_),
                     " stream, as the step's other streams; got ", core::CallModeName(mode)));
  } else if (lanes_[index].attached) {
    fits = absl::InvalidArgumentError(
        absl::StrCat("header.stripe.index: ", index, " has already joined the step"));
  }
  if (!fits.ok()) {
    port->Finish(ToGrpcStatus(fits));
    FailLocked(fits);
    return;
  }
  Lane& lane = lanes_[index];
  lane.attached = true;
  lane.port = port;
  lane.announced = messages;
  if (messages == 0) lane.client_done = true;
  if (failed_) {  // another stream failed the step before this one came
    lane.finished = true;
    port->Finish(failure_);
    return;
  }
  const auto ticks = deadline.time_since_epoch().count();
  if (ticks < deadline_.load()) deadline_.store(ticks);
  if (index == 0) {
    if (first.has_value()) {
      header_ = std::move(first);
    } else {
      lane.client_done = true;
    }
  }
  StartReadLocked(index);
  ScheduleComputeLocked();
}

template <typename Call>
void StreamPipeline<Call>::OnReadDone(int index, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  Lane& lane = lanes_[index];
  lane.reading = false;
  if (failed_ || lane.finished) return;
  if (!ok) {
    if (lane.port->IsCancelled()) {
      FailLocked(CancelledByClient(index));
      return;
    }
    // A read also fails at a cancellation whose notice has not come yet: with the messages
    // announced, one missing is certain.
    if (lane.announced.has_value()) {
      FailLocked(absl::CancelledError(absl::StrCat(
          StreamName(index), " ended after ", lane.received, " of the ", *lane.announced,
          " rows messages it announced (header.stripe.messages): cancelled by the client, or its "
          "connection lost; nothing was committed")));
      return;
    }
    lane.client_done = true;
  } else {
    Request message = std::move(lane.incoming);
    lane.incoming = Request();
    if (absl::Status accepted = AcceptLocked(index, std::move(message)); !accepted.ok()) {
      FailLocked(accepted);
      return;
    }
  }
  if (starved_) {
    receive_wait_ += Clock::now() - starved_since_;
    starved_ = false;
  }
  StartReadLocked(index);
  ScheduleComputeLocked();
}

// One stream's message into its inbox. A striped stream carries rows only, in increasing
// row_offset, so that the merge knows each stream's next row; one stream's messages go to the
// session as they are (it names what is wrong with them).
template <typename Call>
absl::Status StreamPipeline<Call>::AcceptLocked(int index, Request inbound) {
  Lane& lane = lanes_[index];
  if (streams_ > 1) {
    ASSIGN_OR_RETURN(const int64_t offset, Call::StripedRowOffset(inbound, StreamName(index)));
    if (offset <= lane.last_row_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rows.row_offset: ", StreamName(index), " sends its rows in increasing row_offset; got ",
          offset, " after ", lane.last_row_offset));
    }
    lane.last_row_offset = offset;
  }
  lane.inbox.push_back(std::move(inbound));
  ++lane.received;
  // Its last announced message: the stream is complete (nothing after it is read, not even its
  // half-close).
  if (lane.announced.has_value() && lane.received == *lane.announced) lane.client_done = true;
  return absl::OkStatus();
}

template <typename Call>
void StreamPipeline<Call>::FailUnlessJoined(std::chrono::milliseconds within) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> missing;
  for (int i = 0; i < streams_; ++i) {
    if (!lanes_[i].attached) missing.push_back(absl::StrCat(i));
  }
  if (missing.empty()) return;
  FailLocked(absl::AbortedError(absl::StrCat(
      "header.stripe: stream ", absl::StrJoin(missing, ", "), " of ", streams_,
      " did not join the striped step within ", within.count() / 1000.0,
      " s of its first stream (--stripe_join_seconds); nothing was committed. Send the step "
      "again, all its streams under a new key")));
}

// Reads the next message if the pipeline has room: nothing before admission (the header came
// with the stream), then up to read_ahead_messages not yet computed, per stream.
template <typename Call>
void StreamPipeline<Call>::StartReadLocked(int index) {
  Lane& lane = lanes_[index];
  if (phase_ != Phase::kRunning || lane.port == nullptr || lane.reading || lane.finished ||
      lane.client_done || failed_) {
    return;
  }
  if (static_cast<int>(lane.inbox.size()) >= service_.options.read_ahead_messages) return;
  lane.reading = true;
  lane.port->Read(&lane.incoming);
}

// The merge of the streams in row order: the lowest row_offset at the front of an inbox, once
// every stream has joined and shows its next message (or has ended). One stream: its next.
template <typename Call>
typename StreamPipeline<Call>::Next StreamPipeline<Call>::NextLocked(int* lane) const {
  int best = -1;
  for (int i = 0; i < streams_; ++i) {
    const Lane& l = lanes_[i];
    if (!l.attached) return Next::kNotReady;
    if (l.inbox.empty()) {
      if (!l.client_done) return Next::kNotReady;
      continue;
    }
    if (best < 0 ||
        Call::RowOffset(l.inbox.front()) < Call::RowOffset(lanes_[best].inbox.front())) {
      best = i;
    }
  }
  if (best < 0) return Next::kEnd;
  *lane = best;
  return Next::kMessage;
}

}  // namespace remotehead::server
