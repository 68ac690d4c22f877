// The HeadService over a real gRPC channel (in-process server on a loopback port), with its
// heads on every device (the CPU, and CUDA when the machine has a GPU): head lifecycle,
// ForwardBackward parity with the direct engine call, exactly-once accumulation on replay, and bad
// input / cancellation leaving the head's gradients bit-identical. (Files: file_rpcs_test.)
#include "absl/strings/str_join.h"
#include "server/service_fixture.h"
#include "support/devices.h"

namespace remotehead {
namespace {

class HeadServiceTest : public ServiceFixture, public ::testing::WithParamInterface<std::string> {
 protected:
  // Small streamed chunks, so every tensor that comes back travels in several messages.
  void SetUp() override {
    REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device_);
    StartService({.device = device_, .response_chunk_bytes = 1024});
  }

  const torch::Device device_{GetParam()};
};

// Tensors compared bit for bit wherever they live (the server's on its device, decoded on the CPU).
bool EqualOnCpu(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::equal(a.cpu(), b.cpu());
}

TEST_P(HeadServiceTest, LifecycleDescribeListDrop) {
  grpc::ClientContext c1;
  v1::HeadRef ref;
  ref.set_head_id("lm");
  v1::HeadInfo info;
  ASSERT_TRUE(stub_->DescribeHead(&c1, ref, &info).ok());
  EXPECT_EQ(info.vocab_size(), kVocab);
  EXPECT_EQ(info.hidden_size(), kHidden);
  EXPECT_EQ(info.dtype(), v1::DTYPE_FLOAT32);
  EXPECT_TRUE(info.has_bias());
  EXPECT_EQ(info.device(), device_.str());

  grpc::ClientContext c2;
  v1::CreateHeadRequest again;
  again.set_head_id("lm");
  again.mutable_init()->set_vocab_size(10);
  again.mutable_init()->set_hidden_size(4);
  const grpc::Status dup = stub_->CreateHead(&c2, again, &info);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(dup.error_message(), "head_id: expected a new id; got \"lm\", which already exists");

  grpc::ClientContext c3;
  v1::ListHeadsResponse list;
  ASSERT_TRUE(stub_->ListHeads(&c3, {}, &list).ok());
  ASSERT_EQ(list.heads_size(), 1);

  grpc::ClientContext c4;
  v1::DropHeadResponse dropped;
  ASSERT_TRUE(stub_->DropHead(&c4, ref, &dropped).ok());
  grpc::ClientContext c5;
  const grpc::Status missing = stub_->DescribeHead(&c5, ref, &info);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(
      missing.error_message(),
      "head_id: expected the id of a head on this server; got \"lm\", which it does not have");
}

TEST_P(HeadServiceTest, ForwardBackwardMatchesTheEngineAndReplayAddsOnce) {
  core::GradientBuffers expected = testing::HeadOf(*entry_).NewGradientBuffers();
  auto direct = core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, &expected);
  ASSERT_TRUE(direct.ok());

  const StepOutcome first = Step("run/rank-0", 0);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_LE(reference::RelativeError(first.summary.loss(), direct->loss), 1e-6);
  EXPECT_FALSE(first.summary.replayed());
  EXPECT_LE(reference::RelativeError(first.grad_hidden, direct->grad_hidden), 1e-5);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), expected.weight), 1e-5);

  // A retry with the same gradient id: same answer, nothing added.
  const torch::Tensor after_first = HeadWeightGrad();
  const StepOutcome replay = Step("run/rank-0", 0, /*piece=*/50);
  ASSERT_TRUE(replay.status.ok()) << replay.status.error_message();
  EXPECT_TRUE(replay.summary.replayed());
  EXPECT_LE(reference::RelativeError(replay.summary.loss(), first.summary.loss()), 1e-6);
  EXPECT_TRUE(EqualOnCpu(HeadWeightGrad(), after_first));

  // Another micro-batch id is a new contribution.
  ASSERT_TRUE(Step("run/rank-0", 1).status.ok());
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), 2 * expected.weight), 1e-5);
}

TEST_P(HeadServiceTest, FetchGradientsStreamsTheAccumulatedDwInTheRequestedDtype) {
  ASSERT_TRUE(Step("run/rank-0", 0).status.ok());
  const torch::Tensor expected = HeadWeightGrad();
  for (const v1::DType dtype : {v1::DTYPE_UNSPECIFIED, v1::DTYPE_BFLOAT16}) {
    grpc::ClientContext context;
    v1::FetchGradientsRequest request;
    request.set_head_id("lm");
    request.set_dtype(dtype);
    auto reader = stub_->FetchGradients(&context, request);
    torch::Tensor dw = torch::full({kVocab, kHidden}, NAN);
    v1::FetchGradientsResponse response;
    int messages = 0;
    bool saw_bias = false, saw_info = false;
    while (reader->Read(&response)) {
      ++messages;
      if (response.has_weight_grad_rows()) {
        torch::Tensor rows = *DecodeTensor(response.weight_grad_rows().values(), "dw");
        EXPECT_EQ(rows.scalar_type(),
                  dtype == v1::DTYPE_BFLOAT16 ? torch::kBFloat16 : torch::kFloat);
        dw.narrow(0, response.weight_grad_rows().row_offset(), rows.size(0)).copy_(rows);
      }
      saw_bias |= response.has_bias_grad_rows();
      if (response.has_info()) {
        saw_info = true;
        EXPECT_EQ(response.info().accumulated_micro_batches(), 1);
      }
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_TRUE(saw_bias && saw_info);
    EXPECT_GT(messages, 10) << "1 KiB chunks of a 300 x 32 gradient";
    if (dtype == v1::DTYPE_UNSPECIFIED) {
      EXPECT_TRUE(EqualOnCpu(dw, expected));
    } else {
      EXPECT_LE(reference::RelativeError(dw, expected), 1e-2);
    }
  }
  grpc::ClientContext context;
  v1::FetchGradientsRequest missing;
  missing.set_head_id("nope");
  auto reader = stub_->FetchGradients(&context, missing);
  v1::FetchGradientsResponse response;
  EXPECT_FALSE(reader->Read(&response));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_P(HeadServiceTest, OptimizerStepUpdatesWeightsBumpsVersionAndRefusesStaleWork) {
  ASSERT_TRUE(Step("run/rank-0", 0).status.ok());
  torch::Tensor w0, dw;
  {
    w0 = testing::HeadOf(*entry_).weight().clone();
    dw = testing::HeadOf(*entry_).grads().weight.clone();
  }
  grpc::ClientContext context;
  v1::OptimizerStepRequest request;
  request.set_head_id("lm");
  request.mutable_sgd()->set_lr(0.5);
  request.set_grad_scale(2.0);
  request.set_zero_gradients(true);
  v1::OptimizerStepResponse response;
  ASSERT_TRUE(stub_->OptimizerStep(&context, request, &response).ok());
  EXPECT_EQ(response.info().weight_version(), 1);
  EXPECT_EQ(response.info().accumulated_micro_batches(), 0);
  {
    EXPECT_LE(reference::RelativeError(testing::HeadOf(*entry_).weight(), w0 - 0.5 * 2.0 * dw),
              1e-6);
    EXPECT_EQ(reference::MaxAbs(testing::HeadOf(*entry_).grads().weight), 0.0);
  }
  // Work computed against version 0 is refused once the weights moved on.
  const StepOutcome stale = Step("run/rank-0", 1, 17, [](v1::StepRequest& m) {
    if (m.has_header()) m.mutable_header()->set_expected_weight_version(0);
  });
  EXPECT_EQ(stale.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(stale.status.error_message(),
            "header.expected_weight_version: expected the head's current version 1; got 0");
  grpc::ClientContext bad_context;
  request.mutable_sgd()->set_lr(-1);
  const grpc::Status bad = stub_->OptimizerStep(&bad_context, request, &response);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bad.error_message(), "sgd.lr: expected a finite value in [0, inf); got -1");
}

TEST_P(HeadServiceTest, TwoPhaseForwardThenBackwardMatchesTheEngine) {
  const auto per_token = [](v1::StepRequest& m) {
    if (!m.has_header()) return;
    m.mutable_header()->mutable_function()->set_name("token_logprobs");
    m.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_NONE);
  };
  const core::StepOptions options{.function = "token_logprobs",
                                  .reduction = core::Reduction::kNone};
  auto expected = core::Forward(testing::HeadOf(*entry_), batch_, options);
  ASSERT_TRUE(expected.ok());
  const StepOutcome forward = Step("", 0, 17, per_token, Rpc::kForward);
  ASSERT_TRUE(forward.status.ok()) << forward.status.error_message();
  EXPECT_LE(reference::RelativeError(forward.outputs, expected->output), 1e-5);
  EXPECT_EQ(reference::MaxAbs(HeadWeightGrad()), 0.0) << "Forward accumulates nothing";

  const torch::Tensor upstream = torch::randn({kRows});
  core::GradientBuffers grads = testing::HeadOf(*entry_).NewGradientBuffers();
  auto dx = core::Backward(testing::HeadOf(*entry_), batch_, options, upstream.to(device_), &grads);
  ASSERT_TRUE(dx.ok());
  const StepOutcome backward = Step("run/rank-3", 0, 17, per_token, Rpc::kBackward, upstream);
  ASSERT_TRUE(backward.status.ok()) << backward.status.error_message();
  // Summed over differently split rows: fp32 rounding, relative to the gradient's size.
  // fp32 rounding relative to dX's size: the server batches rows differently from one call.
  EXPECT_LE(reference::RelativeError(backward.grad_hidden, dx->grad_hidden), 1e-6);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), grads.weight), 1e-5);
  const StepOutcome replay = Step("run/rank-3", 0, 50, per_token, Rpc::kBackward, upstream);
  EXPECT_TRUE(replay.summary.replayed());
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), grads.weight), 1e-5);

  const StepOutcome missing = Step("run/rank-3", 1, 17, per_token, Rpc::kBackward);
  EXPECT_EQ(missing.status.error_message(),
            "rows.grad_output: Backward with reduction NONE needs dL/dy for every row; got none");
}

TEST_P(HeadServiceTest, UploadThenExportRoundTripsAndBadUploadsCreateNothing) {
  const torch::Tensor w = torch::randn({kVocab, kHidden}).to(torch::kBFloat16);
  const torch::Tensor b = torch::randn({kVocab}).to(torch::kBFloat16);
  ASSERT_TRUE(Upload("up", w, b).ok());

  grpc::ClientContext context;
  v1::ExportWeightsRequest request;
  request.set_head_id("up");
  auto reader = stub_->ExportWeights(&context, request);
  torch::Tensor w_back = torch::zeros_like(w), b_back = torch::zeros_like(b);
  v1::ExportWeightsResponse response;
  while (reader->Read(&response)) {
    const bool is_bias = response.has_bias_rows();
    const auto& chunk = is_bias ? response.bias_rows() : response.weight_rows();
    torch::Tensor values = *DecodeTensor(chunk.values(), "export");
    (is_bias ? b_back : w_back).narrow(0, chunk.row_offset(), values.size(0)).copy_(values);
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(EqualOnCpu(w_back, w));
  EXPECT_TRUE(EqualOnCpu(b_back, b));

  const grpc::Status gap = Upload("gap", w, b, false, [](v1::UploadHeadRequest& m) {
    if (m.has_weight_rows() && m.weight_rows().row_offset() == 64) {
      m.mutable_weight_rows()->set_row_offset(70);
    }
  });
  EXPECT_EQ(gap.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(gap.error_message(),
            "weight_rows.row_offset: expected 64 (rows arrive in order); got 70");
  const grpc::Status short_upload = Upload("short", w, b, false, [](v1::UploadHeadRequest& m) {
    if (m.has_bias_rows()) m.clear_bias_rows();
  });
  EXPECT_EQ(short_upload.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(registry().Get("gap").ok());
  EXPECT_FALSE(registry().Get("short").ok());
}

// A trainer that owns the parameter (tied embeddings, local optimizer) sends new weights
// after each of its steps: accepted for an idle head of the same shape only.
TEST_P(HeadServiceTest, UploadWithReplaceSwapsTheWeightsOfAnIdleHeadOfTheSameShape) {
  torch::Tensor w_old, b_old;
  {
    w_old = testing::HeadOf(*entry_).weight().clone();
    b_old = testing::HeadOf(*entry_).bias().clone();
  }
  const torch::Tensor w = torch::randn({kVocab, kHidden});
  const torch::Tensor b = torch::randn({kVocab});
  const grpc::Status taken = Upload("lm", w, b);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::ALREADY_EXISTS);

  // Gradients computed with the old weights must be fetched and zeroed first.
  ASSERT_TRUE(Step("owner", 0).status.ok());
  const grpc::Status busy = Upload("lm", w, b, /*replace=*/true);
  EXPECT_EQ(busy.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(busy.error_message(),
            "header.replace: expected head \"lm\" to have no accumulated gradients (they were "
            "computed with the weights being replaced); got 1 micro-batches (fetch and zero them "
            "first)");
  const grpc::Status wrong_shape =
      Upload("lm", torch::randn({kVocab, kHidden + 1}), b, /*replace=*/true);
  EXPECT_EQ(wrong_shape.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(wrong_shape.error_message(),
            "header: expected the shape, dtype and bias of head \"lm\" to replace its weights, "
            "[300, 32] Float with bias; got [300, 33] Float with bias");
  {
    EXPECT_TRUE(EqualOnCpu(testing::HeadOf(*entry_).weight(), w_old));
    EXPECT_EQ(entry_->Describe().accumulated_micro_batches, 1);
    EXPECT_EQ(testing::HeadOf(*entry_).version(), 0);
  }

  grpc::ClientContext context;
  v1::HeadRef ref;
  ref.set_head_id("lm");
  v1::ZeroGradientsResponse zeroed;
  ASSERT_TRUE(stub_->ZeroGradients(&context, ref, &zeroed).ok());
  v1::HeadInfo info;
  ASSERT_TRUE(Upload("lm", w, b, /*replace=*/true, nullptr, &info).ok());
  EXPECT_EQ(info.weight_version(), 1);
  {
    EXPECT_TRUE(EqualOnCpu(testing::HeadOf(*entry_).weight(), w));
    EXPECT_TRUE(EqualOnCpu(testing::HeadOf(*entry_).bias(), b));
    EXPECT_EQ(registry().Get("lm")->get(), entry_.get());  // the same head, new weights
  }
  // Steps now compute with the new weights.
  const StepOutcome after = Step("owner", 1);
  ASSERT_TRUE(after.status.ok());
  const auto expected = core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, nullptr);
  ASSERT_TRUE(expected.ok());
  EXPECT_LE(reference::RelativeError(after.summary.loss(), expected->loss), 1e-5);
  // replace on a free id creates the head.
  ASSERT_TRUE(Upload("fresh", w, torch::Tensor(), /*replace=*/true, nullptr, &info).ok());
  EXPECT_EQ(info.weight_version(), 0);
  EXPECT_FALSE(info.has_bias());
}

// Many trainers on one head: concurrent contributions sum to what serial ones give.
TEST_P(HeadServiceTest, ConcurrentClientsAccumulateLikeSerialOnes) {
  constexpr int kClients = 4;
  core::GradientBuffers serial = testing::HeadOf(*entry_).NewGradientBuffers();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, &serial).ok());
  }
  std::vector<std::thread> clients;
  std::vector<StepOutcome> outcomes(kClients);
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] { outcomes[i] = Step("run/rank-" + std::to_string(i), 0); });
  }
  for (auto& t : clients) t.join();
  for (const auto& o : outcomes) ASSERT_TRUE(o.status.ok()) << o.status.error_message();
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), serial.weight), 1e-5);
  EXPECT_EQ(entry_->Describe().accumulated_micro_batches, kClients);
}

// A message over the server's limit (gRPC's default 4 MiB here) is refused by gRPC with
// RESOURCE_EXHAUSTED; nothing is accumulated and the server keeps serving.
TEST_P(HeadServiceTest, OversizedMessageIsRefusedAndTheServerKeepsServing) {
  const torch::Tensor before = HeadWeightGrad();
  const StepOutcome big = Step("run/rank-9", 0, 17, [](v1::StepRequest& m) {
    if (m.has_rows() && m.rows().row_offset() == 0) {
      m.mutable_rows()->mutable_hidden()->mutable_data()->resize(5 << 20);
    }
  });
  EXPECT_EQ(big.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << big.status.error_message();
  EXPECT_TRUE(EqualOnCpu(HeadWeightGrad(), before));
  EXPECT_TRUE(Step("run/rank-9", 0).status.ok());
}

TEST_P(HeadServiceTest, BadInputsGetPreciseStatusesAndChangeNothing) {
  const torch::Tensor before = HeadWeightGrad();
  struct Case {
    std::string label;
    std::function<void(v1::StepRequest&)> corrupt;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown head",
       [](v1::StepRequest& m) {
         if (m.has_header()) m.mutable_header()->set_head_id("nope");
       },
       grpc::StatusCode::NOT_FOUND,
       "head_id: expected the id of a head on this server; got \"nope\", which it does not have"},
      {"wrong hidden size",
       [](v1::StepRequest& m) {
         if (m.has_rows() && m.rows().row_offset() == 17) {
           EXPECT_TRUE(
               EncodeTensor(torch::zeros({17, kHidden + 1}), m.mutable_rows()->mutable_hidden())
                   .ok());
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden: expected shape [N, 32]; got [17, 33]"},
      {"rows without hidden",
       [](v1::StepRequest& m) {
         if (m.has_rows() && m.rows().row_offset() == 17) m.mutable_rows()->clear_hidden();
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "rows.hidden: expected the rows' hidden states [n, D] in every rows message; got none"},
      {"byte count",
       [](v1::StepRequest& m) {
         if (m.has_rows()) m.mutable_rows()->mutable_hidden()->mutable_data()->resize(12);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "rows.hidden: expected 2176 bytes for Float [17, 32]; got 12"},
      {"label out of range",
       [](v1::StepRequest& m) {
         if (m.has_rows() && m.rows().row_offset() == 34) {
           EXPECT_TRUE(EncodeTensor(torch::full({16}, kVocab, torch::kLong),
                                    m.mutable_rows()->mutable_targets())
                           .ok());
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "targets[34]: expected a token id in [0, 300) or ignore_index (-100); got 300"},
      {"rows out of order",
       [](v1::StepRequest& m) {
         if (m.has_rows() && m.rows().row_offset() == 17) m.mutable_rows()->set_row_offset(20);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "rows.row_offset: expected 17 (rows arrive in order); got 20"},
      {"missing header",
       [](v1::StepRequest& m) {
         if (m.has_header()) {
           m.clear_header();
           m.mutable_rows()->set_row_offset(0);
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "header: expected the first message to be the header; got rows"},
      {"wrong valid_tokens",
       [](v1::StepRequest& m) {
         if (m.has_header()) m.mutable_header()->set_valid_tokens(3);
       },
       grpc::StatusCode::INVALID_ARGUMENT, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    const StepOutcome outcome = Step("run/rank-1", 0, 17, c.corrupt);
    EXPECT_EQ(outcome.status.error_code(), c.code) << outcome.status.error_message();
    if (!c.message.empty()) {
      EXPECT_EQ(outcome.status.error_message(), c.message);
    }
    EXPECT_TRUE(EqualOnCpu(HeadWeightGrad(), before));
  }
  // The server keeps serving, and the failed id was never recorded: it can still be applied.
  const StepOutcome ok = Step("run/rank-1", 0);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_FALSE(ok.summary.replayed());
}

// What the header alone decides — the function, its params, the chunking — is refused at the
// header, by the plan the engine would use (core::PlanCall), on every step RPC and whatever the
// number of rows, zero included; and every RPC checks header.valid_tokens against its rows.
TEST_P(HeadServiceTest, HeaderErrorsDoNotDependOnTheRowsOrTheRpc) {
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  const std::string bad_param = std::string(
      registry.ResolveParams(**registry.Find("cross_entropy"), {{"label_smoothing", 2.0}})
          .status()
          .message());
  struct Case {
    std::string label;
    std::function<void(v1::StepHeader&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown function", [](v1::StepHeader& h) { h.mutable_function()->set_name("nope"); },
       absl::StrCat("function: expected one of ", absl::StrJoin(registry.Names(), ", "),
                    "; got \"nope\"")},
      {"bad param",
       [](v1::StepHeader& h) { (*h.mutable_function()->mutable_params())["label_smoothing"] = 2; },
       bad_param},
      {"bad chunking", [](v1::StepHeader& h) { h.mutable_chunking()->set_chunk_rows(-1); },
       "chunk_rows: expected >= 1 (or 0 to derive it from memory_budget_bytes); got -1"},
  };
  const torch::Tensor before = HeadWeightGrad();
  for (const Case& c : cases) {
    for (const Rpc rpc : {Rpc::kForwardBackward, Rpc::kForward, Rpc::kBackward}) {
      for (const bool zero_rows : {false, true}) {
        SCOPED_TRACE(
            absl::StrCat(c.label, " rpc ", static_cast<int>(rpc), " zero_rows ", zero_rows));
        const StepOutcome outcome = Step(
            "run/rank-2", 0, 17,
            [&](v1::StepRequest& m) {
              if (m.has_header()) {
                c.edit(*m.mutable_header());
                if (zero_rows) m.mutable_header()->set_rows(0);
              } else if (zero_rows) {
                m.clear_part();
              }
            },
            rpc);
        EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
        EXPECT_EQ(outcome.status.error_message(), c.message);
      }
    }
  }
  // A Backward counts its valid tokens like the other RPCs (one rule, the engine's).
  const StepOutcome backward = Step(
      "run/rank-2", 0, 17,
      [](v1::StepRequest& m) {
        if (m.has_header()) m.mutable_header()->set_valid_tokens(3);
      },
      Rpc::kBackward);
  EXPECT_EQ(backward.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(backward.status.error_message(),
                               "header.valid_tokens: expected the number of targets != "
                               "ignore_index in the rows, "))
      << backward.status.error_message();
  EXPECT_TRUE(EqualOnCpu(HeadWeightGrad(), before));
  ExpectAdmissionDrains();
}

TEST_P(HeadServiceTest, ClientCancellingMidStreamLeavesGradientsUntouched) {
  const torch::Tensor before = HeadWeightGrad();
  grpc::ClientContext context;
  auto stream = stub_->ForwardBackward(&context);
  ASSERT_TRUE(stream->Write(AccumulatingHeader("run/rank-2")));
  v1::StepRequest rows;
  rows.mutable_rows()->set_row_offset(0);
  ASSERT_TRUE(
      EncodeTensor(batch_.hidden.narrow(0, 0, 10), rows.mutable_rows()->mutable_hidden()).ok());
  ASSERT_TRUE(
      EncodeTensor(batch_.targets.narrow(0, 0, 10), rows.mutable_rows()->mutable_targets()).ok());
  ASSERT_TRUE(stream->Write(rows));
  // Running (admitted; its first rows wait for the rest of their batch) when it is cancelled.
  for (int i = 0; i < 500 && service().admission().Stats().active == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(service().admission().Stats().active, 1);
  v1::StepResponse response;
  context.TryCancel();
  while (stream->Read(&response)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(EqualOnCpu(HeadWeightGrad(), before));
  // The cancelled id was not recorded.
  EXPECT_TRUE(entry_->Describe().accumulated_micro_batches == 0);
}

INSTANTIATE_TEST_SUITE_P(Devices, HeadServiceTest, ::testing::ValuesIn(testing::TestDevices()),
                         [](const auto& info) { return testing::DeviceLabel(info.param); });

}  // namespace
}  // namespace remotehead
