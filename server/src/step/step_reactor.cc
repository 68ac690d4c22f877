// One ForwardBackward / Forward / Backward call, pipelined: gRPC's callback threads only move
// messages — reading up to `read_ahead_messages` ahead and writing results as they are produced
// (one write in flight; back-pressure through OnWriteDone) — while a ComputePool thread runs the
// StepStream (the call read into a StepSession) on one message at a time, in order. So rows k+1 arrive and the results of k−1 go
// out while k is computed.
//
// Lifecycle: the header is read and validated first, then the request waits for admission
// (memory budget, request limits; RESOURCE_EXHAUSTED when the queue is full) before any rows
// are read. Any error, cancellation or expired deadline finishes the call at once; the session
// then commits nothing. The reactor is deleted by whichever of OnDone and a running compute
// task comes last.
#include "step/step_reactor.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/server/status_mapping.h"
#include "step/step_stream.h"

namespace remotehead::server {
namespace {

class StepReactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  StepReactor(grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service)
      : context_(context),
        service_(*service),
        mode_(mode),
        stream_(service->registry, &service->retained, mode, service->options.response_chunk_bytes,
                service->options.group),
        ticket_(service->admission.NewTicket()),
        deadline_(context->deadline()),
        started_(Clock::now()) {
    stream_.session().set_reserve_more([this](int64_t bytes, const std::string& why) {
      return service_.admission.Grow(ticket_, bytes, why);
    });
    stream_.session().set_should_stop([this] {
      return stop_.load(std::memory_order_relaxed) || std::chrono::system_clock::now() > deadline_;
    });
    std::lock_guard<std::mutex> lock(mu_);
    StartReadLocked();
  }

  ~StepReactor() override {
    // Frees this call's admitted bytes, or withdraws it from the queue. Waits for an admission
    // callback running on another thread, which then sees finished_ and does nothing.
    service_.admission.Release(ticket_);
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (finished_) return;
    if (!ok) {
      if (context_->IsCancelled()) {
        FinishLocked(ToGrpcStatus(absl::CancelledError("cancelled by the client")));
        return;
      }
      client_done_ = true;
    } else {
      inbox_.push_back(std::move(incoming_));
      incoming_.Clear();
      ++messages_read_;
    }
    if (starved_) {
      receive_wait_ += Clock::now() - starved_since_;
      starved_ = false;
    }
    StartReadLocked();
    ScheduleComputeLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok) {
      FinishLocked(ToGrpcStatus(absl::CancelledError("the client stopped reading")));
      return;
    }
    pending_bytes_ -= static_cast<int64_t>(outbox_.front().ByteSizeLong());
    outbox_.pop_front();
    if (summary_produced_ && outbox_.empty()) {
      FinishLocked(grpc::Status::OK);
      return;
    }
    StartWriteLocked();
    ScheduleComputeLocked();
  }

  void OnCancel() override {
    stop_.store(true);
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(
        ToGrpcStatus(absl::CancelledError("cancelled by the client, or its deadline expired")));
  }

  void OnDone() override {
    std::unique_lock<std::mutex> lock(mu_);
    done_ = true;
    if (computing_) return;  // the compute task deletes this when it returns
    lock.unlock();
    delete this;
  }

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kHeader, kAdmitting, kRunning };

  // What one compute task works on: the next message, or the end of the stream.
  struct Work {
    std::optional<v1::StepRequest> request;
    bool end = false;
    bool more_queued = false;  // further messages wait in the inbox: the session may batch
    Phase phase = Phase::kHeader;
    v1::StepTimings timings;  // at the end: what the summary and the metrics report
  };

  // Reads the next message if the pipeline has room: only the header before admission, then up
  // to read_ahead_messages not yet computed.
  void StartReadLocked() {
    if (reading_ || finished_ || client_done_) return;
    if (phase_ != Phase::kRunning && messages_read_ > 0) return;
    if (static_cast<int>(inbox_.size()) >= service_.options.read_ahead_messages) return;
    reading_ = true;
    StartRead(&incoming_);
  }

  void StartWriteLocked() {
    if (writing_ || finished_ || outbox_.empty()) return;
    writing_ = true;
    StartWrite(&outbox_.front());
  }

  bool HasWorkLocked() const {
    switch (phase_) {
      case Phase::kHeader:
        return !inbox_.empty() || client_done_;
      case Phase::kAdmitting:
        return false;
      case Phase::kRunning:
        return !inbox_.empty() || (client_done_ && !summary_produced_);
    }
    return false;
  }

  void ScheduleComputeLocked() {
    if (computing_ || finished_ || !HasWorkLocked()) return;
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
    service_.compute.Submit([this] { ComputeNext(); });
  }

  // The next work item, if there is one (a cancelled call finishes instead).
  std::optional<Work> TakeWorkLocked() {
    if (finished_ || !HasWorkLocked()) return std::nullopt;
    Work work{.phase = phase_};
    if (!inbox_.empty()) {
      work.request = std::move(inbox_.front());
      inbox_.pop_front();
      work.more_queued = !inbox_.empty();
      StartReadLocked();
      return work;
    }
    if (context_->IsCancelled()) {
      FinishLocked(ToGrpcStatus(absl::CancelledError("cancelled by the client")));
      return std::nullopt;
    }
    work.end = true;
    work.timings = TimingsLocked();
    stream_.set_timings(work.timings);
    return work;
  }

  // On a ComputePool thread: one message (or the end of the stream), then reschedules itself,
  // so calls sharing the pool take turns message by message.
  void ComputeNext() {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<Work> work = TakeWorkLocked();
    if (!work.has_value()) {
      ReturnFromComputeLocked(std::move(lock));
      return;
    }
    lock.unlock();

    std::vector<v1::StepResponse> produced;
    const Clock::time_point t0 = Clock::now();
    absl::Status status = RunSession(*work, &produced);
    const Clock::duration spent = Clock::now() - t0;
    if (work->end && status.ok()) OnSessionComplete(work->timings);
    const bool admitting = status.ok() && work->phase == Phase::kHeader && stream_.session().has_begun();
    if (admitting) status = StartAdmission();

    lock.lock();
    compute_ += spent;
    if (!status.ok()) {
      FinishLocked(ToGrpcStatus(status));
    } else if (!admitting) {
      DeliverLocked(std::move(produced), work->end);
    }
    ReturnFromComputeLocked(std::move(lock));
  }

  // The session's handling of one work item. No exception escapes a handler: anything thrown
  // becomes INTERNAL with its message.
  absl::Status RunSession(Work& work, std::vector<v1::StepResponse>* produced) {
    try {
      return work.end ? stream_.OnClientDone(produced)
                      : stream_.OnRequest(std::move(*work.request), produced, work.more_queued);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
    }
  }

  // Done computing: the memory goes back before the summary reaches the client, so a trainer
  // that sends its next request on seeing it is not refused for its own previous one.
  void OnSessionComplete(const v1::StepTimings& timings) {
    service_.admission.Release(ticket_);
    if (service_.options.metrics == nullptr) return;
    service_.options.metrics->ObserveStep(
        std::string(core::CallModeName(mode_)), session().head_id(), session().function(),
        session().valid_tokens(), timings, session().logits_chunk_bytes());
  }

  // After the header: the request waits for admission before any rows are read.
  // on_admitted may run right here, or later on the thread that frees capacity.
  absl::Status StartAdmission() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      phase_ = Phase::kAdmitting;
      queued_since_ = Clock::now();
    }
    const MemoryEstimate need = stream_.session().EstimateMemory(PipelineBytes());
    return service_.admission.Admit(ticket_, need.bytes, need.breakdown, [this] { OnAdmitted(); });
  }

  void DeliverLocked(std::vector<v1::StepResponse> produced, bool end) {
    for (auto& r : produced) {
      pending_bytes_ += static_cast<int64_t>(r.ByteSizeLong());
      outbox_.push_back(std::move(r));
    }
    if (end) summary_produced_ = true;
    StartWriteLocked();
  }

  void ReturnFromComputeLocked(std::unique_lock<std::mutex> lock) {
    computing_ = false;
    if (done_) {
      lock.unlock();
      delete this;
      return;
    }
    if (phase_ == Phase::kRunning && !finished_ && inbox_.empty() && !client_done_ && !starved_) {
      starved_ = true;  // waiting for the client's next rows
      starved_since_ = Clock::now();
    }
    ScheduleComputeLocked();
  }

  // Called by the AdmissionController, under its lock.
  void OnAdmitted() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    phase_ = Phase::kRunning;
    queue_ += Clock::now() - queued_since_;
    StartReadLocked();
    ScheduleComputeLocked();
  }

  // What this call may buffer: the rows read ahead (messages of up to 4 MiB assumed) and the
  // results waiting to be sent.
  int64_t PipelineBytes() const {
    return StepPipelineBytes(service_.options.read_ahead_messages,
                             service_.options.max_pending_response_bytes);
  }

  v1::StepTimings TimingsLocked() const {
    auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    v1::StepTimings t;
    t.set_queue_seconds(seconds(queue_));
    t.set_receive_wait_seconds(seconds(receive_wait_));
    t.set_compute_seconds(seconds(compute_));
    t.set_send_wait_seconds(seconds(send_wait_));
    t.set_total_seconds(seconds(Clock::now() - started_));
    return t;
  }

  void FinishLocked(grpc::Status status) {
    if (finished_) return;
    finished_ = true;
    stop_.store(true);
    Finish(std::move(status));
  }

  grpc::CallbackServerContext* context_;  // valid until OnDone
  ServiceContext& service_;
  const core::CallMode mode_;
  const StepSession& session() const { return stream_.session(); }

  StepStream stream_;  // used by one compute task at a time
  const uint64_t ticket_;
  const std::chrono::system_clock::time_point deadline_;
  const Clock::time_point started_;
  std::atomic<bool> stop_{false};

  std::mutex mu_;  // guards everything below
  Phase phase_ = Phase::kHeader;
  v1::StepRequest incoming_;             // target of the read in flight
  std::deque<v1::StepRequest> inbox_;    // read, not yet computed
  std::deque<v1::StepResponse> outbox_;  // produced, not yet written (front: in flight)
  int64_t pending_bytes_ = 0;            // bytes in outbox_
  int64_t messages_read_ = 0;
  bool reading_ = false;
  bool writing_ = false;
  bool computing_ = false;
  bool client_done_ = false;
  bool summary_produced_ = false;
  bool finished_ = false;
  bool done_ = false;
  // Timings reported in the summary.
  Clock::time_point queued_since_, starved_since_, send_blocked_since_;
  bool starved_ = false;
  bool send_blocked_ = false;
  Clock::duration queue_{}, receive_wait_{}, compute_{}, send_wait_{};
};

}  // namespace

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* NewStepReactor(
    grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service) {
  return new StepReactor(context, mode, service);
}

}  // namespace remotehead::server
