// Where a step's time goes (core/step_phases.h, StepOptions::phases): the engine marks every
// phase of a call, in order and never nested — the input checks and the results' reads on the
// host (host_sync) around the chunks' logits GEMM, function blocks, dX and dW GEMMs — which is
// what remotehead-bench sums per phase; without a recorder nothing is marked.
#include "remotehead/core/step_phases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/reference.h"
#include "remotehead/core/engine.h"

// Its own namespace: the file is compiled in one unit with the target's other files
// (cmake/RemoteheadUnity.cmake).
namespace remotehead::step_phases_test {
namespace {

// Every Begin and End, as "+name" / "-name".
class Trace : public core::StepPhaseRecorder {
 public:
  void Begin(core::StepPhase phase) override { events.push_back("+" + Name(phase)); }
  void End(core::StepPhase phase) override { events.push_back("-" + Name(phase)); }
  std::vector<std::string> events;

 private:
  static std::string Name(core::StepPhase phase) {
    return std::string(core::kStepPhaseNames[static_cast<size_t>(phase)]);
  }
};

TEST(StepPhases, EveryPhaseOfAFusedStepIsMarkedInOrderAndNeverNested) {
  auto head = reference::MakeTestHead(53, 16, torch::kFloat, /*bias=*/true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 20, "cross_entropy", core::Reduction::kMean);
  Trace trace;
  core::StepOptions options{.chunk_rows = 8};
  options.phases = &trace;
  core::GradientBuffers grads = head->NewGradientBuffers();
  auto result = core::FusedForwardBackward(*head, batch, options, &grads);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->stats.num_chunks, 3);

  std::vector<std::string> chunk = {"+logits_gemm", "-logits_gemm", "+function", "-function",
                                    "+dx_gemm",     "-dx_gemm",     "+dw_gemm",  "-dw_gemm"};
  // The input checks, three chunks, then the loss and the statistics read back.
  std::vector<std::string> expected = {"+host_sync", "-host_sync"};
  for (int i = 0; i < 3; ++i) expected.insert(expected.end(), chunk.begin(), chunk.end());
  for (int i = 0; i < 2; ++i) expected.insert(expected.end(), {"+host_sync", "-host_sync"});
  EXPECT_EQ(trace.events, expected);
}

// StepOptions::loss_on_device (a server summing a request's batches): the loss is not read back —
// one host_sync fewer — and FusedResult::loss_value is the default call's loss, bit for bit.
TEST(StepPhases, WithTheLossOnTheDeviceTheLossIsNotReadBack) {
  auto head = reference::MakeTestHead(53, 16, torch::kFloat, /*bias=*/true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 20, "cross_entropy", core::Reduction::kMean);
  auto syncs = [](const Trace& trace) {
    return std::count(trace.events.begin(), trace.events.end(), "+host_sync");
  };
  Trace read_back, kept;
  core::StepOptions options{.chunk_rows = 8};
  options.phases = &read_back;
  auto loss_read = core::FusedForwardBackward(*head, batch, options, nullptr);
  options.phases = &kept;
  options.loss_on_device = true;
  auto loss_kept = core::FusedForwardBackward(*head, batch, options, nullptr);
  ASSERT_TRUE(loss_read.ok() && loss_kept.ok());
  EXPECT_EQ(syncs(kept), syncs(read_back) - 1);
  EXPECT_EQ(loss_kept->loss, 0.0);
  EXPECT_NE(loss_read->loss, 0.0);
  ASSERT_EQ(loss_kept->loss_value.dim(), 0);
  EXPECT_EQ(loss_kept->loss_value.scalar_type(), torch::kDouble);
  EXPECT_EQ(loss_kept->loss_value.device(), head->device());
  EXPECT_EQ(loss_kept->loss_value.item<double>(), loss_read->loss);
  EXPECT_EQ(loss_read->loss_value.item<double>(), loss_read->loss);
  EXPECT_TRUE(torch::equal(loss_kept->grad_hidden, loss_read->grad_hidden));
}

TEST(StepPhases, AForwardMarksNoBackwardPhase) {
  auto head = reference::MakeTestHead(53, 16, torch::kFloat, /*bias=*/false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 20, "cross_entropy", core::Reduction::kNone);
  Trace trace;
  core::StepOptions options{.reduction = core::Reduction::kNone, .chunk_rows = 20};
  options.phases = &trace;
  ASSERT_TRUE(core::Forward(*head, batch, options).ok());
  const std::vector<std::string> expected = {"+host_sync",   "-host_sync", "+logits_gemm",
                                             "-logits_gemm", "+function",  "-function",
                                             "+host_sync",   "-host_sync"};
  EXPECT_EQ(trace.events, expected);
}

}  // namespace
}  // namespace remotehead::step_phases_test
