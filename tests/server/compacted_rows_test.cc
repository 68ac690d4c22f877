// Rows that contribute nothing do not reach the engine (server/src/step/row_compaction.h): for a
// function that declares it, a step that sends every row and one that sends only the rows whose
// target is not ignore_index give the same bits — loss, dX (zeros at the dropped rows), per-token
// outputs, extras, dW — in a fused step, a two-phase Forward + Backward, and a Backward by the
// Forward's retained inputs; the engine's errors name a bad row by its index in the request; a
// dropped row's values are not looked at; and a step without targets computes every row.
#include "server/service_fixture.h"

namespace remotehead {
namespace {

class CompactedRowsTest : public ServiceFixture {
 protected:
  void SetUp() override { StartService({}); }

  struct Call {
    Rpc rpc = Rpc::kForwardBackward;
    std::string function = "cross_entropy";
    v1::Reduction reduction = v1::REDUCTION_SUM;
    std::optional<double> normalizer;
    core::TokenBatch batch;
    torch::Tensor grad_output;  // a Backward with reduction NONE
    std::string trainer;        // accumulates dW under it when set
    int64_t micro_batch = 0;
    int64_t piece = 1 << 20;  // rows per message: one message by default
    double retain_seconds = 0;
    std::string handle;  // a Backward by a Forward's retained inputs: no inputs sent
  };

  StepOutcome Run(const Call& call) {
    const int64_t rows = call.handle.empty()
                             ? call.batch.rows()
                             : (call.grad_output.defined() ? call.grad_output.size(0) : rows_);
    grpc::ClientContext context;
    auto stream = call.rpc == Rpc::kForward    ? stub_->Forward(&context)
                  : call.rpc == Rpc::kBackward ? stub_->Backward(&context)
                                               : stub_->ForwardBackward(&context);
    v1::StepRequest header;
    v1::StepHeader* h = header.mutable_header();
    h->set_head_id("lm");
    h->mutable_function()->set_name(call.function);
    h->mutable_function()->set_reduction(call.reduction);
    if (call.normalizer) h->mutable_function()->set_normalizer(*call.normalizer);
    h->set_rows(rows);
    h->mutable_chunking()->set_chunk_rows(8);
    h->set_accumulate_weight_grad(!call.trainer.empty());
    if (!call.trainer.empty()) {
      h->mutable_gradient_id()->set_trainer(call.trainer);
      h->mutable_gradient_id()->set_micro_batch(call.micro_batch);
    }
    h->set_retain_inputs_seconds(call.retain_seconds);
    h->set_inputs_handle(call.handle);
    StepOutcome outcome;
    outcome.grad_hidden = torch::full({rows, kHidden}, NAN);
    outcome.outputs = torch::full({rows}, NAN);
    std::thread reader([&] {
      v1::StepResponse response;
      while (stream->Read(&response)) {
        if (response.has_grad_hidden() || response.has_outputs()) {
          const auto& chunk =
              response.has_grad_hidden() ? response.grad_hidden() : response.outputs();
          torch::Tensor values = *DecodeTensor(chunk.values(), "rows");
          (response.has_grad_hidden() ? outcome.grad_hidden : outcome.outputs)
              .narrow(0, chunk.row_offset(), values.size(0))
              .copy_(values);
        } else if (response.has_summary()) {
          outcome.summary = response.summary();
        }
      }
    });
    bool open = stream->Write(header);
    const bool sends_rows = call.handle.empty() || call.grad_output.defined();
    for (int64_t offset = 0; open && sends_rows && offset < rows; offset += call.piece) {
      const int64_t n = std::min(call.piece, rows - offset);
      v1::StepRequest m;
      v1::StepRows* r = m.mutable_rows();
      r->set_row_offset(offset);
      // The field is made only for a tensor that is sent (an empty one is refused).
      auto put = [&](const torch::Tensor& t, const std::function<v1::Tensor*()>& field) {
        if (t.defined()) {
          EXPECT_TRUE(EncodeTensor(t.narrow(0, offset, n), field()).ok());
        }
      };
      if (call.handle.empty()) {
        put(call.batch.hidden, [&] { return r->mutable_hidden(); });
        put(call.batch.targets, [&] { return r->mutable_targets(); });
        put(call.batch.weights, [&] { return r->mutable_weights(); });
        for (const auto& [name, t] : call.batch.aux) {
          const std::string& aux = name;
          put(t, [&] { return &(*r->mutable_aux())[aux]; });
        }
      }
      put(call.grad_output, [&] { return r->mutable_grad_output(); });
      open = stream->Write(m);
    }
    stream->WritesDone();
    reader.join();
    outcome.status = stream->Finish();
    return outcome;
  }

  void ZeroGradients() {
    grpc::ClientContext context;
    v1::HeadRef ref;
    ref.set_head_id("lm");
    v1::ZeroGradientsResponse response;
    ASSERT_TRUE(stub_->ZeroGradients(&context, ref, &response).ok());
  }

  // A batch of the test's rows with every third target ignored (and the fixture's ~20%).
  core::TokenBatch Masked(const std::string& function, core::Reduction reduction) {
    core::TokenBatch b =
        reference::MakeTestBatch(testing::HeadOf(*entry_), rows_, function, reduction);
    b.targets.index_put_({torch::arange(0, rows_, 3)}, -100);
    return b;
  }

  // dX / outputs of the rows sent, `sent` ([k] request rows), spread over the full rows.
  torch::Tensor Spread(const torch::Tensor& t, const torch::Tensor& sent) {
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[0] = rows_;
    return torch::zeros(sizes, t.options()).index_copy_(0, sent, t);
  }

  const int64_t rows_ = 45;
};

TEST_F(CompactedRowsTest, AFusedStepOfEveryRowEqualsOneOfTheContributingRowsBitForBit) {
  for (const v1::Reduction reduction :
       {v1::REDUCTION_SUM, v1::REDUCTION_MEAN, v1::REDUCTION_WEIGHTED_SUM}) {
    SCOPED_TRACE(v1::Reduction_Name(reduction));
    const core::TokenBatch all =
        Masked("grpo", reduction == v1::REDUCTION_WEIGHTED_SUM ? core::Reduction::kWeightedSum
                                                               : core::Reduction::kSum);
    const torch::Tensor keep = core::ContributingRows(all.targets, -100);
    Call call{.function = "grpo", .reduction = reduction, .normalizer = 17.0, .batch = all};
    call.trainer = "full";
    ZeroGradients();
    const StepOutcome full = Run(call);
    ASSERT_TRUE(full.status.ok()) << full.status.error_message();
    const torch::Tensor dw_full = HeadWeightGrad();

    call.batch = all.Select(keep);
    call.trainer = "compacted";
    ZeroGradients();
    const StepOutcome compacted = Run(call);
    ASSERT_TRUE(compacted.status.ok()) << compacted.status.error_message();
    EXPECT_EQ(full.summary.loss(), compacted.summary.loss());
    EXPECT_EQ(full.summary.valid_tokens(), compacted.summary.valid_tokens());
    EXPECT_EQ(full.summary.extras().at("clipped"), compacted.summary.extras().at("clipped"));
    EXPECT_TRUE(torch::equal(full.grad_hidden, Spread(compacted.grad_hidden, keep)));
    EXPECT_TRUE(torch::equal(HeadWeightGrad(), dw_full));
    // The dropped rows' dX is exactly 0.
    EXPECT_TRUE(full.grad_hidden.index({all.targets == -100}).eq(0).all().item<bool>());
  }
}

TEST_F(CompactedRowsTest, ATwoPhaseStepAndABackwardByHandleEqualTheCompactedOnes) {
  const core::TokenBatch all = Masked("token_logprobs", core::Reduction::kNone);
  const torch::Tensor keep = core::ContributingRows(all.targets, -100);
  const torch::Tensor dy = torch::linspace(-1, 1, rows_);
  Call forward{.rpc = Rpc::kForward,
               .function = "token_logprobs",
               .reduction = v1::REDUCTION_NONE,
               .batch = all,
               .retain_seconds = 60};
  const StepOutcome out_full = Run(forward);
  forward.batch = all.Select(keep);
  const StepOutcome out_kept = Run(forward);
  ASSERT_TRUE(out_full.status.ok() && out_kept.status.ok()) << out_full.status.error_message();
  EXPECT_TRUE(torch::equal(out_full.outputs, Spread(out_kept.outputs, keep)));

  // By handle: the full Forward's retained rows take dL/dy of every row, the compacted one's
  // only the kept rows'; the same dX and dW either way, and as a Backward that re-sends X.
  std::vector<torch::Tensor> dx, dw;
  for (int i = 0; i < 3; ++i) {
    ZeroGradients();
    Call backward{.rpc = Rpc::kBackward,
                  .function = "token_logprobs",
                  .reduction = v1::REDUCTION_NONE,
                  .trainer = "run",
                  .micro_batch = i,
                  .piece = 7};
    if (i == 0) {
      backward.handle = out_full.summary.inputs_handle();
      backward.grad_output = dy;
    } else if (i == 1) {
      backward.handle = out_kept.summary.inputs_handle();
      backward.grad_output = dy.index_select(0, keep);
    } else {
      backward.batch = all;
      backward.grad_output = dy;
    }
    const StepOutcome b = Run(backward);
    ASSERT_TRUE(b.status.ok()) << i << ": " << b.status.error_message();
    dx.push_back(i == 1 ? Spread(b.grad_hidden, keep) : b.grad_hidden);
    dw.push_back(HeadWeightGrad());
  }
  // Rows in messages of 7: batches follow arrival, so float rounding may differ between
  // sends; values agree, and the dropped rows are exactly 0.
  for (int i = 1; i < 3; ++i) {
    EXPECT_LE(reference::RelativeError(dx[i], dx[0]), 1e-6) << i;
    EXPECT_LE(reference::RelativeError(dw[i], dw[0]), 1e-6) << i;
  }
  EXPECT_TRUE(dx[0].index({all.targets == -100}).eq(0).all().item<bool>());
}

TEST_F(CompactedRowsTest, ErrorsNameTheRequestRowAndDroppedRowsAreNotLookedAt) {
  core::TokenBatch all = Masked("cross_entropy", core::Reduction::kSum);
  all.hidden[3][1] = NAN;  // row 3 is ignored: dropped unseen
  StepOutcome r = Run({.batch = all});
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  all.targets[37] = 5;  // a contributing row after a dozen dropped ones
  all.hidden[37][1] = NAN;
  r = Run({.batch = all});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "hidden[37]: expected finite values; got NaN or Inf");
}

TEST_F(CompactedRowsTest, AFunctionThatTakesNoTargetsComputesEveryRow) {
  core::TokenBatch all = Masked("cross_entropy", core::Reduction::kSum);
  all.targets = torch::Tensor();
  const StepOutcome r = Run({.rpc = Rpc::kForward,
                             .function = "sigmoid_sum",
                             .reduction = v1::REDUCTION_NONE,
                             .batch = all});
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(r.outputs.gt(0).all().item<bool>());
}

}  // namespace
}  // namespace remotehead
