// StreamPipeline's compute side (stream_pipeline.h): the call's turns on the compute pool,
// admission after the header, the results delivered to the streams and written with
// back-pressure, and the failure that ends every stream. Included by the .cc that serves a call.
#pragma once

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "rpc/stream_pipeline.h"
#include "service/request_memory.h"

namespace remotehead::server {

template <typename Call>
StreamPipeline<Call>::StreamPipeline(ServiceContext* service, core::CallMode mode, int streams,
                                     std::string key)
    : service_(*service),
      mode_(mode),
      streams_(streams),
      key_(std::move(key)),
      ticket_(service->admission.NewTicket()),
      started_(Clock::now()),
      deadline_(std::chrono::system_clock::time_point::max().time_since_epoch().count()),
      call_(service, mode,
            CallHooks{.reserve_more =
                          [this](int64_t bytes, const std::string& why) {
                            return service_.admission.Grow(ticket_, bytes, why);
                          },
                      .should_stop =
                          [this] {
                            const auto now =
                                std::chrono::system_clock::now().time_since_epoch().count();
                            return stop_.load(std::memory_order_relaxed) ||
                                   now > deadline_.load(std::memory_order_relaxed);
                          }}),
      lanes_(streams) {}

template <typename Call>
StreamPipeline<Call>::~StreamPipeline() {
  // Frees the call's admitted bytes, or withdraws it from the queue. Waits for an admission
  // callback running on another thread, which then sees failed_ and does nothing.
  service_.admission.Release(ticket_);
}

template <typename Call>
std::string StreamPipeline<Call>::StreamName(int index) const {
  return streams_ == 1 ? "the stream" : absl::StrCat("stream ", index, " of ", streams_);
}

template <typename Call>
absl::Status StreamPipeline<Call>::CancelledByClient(int index) const {
  return absl::CancelledError(absl::StrCat(StreamName(index), " was cancelled by the client"));
}

template <typename Call>
void StreamPipeline<Call>::OnWriteDone(int index, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  Lane& lane = lanes_[index];
  lane.writing = false;
  if (failed_ || lane.finished) return;
  if (!ok) {
    FailLocked(
        absl::CancelledError(absl::StrCat("the client stopped reading ", StreamName(index))));
    return;
  }
  const int64_t bytes = lane.outbox.front().ByteSize();
  lane.pending_bytes -= bytes;
  pending_bytes_ -= bytes;
  lane.outbox.pop_front();
  if (summary_produced_ && lane.outbox.empty()) {
    lane.finished = true;
    lane.port->Finish(grpc::Status::OK);
    return;
  }
  StartWriteLocked(index);
  ScheduleComputeLocked();
}

template <typename Call>
void StreamPipeline<Call>::OnCancel(int index) {
  // The failure is set before the engine is told to stop (FailLocked does both, under the lock):
  // stopped first, the compute thread's own CANCELLED ("stopped between chunks") could win and
  // the streams would not be told which one was cancelled.
  std::lock_guard<std::mutex> lock(mu_);
  FailLocked(absl::CancelledError(
      absl::StrCat(StreamName(index), " was cancelled by the client, or its deadline expired")));
}

template <typename Call>
void StreamPipeline<Call>::Fail(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  FailLocked(why);
}

template <typename Call>
void StreamPipeline<Call>::OnDone(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  lanes_[index].port = nullptr;
}

template <typename Call>
void StreamPipeline<Call>::StartWriteLocked(int index) {
  Lane& lane = lanes_[index];
  if (lane.port == nullptr || lane.writing || lane.landing || lane.finished ||
      lane.outbox.empty()) {
    return;
  }
  const Response& next = lane.outbox.front();
  if (!next.landing.landed()) {
    // A CUDA head's rows still on their way to the host: written once they are, from the thread
    // that waits for the copies — neither this thread nor the compute thread waits.
    lane.landing = true;
    next.landing.WhenLanded([weak = this->weak_from_this(), index] {
      if (std::shared_ptr<StreamPipeline> self = weak.lock()) {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->lanes_[index].landing = false;
        self->StartWriteLocked(index);
      }
    });
    return;
  }
  lane.writing = true;
  lane.port->Write(&next);
}

template <typename Call>
bool StreamPipeline<Call>::HasWorkLocked() const {
  int lane = 0;
  switch (phase_) {
    case Phase::kHeader:
      return header_.has_value() || lanes_[0].client_done;
    case Phase::kAdmitting:
      return false;
    case Phase::kRunning:
      return !summary_produced_ && NextLocked(&lane) != Next::kNotReady;
  }
  return false;
}

template <typename Call>
void StreamPipeline<Call>::ScheduleComputeLocked() {
  if (computing_ || failed_ || !HasWorkLocked()) return;
  if (pending_bytes_ >= service_.options.max_pending_response_bytes) {
    if (!send_blocked_) send_blocked_since_ = Clock::now();
    send_blocked_ = true;
    return;  // OnWriteDone schedules again once the client has taken some results
  }
  if (send_blocked_) {
    send_wait_ += Clock::now() - send_blocked_since_;
    send_blocked_ = false;
  }
  computing_ = true;
  service_.compute.Submit([self = this->shared_from_this()] { self->ComputeNext(); });
}

// The next work item, if there is one (a cancelled call fails instead).
template <typename Call>
std::optional<typename StreamPipeline<Call>::Work> StreamPipeline<Call>::TakeWorkLocked() {
  if (failed_ || !HasWorkLocked()) return std::nullopt;
  Work work{.phase = phase_};
  if (phase_ == Phase::kHeader) {
    if (header_.has_value()) {
      work.request = Call::FromFirst(*std::move(header_));
      header_.reset();
      return work;
    }
  } else {
    int lane = 0;
    if (NextLocked(&lane) == Next::kMessage) {
      work.request = std::move(lanes_[lane].inbox.front());
      lanes_[lane].inbox.pop_front();
      StartReadLocked(lane);
      return work;
    }
  }
  for (int i = 0; i < streams_; ++i) {
    if (lanes_[i].port != nullptr && lanes_[i].port->IsCancelled()) {
      FailLocked(CancelledByClient(i));
      return std::nullopt;
    }
  }
  work.end = true;
  work.timings = TimingsLocked();
  call_.set_timings(work.timings);  // the summary reports them
  return work;
}

// On a ComputePool thread: one message (or the end of the call), then reschedules itself, so
// calls sharing the pool take turns message by message.
template <typename Call>
void StreamPipeline<Call>::ComputeNext() {
  std::unique_lock<std::mutex> lock(mu_);
  std::optional<Work> work = TakeWorkLocked();
  if (!work.has_value()) {
    ReturnFromComputeLocked();
    return;
  }
  lock.unlock();

  std::vector<Response> produced;
  const Clock::time_point t0 = Clock::now();
  absl::Status status = RunCall(*work, &produced);
  const Clock::duration spent = Clock::now() - t0;
  if (work->end && status.ok()) {
    // Done computing: the memory goes back before the summary reaches the client, so a trainer
    // that sends its next request on seeing it is not refused for its own previous one.
    service_.admission.Release(ticket_);
    call_.Complete(work->timings);
  }
  const bool admitting = status.ok() && work->phase == Phase::kHeader && call_.begun();
  if (admitting) status = StartAdmission();

  lock.lock();
  compute_ += spent;
  if (!status.ok()) {
    FailLocked(status);
  } else if (!admitting) {
    DeliverLocked(std::move(produced), work->end);
  }
  ReturnFromComputeLocked();
}

// The call's handling of one work item. No exception escapes a handler: anything thrown
// becomes INTERNAL with its message.
template <typename Call>
absl::Status StreamPipeline<Call>::RunCall(Work& work, std::vector<Response>* produced) {
  try {
    return work.end ? call_.OnClientDone(produced)
                    : call_.OnRequest(std::move(*work.request), produced);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
}

// After the header: the call waits for admission before any rows are read. on_admitted may run
// right here, or later on the thread that frees capacity.
template <typename Call>
absl::Status StreamPipeline<Call>::StartAdmission() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    phase_ = Phase::kAdmitting;
    queued_since_ = Clock::now();
  }
  // A step of a group or mesh that is down could never be applied: refused before it is queued.
  if (absl::Status down = service_.Serving(); !down.ok()) return down;
  const MemoryEstimate need = call_.EstimateMemory(PipelineBytes());
  return service_.admission.Admit(ticket_, need.bytes, need.breakdown, [this] { OnAdmitted(); });
}

// Called by the AdmissionController, under its lock.
template <typename Call>
void StreamPipeline<Call>::OnAdmitted() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  phase_ = Phase::kRunning;
  queue_ += Clock::now() - queued_since_;
  call_.Admitted();
  for (int i = 0; i < streams_; ++i) StartReadLocked(i);
  ScheduleComputeLocked();
}

template <typename Call>
void StreamPipeline<Call>::DeliverLocked(std::vector<Response> produced, bool end) {
  auto queue = [&](int index, Response response) {
    const int64_t bytes = response.ByteSize();
    lanes_[index].pending_bytes += bytes;
    pending_bytes_ += bytes;
    lanes_[index].outbox.push_back(std::move(response));
  };
  for (Response& r : produced) {
    if (Call::ToEveryStream(r)) {
      for (int i = 0; i < streams_; ++i) queue(i, r);
      continue;
    }
    // The stream with the fewest bytes waiting, ties taken in turn: results spread over them
    // all even when every write completes before the next result exists.
    int least = next_lane_;
    for (int k = 1; k < streams_; ++k) {
      const int i = (next_lane_ + k) % streams_;
      if (lanes_[i].pending_bytes < lanes_[least].pending_bytes) least = i;
    }
    next_lane_ = (least + 1) % streams_;
    queue(least, std::move(r));
  }
  if (end) {
    summary_produced_ = true;
    if (streams_ > 1) service_.stripes.End(key_, absl::OkStatus());
  }
  for (int i = 0; i < streams_; ++i) StartWriteLocked(i);
}

template <typename Call>
void StreamPipeline<Call>::ReturnFromComputeLocked() {
  computing_ = false;
  int lane = 0;
  if (phase_ == Phase::kRunning && !failed_ && !starved_ && !summary_produced_ &&
      NextLocked(&lane) == Next::kNotReady) {
    starved_ = true;  // waiting for the client's next rows
    starved_since_ = Clock::now();
  }
  ScheduleComputeLocked();
}

// What the call may buffer: the rows each stream reads ahead (messages of up to 4 MiB assumed)
// and the results waiting to be sent.
template <typename Call>
int64_t StreamPipeline<Call>::PipelineBytes() const {
  return StreamPipelineBytes(streams_, service_.options.read_ahead_messages,
                             service_.options.max_pending_response_bytes);
}

template <typename Call>
CallTimings StreamPipeline<Call>::TimingsLocked() const {
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  return CallTimings{.phases = {.queue = seconds(queue_),
                                .receive = seconds(receive_wait_),
                                .compute = seconds(compute_),
                                .send = seconds(send_wait_)},
                     .total_seconds = seconds(Clock::now() - started_)};
}

template <typename Call>
void StreamPipeline<Call>::FailLocked(const absl::Status& status) {
  if (failed_) return;
  failed_ = true;
  stop_.store(true);
  failure_ = ToGrpcStatus(status);
  for (Lane& lane : lanes_) {
    if (lane.port == nullptr || lane.finished) continue;
    lane.finished = true;
    lane.port->Finish(failure_);
  }
  if (streams_ > 1) service_.stripes.End(key_, status);
}

}  // namespace remotehead::server
