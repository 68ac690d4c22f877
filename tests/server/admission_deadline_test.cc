// The service under load and time limits: requests over the memory budget, beyond the queue
// limit, waiting in the queue, and running past their deadline. Every refused or stopped
// request leaves the head's gradients bit-identical and gives its admission back.
#include "server/service_fixture.h"

namespace remotehead {
namespace {

class AdmissionDeadlineTest : public ServiceFixture {
 protected:
  // A ForwardBackward that has sent its header and first rows and is running (admitted: its rows
  // wait for the rest of their batch, which is cut at fixed rows): it holds its admission until
  // Complete() sends the rest.
  class OpenStep {
   public:
    OpenStep(AdmissionDeadlineTest* service, v1::HeadService::Stub* stub,
             const core::TokenBatch& batch, const std::string& trainer)
        : batch_(batch), stream_(stub->ForwardBackward(&context_)) {
      v1::StepRequest header;
      v1::StepHeader* h = header.mutable_header();
      h->set_head_id("lm");
      h->set_rows(kRows);
      h->set_valid_tokens((batch.targets != -100).sum().item<int64_t>());
      h->set_accumulate_weight_grad(true);
      h->mutable_gradient_id()->set_trainer(trainer);
      EXPECT_TRUE(stream_->Write(header));
      EXPECT_TRUE(stream_->Write(Rows(0, 10)));
      for (int i = 0; i < 500 && service->service().admission().Stats().active == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_EQ(service->service().admission().Stats().active, 1);  // running
    }

    grpc::Status Complete() {
      EXPECT_TRUE(stream_->Write(Rows(10, kRows - 10)));
      stream_->WritesDone();
      v1::StepResponse response;
      while (stream_->Read(&response)) {
      }
      return stream_->Finish();
    }

   private:
    v1::StepRequest Rows(int64_t offset, int64_t n) {
      v1::StepRequest m;
      m.mutable_rows()->set_row_offset(offset);
      EXPECT_TRUE(
          EncodeTensor(batch_.hidden.narrow(0, offset, n), m.mutable_rows()->mutable_hidden())
              .ok());
      EXPECT_TRUE(
          EncodeTensor(batch_.targets.narrow(0, offset, n), m.mutable_rows()->mutable_targets())
              .ok());
      return m;
    }

    const core::TokenBatch& batch_;
    grpc::ClientContext context_;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream_;
  };
};

TEST_F(AdmissionDeadlineTest, RequestOverTheMemoryBudgetIsRefusedAndChangesNothing) {
  // Between what this step needs without a weight gradient (core's estimate of one engine call
  // plus the rows in flight) and with one (its scratch dW besides).
  const int64_t without_dw =
      EngineBytes("cross_entropy", core::Reduction::kMean, core::CallMode::kFused) + kPipelineBytes;
  const int64_t budget = kHeadBytes + without_dw + kScratchBytes / 2;
  StartService({.admission = {.memory_budget_bytes = budget}});
  const torch::Tensor before = HeadWeightGrad();
  const StepOutcome refused = Step("run/rank-0", 0);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StartsWith(
      refused.status.error_message(),
      absl::StrCat(
          "admission: expected a request within the server's memory budget of ",
          static_cast<double>(budget) / (1 << 20), " MiB (--memory_budget_bytes) less the ",
          static_cast<double>(kHeadBytes) / (1 << 20), " MiB its heads hold; got one needing ",
          static_cast<double>(without_dw + kScratchBytes) / (1 << 20), " MiB")))
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("scratch dW"), std::string::npos);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
  ExpectAdmissionDrains();

  // Without a weight gradient the same step fits.
  const StepOutcome fits = Step("run/rank-0", 0, 17, [](v1::StepRequest& m) {
    if (m.has_header()) m.mutable_header()->set_accumulate_weight_grad(false);
  });
  EXPECT_TRUE(fits.status.ok()) << fits.status.error_message();
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
}

TEST_F(AdmissionDeadlineTest, FullQueueIsRefusedWhileARequestRunsThenServingGoesOn) {
  StartService({.admission = {.max_active = 1, .max_queued = 0}});
  core::GradientBuffers expected = testing::HeadOf(*entry_).NewGradientBuffers();
  ASSERT_TRUE(core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, &expected).ok());
  ASSERT_TRUE(core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, &expected).ok());

  auto running = std::make_unique<OpenStep>(this, stub_.get(), batch_, "run/rank-0");
  const StepOutcome refused = Step("run/rank-1", 0);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StartsWith(refused.status.error_message(),
                               "admission: expected at most 0 queued requests "
                               "(--max_queued_requests); got one more while 1 run"))
      << refused.status.error_message();
  EXPECT_TRUE(running->Complete().ok());
  running.reset();
  const StepOutcome after = Step("run/rank-2", 0);
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  // rank-0 and rank-2 were added, the refused rank-1 was not.
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), expected.weight), 1e-5);
  ExpectAdmissionDrains();
}

TEST_F(AdmissionDeadlineTest, QueuedRequestRunsOnceCapacityFreesAndReportsItsWait) {
  StartService({.admission = {.max_active = 1, .max_queued = 4}});
  auto running = std::make_unique<OpenStep>(this, stub_.get(), batch_, "run/rank-0");
  StepOutcome queued;
  std::thread waiter([&] { queued = Step("run/rank-1", 0); });
  for (int i = 0; i < 500 && service().admission().Stats().queued == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(service().admission().Stats().queued, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(running->Complete().ok());
  waiter.join();
  ASSERT_TRUE(queued.status.ok()) << queued.status.error_message();
  EXPECT_GE(queued.summary.timings().queue_seconds(), 0.15);
  EXPECT_GT(queued.summary.timings().compute_seconds(), 0.0);
  EXPECT_GE(queued.summary.timings().total_seconds(), queued.summary.timings().queue_seconds());
  ExpectAdmissionDrains();
}

TEST_F(AdmissionDeadlineTest, DeadlineExpiringMidRequestStopsItAndChangesNothing) {
  StartService({});
  const torch::Tensor before = HeadWeightGrad();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  auto stream = stub_->ForwardBackward(&context);
  ASSERT_TRUE(stream->Write(AccumulatingHeader("run/rank-5")));
  // The rest of the rows never come: the deadline passes while the server waits for them.
  v1::StepResponse response;
  while (stream->Read(&response)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectAdmissionDrains();
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
  EXPECT_TRUE(entry_->Describe().accumulated_micro_batches == 0);
}

// A request whose deadline passes while it computes stops between engine chunks: the server
// is free again long before the whole computation could have finished.
TEST_F(AdmissionDeadlineTest, DeadlineStopsALongComputationBetweenChunks) {
  StartService({});
  grpc::ClientContext create_context;
  v1::CreateHeadRequest create;
  create.set_head_id("big");
  create.mutable_init()->set_vocab_size(16000);
  create.mutable_init()->set_hidden_size(256);
  v1::HeadInfo info;
  ASSERT_TRUE(stub_->CreateHead(&create_context, create, &info).ok());
  auto big = *registry().Get("big");
  constexpr int64_t kBigRows = 2048;
  const core::TokenBatch batch = reference::MakeTestBatch(testing::HeadOf(*big), kBigRows,
                                                          "cross_entropy", core::Reduction::kSum);
  // The whole computation, timed in-process in this run.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(core::FusedForwardBackward(testing::HeadOf(*big), batch,
                                         {.reduction = core::Reduction::kSum, .chunk_rows = 32},
                                         nullptr)
                  .ok());
  const auto full = std::chrono::steady_clock::now() - t0;

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + full / 10);
  auto stream = stub_->ForwardBackward(&context);
  v1::StepRequest header;
  header.mutable_header()->set_head_id("big");
  header.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_SUM);
  header.mutable_header()->mutable_chunking()->set_chunk_rows(32);
  header.mutable_header()->set_rows(kBigRows);
  header.mutable_header()->set_accumulate_weight_grad(true);
  header.mutable_header()->mutable_gradient_id()->set_trainer("run/rank-6");
  v1::StepRequest rows;
  rows.mutable_rows()->set_row_offset(0);
  ASSERT_TRUE(EncodeTensor(batch.hidden, rows.mutable_rows()->mutable_hidden()).ok());
  ASSERT_TRUE(EncodeTensor(batch.targets, rows.mutable_rows()->mutable_targets()).ok());
  const auto sent = std::chrono::steady_clock::now();
  stream->Write(header);
  stream->Write(rows);  // one message: the engine must stop inside it
  stream->WritesDone();
  v1::StepResponse response;
  while (stream->Read(&response)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectAdmissionDrains();
  const auto stopped = std::chrono::steady_clock::now() - sent;
  EXPECT_LT(stopped, full * 0.6) << "the computation ran on after the deadline";
  EXPECT_EQ(reference::MaxAbs(testing::HeadOf(*big).grads().weight), 0.0);
  EXPECT_TRUE(big->Describe().accumulated_micro_batches == 0);
}

}  // namespace
}  // namespace remotehead
