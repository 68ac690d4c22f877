// Every RPC is bounded before it allocates: a head too large is INVALID_ARGUMENT (beyond the
// size limits) or RESOURCE_EXHAUSTED (beyond the memory budget) naming vocab_size / hidden_size
// and the numbers — never INTERNAL from an allocator; heads count against the budget that
// admission uses; sizes from the wire that would overflow a byte count are refused; retained
// inputs expire on time without another request.
#include "server/service_fixture.h"

namespace remotehead {
namespace {

class ResourceLimitsTest : public ServiceFixture {
 protected:
  void SetUp() override { StartService({.admission = {.memory_budget_bytes = 64 << 20}}); }

  grpc::Status Create(const std::string& id, int64_t vocab, int64_t hidden) {
    v1::CreateHeadRequest create;
    create.set_head_id(id);
    create.mutable_init()->set_vocab_size(vocab);
    create.mutable_init()->set_hidden_size(hidden);
    grpc::ClientContext context;
    v1::HeadInfo info;
    return stub_->CreateHead(&context, create, &info);
  }

  grpc::Status OptimizerStep(const std::string& id,
                             const std::function<void(v1::OptimizerStepRequest&)>& set,
                             v1::OptimizerStepResponse* response = nullptr) {
    grpc::ClientContext context;
    v1::OptimizerStepRequest request;
    request.set_head_id(id);
    set(request);
    v1::OptimizerStepResponse ignored;
    return stub_->OptimizerStep(&context, request, response != nullptr ? response : &ignored);
  }
  static void SgdWithMomentum(v1::OptimizerStepRequest& r) {
    r.mutable_sgd()->set_lr(0.1);
    r.mutable_sgd()->set_momentum(0.9);
  }

  int64_t HeadBytes() { return service().admission().Stats().head_bytes; }
};

TEST_F(ResourceLimitsTest, HeadsBeyondTheSizeLimitsAreRefusedNamingTheField) {
  struct Case {
    int64_t vocab, hidden;
    std::string message;
  };
  const std::vector<Case> cases = {
      {int64_t{1} << 40, 8, "init.vocab_size: expected at most 16777216; got 1099511627776"},
      {8, int64_t{1} << 31, "init.hidden_size: expected at most 262144; got 2147483648"},
      {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max(),
       "init.vocab_size: expected at most 16777216; got 9223372036854775807"},
      {0, 4, "init.vocab_size, init.hidden_size: expected >= 1; got 0, 4"},
      {-5, 4, "init.vocab_size, init.hidden_size: expected >= 1; got -5, 4"},
  };
  for (const Case& c : cases) {
    const grpc::Status status = Create("big", c.vocab, c.hidden);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_EQ(status.error_message(), c.message);
  }
  EXPECT_FALSE(registry().Get("big").ok());
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes);
}

TEST_F(ResourceLimitsTest, AHeadBeyondTheBudgetIsResourceExhaustedBeforeAllocating) {
  // 16M × 256K float32 would be 32 TiB of weights: refused by the budget, not by an allocator.
  const grpc::Status status = Create("huge", int64_t{1} << 24, int64_t{1} << 18);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("init.vocab_size 16777216 × init.hidden_size 262144"),
            std::string::npos)
      << status.error_message();
  EXPECT_NE(status.error_message().find("--memory_budget_bytes"), std::string::npos);
  EXPECT_FALSE(registry().Get("huge").ok());
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes);
}

TEST_F(ResourceLimitsTest, UploadHeadersAreCheckedBeforeTheBufferIsAllocated) {
  struct Case {
    int64_t vocab, hidden;
    grpc::StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {int64_t{1} << 40, 8, grpc::StatusCode::INVALID_ARGUMENT,
       "header.vocab_size: expected at most 16777216; got 1099511627776"},
      {8, -1, grpc::StatusCode::INVALID_ARGUMENT,
       "header.vocab_size, header.hidden_size: expected >= 1; got 8, -1"},
      {int64_t{1} << 24, int64_t{1} << 18, grpc::StatusCode::RESOURCE_EXHAUSTED,
       "header.vocab_size 16777216 × header.hidden_size 262144"},
  };
  for (const Case& c : cases) {
    grpc::ClientContext context;
    v1::HeadInfo info;
    auto writer = stub_->UploadHead(&context, &info);
    v1::UploadHeadRequest header;
    header.mutable_header()->set_head_id("up");
    header.mutable_header()->set_vocab_size(c.vocab);
    header.mutable_header()->set_hidden_size(c.hidden);
    header.mutable_header()->set_dtype(v1::DTYPE_FLOAT32);
    writer->Write(header);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_NE(status.error_message().find(c.needle), std::string::npos) << status.error_message();
  }
  ExpectAdmissionDrains();  // no upload buffer stays reserved
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes);
}

TEST_F(ResourceLimitsTest, HeadsHoldTheirBytesInTheBudgetUntilDropped) {
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes);
  ASSERT_TRUE(Create("second", 1000, 64).ok());
  const int64_t second = 2 * 1000 * 64 * 4;
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes + second);
  // An upload reserves its head too (and a replace does not reserve it twice).
  const torch::Tensor w = torch::randn({100, 16});
  ASSERT_TRUE(Upload("third", w, {}).ok());
  ASSERT_TRUE(Upload("third", w * 2, {}, /*replace=*/true).ok());
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes + second + 2 * 100 * 16 * 4);
  for (const std::string id : {"second", "third", "lm"}) ASSERT_TRUE(Drop(id).ok());
  EXPECT_EQ(service().admission().Stats().head_bytes, 0);
  ExpectAdmissionDrains();
}

TEST_F(ResourceLimitsTest, OptimizerStateIsReservedBeforeTheStepThatCreatesIt) {
  // [1024, 4096] float32: W and dW take 32 MiB of the 64 MiB budget; AdamW's two moments would
  // take 32 MiB more, SGD's momentum 16 MiB.
  constexpr int64_t kWeights = 1024 * 4096 * 4;
  ASSERT_TRUE(Create("big", 1024, 4096).ok());
  EXPECT_EQ(HeadBytes(), kHeadBytes + 2 * kWeights);

  // A bad step is refused for what is wrong with it, not for memory.
  grpc::Status status = OptimizerStep("big", [](auto& r) {
    r.mutable_adamw()->set_lr(0.1);
    r.mutable_adamw()->set_weight_decay(-1);
  });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(status.error_message(),
            "adamw.weight_decay: expected a finite value in [0, inf); got -1");

  status = OptimizerStep("big", [](auto& r) { r.mutable_adamw()->set_lr(0.1); });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find(
                "32 MiB more (adamw optimizer state (float32 exp_avg and exp_avg_sq for every "
                "parameter) of head \"big\")"),
            std::string::npos)
      << status.error_message();
  EXPECT_EQ(registry().Get("big").value()->Describe().weight_version, 0);  // nothing changed
  EXPECT_EQ(HeadBytes(), kHeadBytes + 2 * kWeights);

  v1::OptimizerStepResponse stepped;
  ASSERT_TRUE(OptimizerStep("big", SgdWithMomentum, &stepped).ok());
  EXPECT_EQ(stepped.info().weight_version(), 1);
  EXPECT_EQ(HeadBytes(), kHeadBytes + 3 * kWeights);
  ASSERT_TRUE(OptimizerStep("big", SgdWithMomentum).ok());  // the momentum exists: nothing more
  EXPECT_EQ(HeadBytes(), kHeadBytes + 3 * kWeights);

  ASSERT_TRUE(Drop("big").ok());  // the state goes with the head
  EXPECT_EQ(HeadBytes(), kHeadBytes);
}

TEST_F(ResourceLimitsTest, ReplacingTheWeightsGivesTheOptimizerStateBack) {
  constexpr int64_t kWeights = 512 * 1024 * 4;
  ASSERT_TRUE(Create("mid", 512, 1024).ok());
  ASSERT_TRUE(OptimizerStep("mid", SgdWithMomentum).ok());
  EXPECT_EQ(HeadBytes(), kHeadBytes + 3 * kWeights);

  // A new trajectory: the momentum of the old one is reset, and its bytes are free again.
  ASSERT_TRUE(Upload("mid", torch::zeros({512, 1024}), {}, /*replace=*/true).ok());
  EXPECT_EQ(HeadBytes(), kHeadBytes + 2 * kWeights);
  ASSERT_TRUE(OptimizerStep("mid", SgdWithMomentum).ok());
  EXPECT_EQ(HeadBytes(), kHeadBytes + 3 * kWeights);
  ASSERT_TRUE(Drop("mid").ok());
  EXPECT_EQ(HeadBytes(), kHeadBytes);
}

// A budget that fits the step beside the head only while the second head is absent.
class HeadsShareTheBudgetTest : public ServiceFixture {
 protected:
  static constexpr int64_t kSecondHead = 2 * 200 * 32 * 4;
  void SetUp() override {
    const int64_t step =
        EngineBytes("cross_entropy", core::Reduction::kMean, core::CallMode::kFused) +
        kPipelineBytes + kScratchBytes;
    StartService({.admission = {.memory_budget_bytes = kHeadBytes + step + kSecondHead / 2}});
  }
};

TEST_F(HeadsShareTheBudgetTest, AStepIsAdmittedOnlyBesideTheHeads) {
  ASSERT_TRUE(Step("run/rank-0", 0).status.ok());
  v1::CreateHeadRequest create;
  create.set_head_id("second");
  create.mutable_init()->set_vocab_size(200);
  create.mutable_init()->set_hidden_size(32);
  grpc::ClientContext context;
  v1::HeadInfo info;
  // The second head fits the budget on its own, but then the same step no longer does.
  ASSERT_TRUE(stub_->CreateHead(&context, create, &info).ok());
  const StepOutcome refused = Step("run/rank-0", 1);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.status.error_message().find("its heads hold"), std::string::npos)
      << refused.status.error_message();
  ASSERT_TRUE(Drop("second").ok());
  EXPECT_TRUE(Step("run/rank-0", 1).status.ok());
}

TEST_F(ResourceLimitsTest, RowCountsThatWouldOverflowAByteCountAreRefused) {
  for (const int64_t rows : {std::numeric_limits<int64_t>::max(), int64_t{1} << 60}) {
    const StepOutcome outcome = Step("run/rank-0", 0, 17, [rows](v1::StepRequest& m) {
      if (m.has_header()) m.mutable_header()->set_rows(rows);
    });
    EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StartsWith(outcome.status.error_message(), "header.rows: expected at most "))
        << outcome.status.error_message();
    EXPECT_NE(outcome.status.error_message().find(absl::StrCat("got ", rows)), std::string::npos);
  }
  ExpectAdmissionDrains();
}

TEST_F(ResourceLimitsTest, RetainedInputsExpireOnTimeWithoutAnotherRequest) {
  const StepOutcome forward = Step(
      "", 0, 17,
      [](v1::StepRequest& m) {
        if (m.has_header()) m.mutable_header()->set_retain_inputs_seconds(2);
      },
      Rpc::kForward);
  ASSERT_TRUE(forward.status.ok()) << forward.status.error_message();
  EXPECT_GT(service().admission().Stats().bytes_in_use, 0);
  // No request touches the store: only its sweeper can free the reservation.
  ExpectAdmissionDrains();
}

}  // namespace
}  // namespace remotehead
