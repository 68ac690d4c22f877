// One streaming compute call between gRPC and the engine, carried by one stream or striped over
// C (StepHeader.stripe), typed over the call it runs (Triton's InferHandler pattern): the
// pipeline owns the queues, admission, back-pressure and the stripes' merge; the call (`Call`,
// below: StepStream for ForwardBackward / Forward / Backward) owns its messages and what they
// mean. The messages the streams read wait here, merged in row order, until a ComputePool
// thread runs them through the call, one at a time; what it produces is queued for the streams
// to write. So rows k+1 arrive and the results of k−1 go out while k is computed.
//
// Lifecycle: the header (stream 0's first message) is run first, then the call waits for
// admission (memory budget, request limits) before any rows are read. Any error, a cancelled
// stream or an expired deadline finishes every stream at once; the call then commits nothing.
// The streams (StreamReactor, stream_reactor.h) and a running compute task each hold the
// pipeline; it ends with the last of them.
//
// The definitions are templates, in stream_pipeline_compute.h (compute, results, failure) and
// stream_pipeline_reads.h (the streams' joins and reads, merged in row order); the .cc that
// serves a call includes them (step_reactor.cc).
//
// What a `Call` gives the pipeline (StepStream is the model):
//   Request, Response    one message of a stream in, one out; Response has ByteSize() and a
//                        `landing` (core::HostCopy) it is written after
//   First                a stream's first message, parsed whole (the call's header on stream 0)
//   Call(ServiceContext*, core::CallMode, CallHooks)
//   absl::Status OnRequest(Request, std::vector<Response>*)   the header first, then rows
//   void set_timings(const CallTimings&)  before the end: what the summary reports
//   absl::Status OnClientDone(std::vector<Response>*)          the end: the summary last
//   bool begun() const                   the header has run: admission next
//   MemoryEstimate EstimateMemory(int64_t pipeline_bytes) const
//   void Admitted()                      admitted: set up what the streams decode rows with
//   absl::Status Decode(grpc::ByteBuffer*, Request*)          on a stream's thread, no lock
//   void Complete(const CallTimings&)    done: the metrics observe it
//   static Request FromFirst(First)
//   static absl::Status ParseFirst(grpc::ByteBuffer*, First*)
//   static absl::StatusOr<StripeOf> ReadStripe(const First&)   checked
//   static StripeOf StripeAsSent(const First&)      as sent, unchecked (to name it in a failure)
//   static absl::StatusOr<int64_t> StripedRowOffset(const Request&, const std::string& stream)
//   static int64_t RowOffset(const Request&)        the merge's order
//   static bool ToEveryStream(const Response&)      the summary: every stream gets it
//   static grpc::ByteBuffer Serialize(const Response&)
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/server/service/metrics.h"
#include "rpc/service_context.h"
#include "rpc/stripe_joins.h"
#include "service/request_memory.h"

namespace remotehead::server {

// How long a call waited where (the metrics' phases) and took in all: its summary and the
// metrics report them.
struct CallTimings {
  StepPhaseSeconds phases;
  double total_seconds = 0;
};

// What the pipeline lends its call: more memory as it learns what it needs, and whether to stop
// (a stream cancelled or failed, a deadline passed).
struct CallHooks {
  std::function<absl::Status(int64_t bytes, const std::string& why)> reserve_more;
  std::function<bool()> should_stop;
};

// One gRPC stream of a call, as the pipeline drives it; called under the pipeline's lock, never
// after the stream's OnDone has detached it.
template <typename Request, typename Response>
class StreamPort {
 public:
  virtual ~StreamPort() = default;
  virtual void Read(Request* into) = 0;
  // `response` stays as it is until the write is done (OnWriteDone).
  virtual void Write(const Response* response) = 0;
  virtual void Finish(const grpc::Status& status) = 0;
  virtual bool IsCancelled() const = 0;
};

template <typename Call>
class StreamPipeline final : public StripedCall,
                             public std::enable_shared_from_this<StreamPipeline<Call>> {
 public:
  using Request = typename Call::Request;
  using Response = typename Call::Response;
  using First = typename Call::First;
  using Port = StreamPort<Request, Response>;

  // `streams`: C (1 unless striped); `key`: the stripe key (empty for one stream).
  StreamPipeline(ServiceContext* service, core::CallMode mode, int streams, std::string key);
  ~StreamPipeline() override;
  StreamPipeline(const StreamPipeline&) = delete;
  StreamPipeline& operator=(const StreamPipeline&) = delete;

  // Stream `index` of `count` joins, having read its first message: stream 0's is the call's
  // header (none when the stream ended before sending one); another's states only its stripe.
  // A stream that does not fit (mode, count, an index taken) fails the call. `messages`
  // (StripeSpec.messages): the rows messages the stream announced; unset: it ends at its
  // half-close.
  void Attach(int index, int count, core::CallMode mode,
              std::chrono::system_clock::time_point deadline, Port* port,
              std::optional<First> first, std::optional<int64_t> messages);
  // The gRPC reactions of stream `index`.
  void OnReadDone(int index, bool ok);
  void OnWriteDone(int index, bool ok);
  void OnCancel(int index);
  // The stream is gone: the pipeline no longer calls it.
  void OnDone(int index);
  // StripedCall.
  void Fail(const absl::Status& why) override;
  void FailUnlessJoined(std::chrono::milliseconds within) override;
  // A stream's message of the running call, decoded on the stream's own thread without the
  // pipeline's lock (Call::Decode: the rows straight to where they are computed from).
  absl::Status Decode(grpc::ByteBuffer* bytes, Request* into) { return call_.Decode(bytes, into); }

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kHeader, kAdmitting, kRunning };
  enum class Next { kNotReady, kMessage, kEnd };
  // One stream's reads and writes, under mu_.
  struct Lane {
    Port* port = nullptr;  // null until the stream joins, and again once it is done
    bool attached = false;
    Request incoming;              // target of the read in flight
    std::deque<Request> inbox;     // read, not yet computed
    std::deque<Response> outbox;   // produced, not yet written (front: in flight)
    int64_t pending_bytes = 0;     // bytes in outbox
    int64_t last_row_offset = -1;  // striped: each stream's rows come in increasing order
    bool reading = false;
    bool writing = false;
    bool landing = false;  // the outbox's front waits for its rows' copy from the device
    bool client_done = false;
    bool finished = false;
    std::optional<int64_t> announced;  // StripeSpec.messages
    int64_t received = 0;              // rows messages read
  };
  // What one compute task works on.
  struct Work {
    std::optional<Request> request;
    bool end = false;
    Phase phase = Phase::kHeader;
    CallTimings timings;  // at the end: what the summary and the metrics report
  };

  // Reading, writing, merging (under mu_; stream_pipeline_reads.h).
  void StartReadLocked(int index);
  void StartWriteLocked(int index);
  absl::Status AcceptLocked(int index, Request message);
  // The next message in row order (its lane in *lane), the end of the call, or neither yet.
  Next NextLocked(int* lane) const;
  bool HasWorkLocked() const;
  // Computing (stream_pipeline_compute.h).
  void ScheduleComputeLocked();
  std::optional<Work> TakeWorkLocked();
  void ComputeNext();
  absl::Status RunCall(Work& work, std::vector<Response>* produced);
  absl::Status StartAdmission();
  void OnAdmitted();
  void ReturnFromComputeLocked();
  // Results to the streams: the summary to each, the rest to the least loaded.
  void DeliverLocked(std::vector<Response> produced, bool end);
  int64_t PipelineBytes() const;
  CallTimings TimingsLocked() const;
  // Ends every stream with `status` (the first failure wins).
  void FailLocked(const absl::Status& status);
  std::string StreamName(int index) const;
  absl::Status CancelledByClient(int index) const;

  ServiceContext& service_;
  const core::CallMode mode_;
  const int streams_;
  const std::string key_;
  const uint64_t ticket_;
  const Clock::time_point started_;
  std::atomic<bool> stop_{false};
  // The earliest deadline of the streams, as system_clock ticks (read by should_stop).
  std::atomic<std::chrono::system_clock::rep> deadline_;
  Call call_;  // run by one compute task at a time; its Decode by the streams

  std::mutex mu_;  // guards everything below, and the streams' calls
  std::vector<Lane> lanes_;
  Phase phase_ = Phase::kHeader;
  std::optional<First> header_;  // stream 0's first message, until computed
  int64_t pending_bytes_ = 0;    // bytes in every lane's outbox
  int next_lane_ = 0;            // where a result goes when the lanes are even
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
