#include "rpc/step_pipeline.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "rpc/step_pipeline_lane.h"

namespace remotehead::server {

struct StepPipeline::Work {
  std::optional<InboundRequest> request;
  bool end = false;
  Phase phase = Phase::kHeader;
  v1::StepTimings timings;  // at the end: what the summary and the metrics report
};

StepPipeline::StepPipeline(ServiceContext* service, core::CallMode mode, int streams,
                           std::string key)
    : service_(*service),
      mode_(mode),
      streams_(streams),
      key_(std::move(key)),
      stream_(service->registry, &service->retained, mode, service->options.response_chunk_bytes,
              service->options.group),
      ticket_(service->admission.NewTicket()),
      started_(Clock::now()),
      deadline_(std::chrono::system_clock::time_point::max().time_since_epoch().count()),
      lanes_(streams) {
  stream_.session().set_reserve_more([this](int64_t bytes, const std::string& why) {
    return service_.admission.Grow(ticket_, bytes, why);
  });
  stream_.session().set_fused_blocks(service->options.fused_blocks);
  stream_.session().set_should_stop([this] {
    const auto now = std::chrono::system_clock::now().time_since_epoch().count();
    return stop_.load(std::memory_order_relaxed) || now > deadline_.load(std::memory_order_relaxed);
  });
}

StepPipeline::~StepPipeline() {
  // Frees the call's admitted bytes, or withdraws it from the queue. Waits for an admission
  // callback running on another thread, which then sees failed_ and does nothing.
  service_.admission.Release(ticket_);
}

std::string StepPipeline::StreamName(int index) const {
  return streams_ == 1 ? "the stream" : absl::StrCat("stream ", index, " of ", streams_);
}

absl::Status StepPipeline::CancelledByClient(int index) const {
  return absl::CancelledError(absl::StrCat(StreamName(index), " was cancelled by the client"));
}

void StepPipeline::OnWriteDone(int index, bool ok) {
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

void StepPipeline::OnCancel(int index) {
  // The failure is set before the engine is told to stop (FailLocked does both, under the lock):
  // stopped first, the compute thread's own CANCELLED ("stopped between chunks") could win and
  // the streams would not be told which one was cancelled.
  std::lock_guard<std::mutex> lock(mu_);
  FailLocked(absl::CancelledError(
      absl::StrCat(StreamName(index), " was cancelled by the client, or its deadline expired")));
}

void StepPipeline::Fail(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  FailLocked(why);
}

void StepPipeline::OnDone(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  lanes_[index].port = nullptr;
}

void StepPipeline::StartWriteLocked(int index) {
  Lane& lane = lanes_[index];
  if (lane.port == nullptr || lane.writing || lane.landing || lane.finished ||
      lane.outbox.empty()) {
    return;
  }
  const StepResponseOut& next = lane.outbox.front();
  if (!next.landing.landed()) {
    // A CUDA head's rows still on their way to the host: written once they are, from the thread
    // that waits for the copies — neither this thread nor the compute thread waits.
    lane.landing = true;
    next.landing.WhenLanded([weak = weak_from_this(), index] {
      if (std::shared_ptr<StepPipeline> self = weak.lock()) {
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

bool StepPipeline::HasWorkLocked() const {
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

void StepPipeline::ScheduleComputeLocked() {
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
  service_.compute.Submit([self = shared_from_this()] { self->ComputeNext(); });
}

// The next work item, if there is one (a cancelled call fails instead).
std::optional<StepPipeline::Work> StepPipeline::TakeWorkLocked() {
  if (failed_ || !HasWorkLocked()) return std::nullopt;
  Work work{.phase = phase_};
  if (phase_ == Phase::kHeader) {
    if (header_.has_value()) {
      work.request = InboundRequest{.message = *std::move(header_)};
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
  stream_.set_timings(work.timings);
  return work;
}

// On a ComputePool thread: one message (or the end of the call), then reschedules itself, so
// calls sharing the pool take turns message by message.
void StepPipeline::ComputeNext() {
  std::unique_lock<std::mutex> lock(mu_);
  std::optional<Work> work = TakeWorkLocked();
  if (!work.has_value()) {
    ReturnFromComputeLocked();
    return;
  }
  lock.unlock();

  std::vector<StepResponseOut> produced;
  const Clock::time_point t0 = Clock::now();
  absl::Status status = RunSession(*work, &produced);
  const Clock::duration spent = Clock::now() - t0;
  if (work->end && status.ok()) OnSessionComplete(work->timings);
  const bool admitting =
      status.ok() && work->phase == Phase::kHeader && stream_.session().has_begun();
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

// The session's handling of one work item. No exception escapes a handler: anything thrown
// becomes INTERNAL with its message.
absl::Status StepPipeline::RunSession(Work& work, std::vector<StepResponseOut>* produced) {
  try {
    return work.end ? stream_.OnClientDone(produced)
                    : stream_.OnRequest(std::move(*work.request), produced);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
}

// Done computing: the memory goes back before the summary reaches the client, so a trainer that
// sends its next request on seeing it is not refused for its own previous one.
void StepPipeline::OnSessionComplete(const v1::StepTimings& timings) {
  service_.admission.Release(ticket_);
  if (service_.options.metrics == nullptr) return;
  const StepSession& session = stream_.session();
  service_.options.metrics->ObserveStep(std::string(core::CallModeName(mode_)), session.head_id(),
                                        session.function(), session.valid_tokens(),
                                        {.queue = timings.queue_seconds(),
                                         .receive = timings.receive_wait_seconds(),
                                         .compute = timings.compute_seconds(),
                                         .send = timings.send_wait_seconds()},
                                        session.logits_chunk_bytes());
}

// After the header: the call waits for admission before any rows are read. on_admitted may run
// right here, or later on the thread that frees capacity.
absl::Status StepPipeline::StartAdmission() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    phase_ = Phase::kAdmitting;
    queued_since_ = Clock::now();
  }
  // A step of a group or mesh that is down could never be applied: refused before it is queued.
  if (absl::Status down = service_.Serving(); !down.ok()) return down;
  const MemoryEstimate need = stream_.session().EstimateMemory(PipelineBytes());
  return service_.admission.Admit(ticket_, need.bytes, need.breakdown, [this] { OnAdmitted(); });
}

// Called by the AdmissionController, under its lock.
void StepPipeline::OnAdmitted() {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  phase_ = Phase::kRunning;
  queue_ += Clock::now() - queued_since_;
  staging_.Configure(stream_.session().row_layout());
  for (int i = 0; i < streams_; ++i) StartReadLocked(i);
  ScheduleComputeLocked();
}

void StepPipeline::DeliverLocked(std::vector<StepResponseOut> produced, bool end) {
  auto queue = [&](int index, StepResponseOut response) {
    const int64_t bytes = response.ByteSize();
    lanes_[index].pending_bytes += bytes;
    pending_bytes_ += bytes;
    lanes_[index].outbox.push_back(std::move(response));
  };
  for (StepResponseOut& r : produced) {
    if (r.message.part_case() == v1::StepResponse::kSummary) {
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

void StepPipeline::ReturnFromComputeLocked() {
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
int64_t StepPipeline::PipelineBytes() const {
  return StepPipelineBytes(streams_, service_.options.read_ahead_messages,
                           service_.options.max_pending_response_bytes);
}

v1::StepTimings StepPipeline::TimingsLocked() const {
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  v1::StepTimings t;
  t.set_queue_seconds(seconds(queue_));
  t.set_receive_wait_seconds(seconds(receive_wait_));
  t.set_compute_seconds(seconds(compute_));
  t.set_send_wait_seconds(seconds(send_wait_));
  t.set_total_seconds(seconds(Clock::now() - started_));
  return t;
}

void StepPipeline::FailLocked(const absl::Status& status) {
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
