// One ForwardBackward / Forward / Backward call between gRPC and the engine, carried by one
// stream or striped over C (StepHeader.stripe): the messages the streams read wait here, merged
// in row order, until a ComputePool thread runs them through the call's StepStream, one at a
// time; what it produces is queued for the streams to write. So rows k+1 arrive and the results
// of k−1 go out while k is computed.
//
// Lifecycle: the header (stream 0's first message) is run first, then the call waits for
// admission (memory budget, request limits) before any rows are read. Any error, a cancelled
// stream or an expired deadline finishes every stream at once; the session then commits
// nothing. The streams (StepPort, step_reactor.cc) and a running compute task each hold the
// pipeline; it ends with the last of them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "remotehead/core/call_plan.h"
#include "remotehead/v1/head_service.pb.h"
#include "rpc/service_context.h"
#include "rpc/step_stream.h"

namespace remotehead::server {

// One gRPC stream of a step, as the pipeline drives it; called under the pipeline's lock, never
// after the stream's OnDone has detached it.
class StepPort {
 public:
  virtual ~StepPort() = default;
  virtual void Read(InboundRequest* into) = 0;
  // `response` stays as it is until the write is done (OnWriteDone).
  virtual void Write(const StepResponseOut* response) = 0;
  virtual void Finish(const grpc::Status& status) = 0;
  virtual bool IsCancelled() const = 0;
};

class StepPipeline : public std::enable_shared_from_this<StepPipeline> {
 public:
  // `streams`: C (1 unless striped); `key`: the stripe key (empty for one stream).
  StepPipeline(ServiceContext* service, core::CallMode mode, int streams, std::string key);
  ~StepPipeline();
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  // Stream `index` of `count` joins, having read its first message: stream 0's is the call's
  // header (none when the stream ended before sending one); another's states only its stripe.
  // A stream that does not fit (mode, count, an index taken) fails the call. `messages`
  // (StripeSpec.messages): the rows messages the stream announced; unset: it ends at its
  // half-close.
  void Attach(int index, int count, core::CallMode mode,
              std::chrono::system_clock::time_point deadline, StepPort* port,
              std::optional<v1::StepRequest> first, std::optional<int64_t> messages);
  // The gRPC reactions of stream `index`.
  void OnReadDone(int index, bool ok);
  void OnWriteDone(int index, bool ok);
  void OnCancel(int index);
  // The stream is gone: the pipeline no longer calls it.
  void OnDone(int index);
  // Fails the call from outside (a stream of it refused before joining).
  void Fail(const absl::Status& why);
  // Where a stream decodes the hidden rows it reads (on its own thread, without the pipeline's
  // lock): set up once the call is admitted, before any rows are read.
  RowStaging& staging() { return staging_; }
  // Fails the call (ABORTED, naming them) if some of its streams have not joined yet: they were
  // given `within` since the first came.
  void FailUnlessJoined(std::chrono::milliseconds within);

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kHeader, kAdmitting, kRunning };
  struct Lane;  // one stream's reads and writes
  struct Work;  // what one compute task works on
  enum class Next { kNotReady, kMessage, kEnd };

  // Reading, writing, merging (under mu_).
  void StartReadLocked(int index);
  void StartWriteLocked(int index);
  absl::Status AcceptLocked(int index, InboundRequest message);
  // The next message in row order (its lane in *lane), the end of the call, or neither yet.
  Next NextLocked(int* lane) const;
  bool HasWorkLocked() const;
  // Computing.
  void ScheduleComputeLocked();
  std::optional<Work> TakeWorkLocked();
  void ComputeNext();
  absl::Status RunSession(Work& work, std::vector<StepResponseOut>* produced);
  void OnSessionComplete(const v1::StepTimings& timings);
  absl::Status StartAdmission();
  void OnAdmitted();
  void ReturnFromComputeLocked();
  // Results to the streams: the summary to each, the rest to the least loaded.
  void DeliverLocked(std::vector<StepResponseOut> produced, bool end);
  int64_t PipelineBytes() const;
  v1::StepTimings TimingsLocked() const;
  // Ends every stream with `status` (the first failure wins).
  void FailLocked(const absl::Status& status);
  std::string StreamName(int index) const;
  absl::Status CancelledByClient(int index) const;

  ServiceContext& service_;
  const core::CallMode mode_;
  const int streams_;
  const std::string key_;
  StepStream stream_;  // used by one compute task at a time
  RowStaging staging_;
  const uint64_t ticket_;
  const Clock::time_point started_;
  std::atomic<bool> stop_{false};
  // The earliest deadline of the streams, as system_clock ticks (read by should_stop).
  std::atomic<std::chrono::system_clock::rep> deadline_;

  std::mutex mu_;  // guards everything below, and the streams' calls
  std::vector<Lane> lanes_;
  Phase phase_ = Phase::kHeader;
  std::optional<v1::StepRequest> header_;  // stream 0's first message, until computed
  int64_t pending_bytes_ = 0;              // bytes in every lane's outbox
  int next_lane_ = 0;                      // where a result goes when the lanes are even
  bool computing_ = false;
  bool summary_produced_ = false;
  bool failed_ = false;
  grpc::Status failure_;  // what every stream ends with once failed_
  // Timings reported in the summary.
  Clock::time_point queued_since_, starved_since_, send_blocked_since_;
  bool starved_ = false;
  bool send_blocked_ = false;
  Clock::duration queue_{}, receive_wait_{}, compute_{}, send_wait_{};
};

}  // namespace remotehead::server
