// StepOptions::should_stop: every entry point asks it before each chunk and, once it says
// stop, returns CANCELLED without computing another chunk. This is what lets the server end a
// cancelled or expired request within one chunk.
#include <gtest/gtest.h>

#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

constexpr int64_t kRows = 40;
constexpr int64_t kChunk = 8;  // 5 chunks

class Cancellation : public ::testing::Test {
 protected:
  void SetUp() override {
    head_ = reference::MakeTestHead(64, 16, torch::kFloat, /*bias=*/false);
    batch_ = reference::MakeTestBatch(*head_, kRows, "cross_entropy", core::Reduction::kSum);
    options_ = {.reduction = core::Reduction::kSum, .chunk_rows = kChunk};
  }

  // Stops once `allowed` chunks have started; counts the questions.
  void StopAfter(int allowed) {
    options_.should_stop = [this, allowed] { return asked_++ >= allowed; };
  }

  void ExpectCancelledAfter(const absl::Status& status, int allowed) {
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(status.message(),
              "cancelled: the request was cancelled or its deadline expired; stopped between "
              "chunks");
    EXPECT_EQ(asked_, allowed + 1) << "asked once per chunk, and no chunk after the stop";
  }

  std::unique_ptr<core::Head> head_;
  core::TokenBatch batch_;
  core::StepOptions options_;
  int asked_ = 0;
};

TEST_F(Cancellation, NeverStoppingAsksOncePerChunk) {
  options_.should_stop = [this] { return ++asked_ < 0; };
  ASSERT_TRUE(core::FusedForwardBackward(*head_, batch_, options_, nullptr).ok());
  EXPECT_EQ(asked_, kRows / kChunk);
}

TEST_F(Cancellation, FusedStopsBetweenChunks) {
  StopAfter(2);
  ExpectCancelledAfter(core::FusedForwardBackward(*head_, batch_, options_, nullptr).status(), 2);
}

TEST_F(Cancellation, ForwardStopsBeforeTheFirstChunk) {
  StopAfter(0);
  ExpectCancelledAfter(core::Forward(*head_, batch_, options_).status(), 0);
}

TEST_F(Cancellation, BackwardStopsBetweenChunks) {
  StopAfter(3);
  ExpectCancelledAfter(
      core::Backward(*head_, batch_, options_, torch::ones({}, torch::kDouble), nullptr).status(),
      3);
}

}  // namespace
}  // namespace remotehead
