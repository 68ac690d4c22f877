// StreamPipeline over a call that is not a step (a toy call whose messages are plain structs, fed
// through fake streams): what a new streaming compute RPC reuses — the header first, admission
// before any rows are read, striped streams merged in row order, the summary to every stream
// and the other results spread over them, back-pressure on results the client has not taken, a
// failure ending every stream and completing nothing.
#include "rpc/stream_pipeline.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "remotehead/core/device_transfer.h"
#include "remotehead/server/service/head_registry.h"
#include "rpc/service_context.h"
#include "rpc/stream_pipeline_compute.h"
#include "rpc/stream_pipeline_reads.h"

namespace remotehead::server {
namespace {

// What the toy call saw, for the test to read (calls run on the compute pool's thread).
struct CallLog {
  std::mutex mu;
  std::vector<int64_t> rows;  // row offsets, in the order the call computed them
  int headers = 0;
  int completed = 0;
  int admitted = 0;
};
CallLog* log_of_calls = nullptr;

struct ToyMessage {
  bool header = false;
  int64_t row_offset = 0;
};
struct ToyResult {
  int64_t row_offset = -1;  // -1: the summary
  int64_t total = 0;        // the summary: the rows computed
  core::HostCopy landing;   // nothing to land: written at once
  int64_t ByteSize() const { return 1000; }
};

// A streaming compute call of the toy protocol: a header, then rows that each give one result,
// then a summary.
class ToyCall {
 public:
  using Request = ToyMessage;
  using Response = ToyResult;
  using First = ToyMessage;

  ToyCall(ServiceContext*, core::CallMode, CallHooks) {}
  absl::Status OnRequest(ToyMessage m, std::vector<ToyResult>* out) {
    std::lock_guard<std::mutex> lock(log_of_calls->mu);
    if (m.header) {
      ++log_of_calls->headers;
      begun_ = true;
      return absl::OkStatus();
    }
    log_of_calls->rows.push_back(m.row_offset);
    ++computed_;
    out->push_back(ToyResult{.row_offset = m.row_offset});
    return absl::OkStatus();
  }
  absl::Status OnClientDone(std::vector<ToyResult>* out) {
    out->push_back(ToyResult{.total = computed_});
    return absl::OkStatus();
  }
  void set_timings(const CallTimings&) {}
  bool begun() const { return begun_; }
  MemoryEstimate EstimateMemory(int64_t pipeline_bytes) const {
    return {.bytes = (1 << 20) + pipeline_bytes, .breakdown = "a toy call"};
  }
  void Admitted() {
    std::lock_guard<std::mutex> lock(log_of_calls->mu);
    ++log_of_calls->admitted;
  }
  absl::Status Decode(grpc::ByteBuffer*, ToyMessage*) { return absl::OkStatus(); }
  void Complete(const CallTimings&) const {
    std::lock_guard<std::mutex> lock(log_of_calls->mu);
    ++log_of_calls->completed;
  }
  static ToyMessage FromFirst(ToyMessage m) { return m; }
  static absl::StatusOr<int64_t> StripedRowOffset(const ToyMessage& m, const std::string& s) {
    if (m.header) return absl::InvalidArgumentError(s + " sent a second header");
    return m.row_offset;
  }
  static int64_t RowOffset(const ToyMessage& m) { return m.row_offset; }
  static bool ToEveryStream(const ToyResult& r) { return r.row_offset < 0; }

 private:
  bool begun_ = false;
  int64_t computed_ = 0;
};

using Pipeline = StreamPipeline<ToyCall>;

// One stream as a test drives it: reads are answered, writes taken, by the test.
// The pipeline calls it under its lock, from the compute pool's thread too; the test polls the
// atomics, and reads the rest once `finished` is set (after which the pipeline writes nothing).
class FakeStream : public StreamPort<ToyMessage, ToyResult> {
 public:
  void Read(ToyMessage* into) override { reading = into; }
  void Write(const ToyResult* r) override {
    written.push_back(*r);
    writing = true;
  }
  void Finish(const grpc::Status& s) override {
    status = s;
    finished = true;
  }
  bool IsCancelled() const override { return false; }

  std::atomic<ToyMessage*> reading = nullptr;
  std::atomic<bool> writing = false;
  std::atomic<bool> finished = false;
  grpc::Status status;
  std::vector<ToyResult> written;
};

class StreamPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override { log_of_calls = &log_; }
  void TearDown() override { log_of_calls = nullptr; }

  void Start(ServiceOptions options) {
    service_ = std::make_unique<ServiceContext>(&registry_, options);
  }
  std::shared_ptr<Pipeline> Open(int streams) {
    auto pipeline = std::make_shared<Pipeline>(service_.get(), core::CallMode::kFused, streams,
                                               streams > 1 ? "key" : "");
    streams_.clear();
    for (int i = 0; i < streams; ++i) streams_.push_back(std::make_unique<FakeStream>());
    return pipeline;
  }
  static auto Deadline() { return std::chrono::system_clock::now() + std::chrono::minutes(1); }

  // Waits (the compute pool runs the call) until `done` holds, taking every write meanwhile
  // unless `take_writes` is false.
  bool Pump(Pipeline& pipeline, const std::function<bool()>& done, bool take_writes = true) {
    for (int i = 0; i < 2000; ++i) {
      if (done()) return true;
      if (take_writes) {
        for (size_t s = 0; s < streams_.size(); ++s) {
          if (streams_[s]->writing) {
            streams_[s]->writing = false;
            pipeline.OnWriteDone(static_cast<int>(s), true);
          }
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return done();
  }
  // Stream `s` reads `message` (the read it asked for).
  bool Deliver(Pipeline& pipeline, int s, ToyMessage message) {
    if (!Pump(pipeline, [&] { return streams_[s]->reading != nullptr; })) return false;
    *streams_[s]->reading.exchange(nullptr) = message;
    pipeline.OnReadDone(s, true);
    return true;
  }
  bool End(Pipeline& pipeline, int s) {
    if (!Pump(pipeline, [&] { return streams_[s]->reading != nullptr; })) return false;
    streams_[s]->reading = nullptr;
    pipeline.OnReadDone(s, false);
    return true;
  }

  CallLog log_;
  HeadRegistry registry_;
  std::unique_ptr<ServiceContext> service_;
  std::vector<std::unique_ptr<FakeStream>> streams_;
};

TEST_F(StreamPipelineTest, StripedRowsAreMergedInRowOrderAndTheSummaryReachesEveryStream) {
  Start({});
  std::shared_ptr<Pipeline> pipeline = Open(2);
  pipeline->Attach(1, 2, core::CallMode::kFused, Deadline(), streams_[1].get(), ToyMessage{},
                   std::nullopt);
  pipeline->Attach(0, 2, core::CallMode::kFused, Deadline(), streams_[0].get(),
                   ToyMessage{.header = true}, std::nullopt);
  // Each stream's rows in increasing order, interleaved across the streams as they arrive.
  ASSERT_TRUE(Deliver(*pipeline, 1, {.row_offset = 10}));
  ASSERT_TRUE(Deliver(*pipeline, 1, {.row_offset = 30}));
  ASSERT_TRUE(Deliver(*pipeline, 0, {.row_offset = 0}));
  ASSERT_TRUE(Deliver(*pipeline, 0, {.row_offset = 20}));
  ASSERT_TRUE(End(*pipeline, 0));
  ASSERT_TRUE(End(*pipeline, 1));
  ASSERT_TRUE(Pump(*pipeline, [&] { return streams_[0]->finished && streams_[1]->finished; }));

  EXPECT_EQ(log_.headers, 1);
  EXPECT_EQ(log_.admitted, 1);
  EXPECT_EQ(log_.completed, 1);
  EXPECT_EQ(log_.rows, (std::vector<int64_t>{0, 10, 20, 30}));
  int results = 0;
  for (const auto& stream : streams_) {
    EXPECT_TRUE(stream->status.ok()) << stream->status.error_message();
    ASSERT_FALSE(stream->written.empty());
    EXPECT_EQ(stream->written.back().row_offset, -1);  // the summary, last on every stream
    EXPECT_EQ(stream->written.back().total, 4);
    results += static_cast<int>(stream->written.size()) - 1;
    EXPECT_GE(stream->written.size(), 2u);  // the results spread over both streams
  }
  EXPECT_EQ(results, 4);
}

TEST_F(StreamPipelineTest, NoRowIsReadBeforeTheCallIsAdmitted) {
  // A budget the toy call (1 MiB and its pipeline's buffers) can never fit: refused whole,
  // naming what the bytes were for, with no read asked for after the header.
  Start({.admission = {.memory_budget_bytes = 1 << 19}});
  std::shared_ptr<Pipeline> pipeline = Open(1);
  pipeline->Attach(0, 1, core::CallMode::kFused, Deadline(), streams_[0].get(),
                   ToyMessage{.header = true}, std::nullopt);
  ASSERT_TRUE(Pump(*pipeline, [&] { return streams_[0]->finished.load(); }));
  EXPECT_EQ(streams_[0]->status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(streams_[0]->status.error_message().find("a toy call"), std::string::npos)
      << streams_[0]->status.error_message();
  EXPECT_EQ(streams_[0]->reading, nullptr);
  EXPECT_EQ(log_.headers, 1);
  EXPECT_EQ(log_.admitted, 0);
  EXPECT_EQ(log_.completed, 0);
}

TEST_F(StreamPipelineTest, ResultsTheClientHasNotTakenHoldTheComputeBack) {
  // Room for two results of 1000 bytes: the third row waits until the client takes some.
  Start({.read_ahead_messages = 8, .max_pending_response_bytes = 2000});
  std::shared_ptr<Pipeline> pipeline = Open(1);
  pipeline->Attach(0, 1, core::CallMode::kFused, Deadline(), streams_[0].get(),
                   ToyMessage{.header = true}, std::nullopt);
  for (int64_t r = 0; r < 5; ++r) {
    ASSERT_TRUE(Pump(
        *pipeline, [&] { return streams_[0]->reading != nullptr; }, false));
    *streams_[0]->reading.exchange(nullptr) = ToyMessage{.row_offset = r};
    pipeline->OnReadDone(0, true);
  }
  auto computed = [&] {
    std::lock_guard<std::mutex> lock(log_.mu);
    return log_.rows.size();
  };
  ASSERT_TRUE(Pump(
      *pipeline, [&] { return computed() == 2; }, false));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(computed(), 2u);       // held back: two results wait, unwritten
  ASSERT_TRUE(End(*pipeline, 0));  // takes the writes: the rest computes
  ASSERT_TRUE(Pump(*pipeline, [&] { return streams_[0]->finished.load(); }));
  EXPECT_TRUE(streams_[0]->status.ok());
  EXPECT_EQ(log_.rows, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(streams_[0]->written.size(), 6u);
}

TEST_F(StreamPipelineTest, AFailureEndsEveryStreamAndCompletesNothing) {
  Start({});
  std::shared_ptr<Pipeline> pipeline = Open(2);
  pipeline->Attach(0, 2, core::CallMode::kFused, Deadline(), streams_[0].get(),
                   ToyMessage{.header = true}, std::nullopt);
  pipeline->Attach(1, 2, core::CallMode::kFused, Deadline(), streams_[1].get(), ToyMessage{},
                   std::nullopt);
  ASSERT_TRUE(Deliver(*pipeline, 0, {.row_offset = 0}));
  // A striped stream's second header: the call's StripedRowOffset refuses it.
  ASSERT_TRUE(Deliver(*pipeline, 1, {.header = true}));
  ASSERT_TRUE(Pump(*pipeline, [&] { return streams_[0]->finished && streams_[1]->finished; }));
  for (const auto& stream : streams_) {
    EXPECT_EQ(stream->status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(stream->status.error_message().find("stream 1 of 2 sent a second header"),
              std::string::npos)
        << stream->status.error_message();
  }
  EXPECT_EQ(log_.completed, 0);
}

}  // namespace
}  // namespace remotehead::server
