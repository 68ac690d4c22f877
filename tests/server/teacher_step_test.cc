// Frozen heads and two-head (distillation) steps through the service: a frozen head refuses dW
// and optimizer steps (HEAD_FROZEN) and still serves dX-only steps and Forwards; a step names a
// frozen teacher (StepHeader.teacher_head_id) whose hidden states travel with the rows
// (StepRows.teacher_hidden), and every way of naming a wrong teacher is refused with its code,
// reason, field, expected and actual value. What the service computes equals the engine called
// directly with the same two heads (core::FusedForwardBackward, StepOptions::teacher): fused,
// and Forward then Backward by a retained inputs handle; sparse top-k teachers' [n, k] aux too.
#include <atomic>
#include <map>

#include "remotehead/core/error_reason.h"
#include "remotehead/core/functions.h"
#include "service_fixture.h"

namespace remotehead {
namespace {

constexpr int64_t kTeacherHidden = 48;  // the teacher's D differs from the student's kHidden
constexpr double kTol = 1e-6;

struct Detail {
  std::string reason;
  std::map<std::string, std::string> metadata;
};

Detail DetailOf(const grpc::Status& status) {
  Detail d;
  v1::RpcStatus rpc;
  v1::ErrorInfo info;
  EXPECT_TRUE(rpc.ParseFromString(status.error_details())) << status.error_message();
  if (rpc.details_size() == 1 && info.ParseFromString(rpc.details(0).value())) {
    d.reason = info.reason();
    d.metadata = {info.metadata().begin(), info.metadata().end()};
  }
  return d;
}

bool Mentions(const grpc::Status& status, const std::string& text) {
  return status.error_message().find(text) != std::string::npos;
}

void ExpectClose(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, kTol) << what << ": max |service − engine| = " << diff;
}

class TeacherStepTest : public ServiceFixture {
 protected:
  void SetUp() override {
    StartService({});
    ASSERT_TRUE(Create("teacher", kVocab, kTeacherHidden, /*frozen=*/true, 11).ok());
  }

  grpc::Status Create(const std::string& id, int64_t vocab, int64_t hidden, bool frozen,
                      uint64_t seed, v1::HeadInfo* info = nullptr) {
    v1::CreateHeadRequest create;
    create.set_head_id(id);
    create.set_frozen(frozen);
    create.mutable_init()->set_vocab_size(vocab);
    create.mutable_init()->set_hidden_size(hidden);
    create.mutable_init()->set_bias(true);
    create.mutable_init()->set_seed(seed);
    create.mutable_init()->set_init_std(1.0 / std::sqrt(double(hidden)));
    grpc::ClientContext context;
    v1::HeadInfo ignored;
    return stub_->CreateHead(&context, create, info != nullptr ? info : &ignored);
  }

  v1::HeadInfo Describe(const std::string& id) {
    grpc::ClientContext context;
    v1::HeadRef ref;
    ref.set_head_id(id);
    v1::HeadInfo info;
    EXPECT_TRUE(stub_->DescribeHead(&context, ref, &info).ok());
    return info;
  }

  core::Head& HeadNamed(const std::string& id) { return testing::HeadOf(**registry().Get(id)); }

  // A batch for student "lm" (kRows rows, some targets ignored) with the teacher's hidden states.
  core::TokenBatch TwoHeadBatch(uint64_t seed = 3) {
    core::TokenBatch b = batch_;
    auto gen = at::detail::createCPUGenerator(seed);
    b.teacher_hidden = at::normal(0.0, 1.0, {kRows, kTeacherHidden}, gen);
    return b;
  }

  // The header of a two-head call on student "lm".
  static v1::StepHeader Header(const std::string& function, const std::string& teacher,
                               const core::TokenBatch& b, bool accumulate) {
    v1::StepHeader h;
    h.set_head_id("lm");
    h.set_teacher_head_id(teacher);
    h.mutable_function()->set_name(function);
    h.mutable_function()->set_reduction(v1::REDUCTION_MEAN);
    h.set_rows(b.rows());
    h.set_valid_tokens((b.targets != -100).sum().item<int64_t>());
    h.set_accumulate_weight_grad(accumulate);
    if (accumulate) h.mutable_gradient_id()->set_trainer("t");
    h.mutable_chunking()->set_chunk_rows(8);
    return h;
  }

  // Rows messages of `piece` rows (hidden, targets, aux, teacher_hidden when defined).
  static std::vector<v1::StepRows> Rows(const core::TokenBatch& b, int64_t piece = 17) {
    std::vector<v1::StepRows> out;
    for (int64_t offset = 0; offset < b.rows(); offset += piece) {
      const int64_t n = std::min(piece, b.rows() - offset);
      v1::StepRows rows;
      rows.set_row_offset(offset);
      EXPECT_TRUE(EncodeTensor(b.hidden.narrow(0, offset, n), rows.mutable_hidden()).ok());
      EXPECT_TRUE(EncodeTensor(b.targets.narrow(0, offset, n), rows.mutable_targets()).ok());
      for (const auto& [name, t] : b.aux) {
        EXPECT_TRUE(EncodeTensor(t.narrow(0, offset, n), &(*rows.mutable_aux())[name]).ok());
      }
      if (b.teacher_hidden.defined()) {
        EXPECT_TRUE(
            EncodeTensor(b.teacher_hidden.narrow(0, offset, n), rows.mutable_teacher_hidden())
                .ok());
      }
      out.push_back(std::move(rows));
    }
    return out;
  }

  struct Call {
    grpc::Status status;
    torch::Tensor grad_hidden;
    v1::StepSummary summary;
  };

  Call Run(Rpc rpc, const v1::StepHeader& header, const std::vector<v1::StepRows>& rows) {
    grpc::ClientContext context;
    auto stream = rpc == Rpc::kForward    ? stub_->Forward(&context)
                  : rpc == Rpc::kBackward ? stub_->Backward(&context)
                                          : stub_->ForwardBackward(&context);
    Call call;
    std::thread reader([&] {
      v1::StepResponse response;
      while (stream->Read(&response)) {
        if (response.has_grad_hidden()) {
          const auto& chunk = response.grad_hidden();
          torch::Tensor values = *DecodeTensor(chunk.values(), "grad_hidden");
          if (!call.grad_hidden.defined()) {  // [rows, D] of the head the step ran on
            call.grad_hidden = torch::full({header.rows(), values.size(1)}, NAN);
          }
          call.grad_hidden.narrow(0, chunk.row_offset(), values.size(0)).copy_(values);
        } else if (response.has_summary()) {
          call.summary = response.summary();
        }
      }
    });
    v1::StepRequest first;
    *first.mutable_header() = header;
    bool open = stream->Write(first);
    for (const v1::StepRows& r : rows) {
      if (!open) break;
      v1::StepRequest m;
      *m.mutable_rows() = r;
      open = stream->Write(m);
    }
    stream->WritesDone();
    reader.join();
    call.status = stream->Finish();
    return call;
  }

  // The engine called directly on "lm" with `teacher` (kMean over the batch's valid tokens).
  core::FusedResult Fused(const std::string& function, const core::TokenBatch& b,
                          const core::FunctionParams& params, const core::Head* teacher,
                          core::GradientBuffers* grads) {
    core::StepOptions options{.function = function,
                              .params = params,
                              .reduction = core::Reduction::kMean,
                              .chunk_rows = 8};
    options.normalizer = std::max<int64_t>((b.targets != -100).sum().item<int64_t>(), 1);
    options.teacher = teacher;
    auto r = core::FusedForwardBackward(HeadNamed("lm"), b, options, grads);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : core::FusedResult{};
  }
};

TEST_F(TeacherStepTest, FrozenHeadRefusesGradientsAndOptimizerStepsAndServesDxOnly) {
  const v1::HeadInfo info = Describe("teacher");
  EXPECT_TRUE(info.frozen());
  EXPECT_FALSE(Describe("lm").frozen());
  // Its own batch (the teacher's D) as a student of no one: cross_entropy on the frozen head.
  core::TokenBatch b = batch_;
  b.hidden = TwoHeadBatch().teacher_hidden;
  v1::StepHeader h = Header("cross_entropy", "", b, /*accumulate=*/true);
  h.set_head_id("teacher");
  const Call refused = Run(Rpc::kForwardBackward, h, Rows(b));
  ASSERT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(DetailOf(refused.status).reason, core::reason::kHeadFrozen);
  EXPECT_EQ(DetailOf(refused.status).metadata["head"], "teacher");
  EXPECT_TRUE(Mentions(refused.status, "header.accumulate_weight_grad"))
      << refused.status.error_message();
  EXPECT_TRUE(Mentions(refused.status, "\"teacher\"")) << refused.status.error_message();

  // dX only: served, equal to the engine with no dW; and nothing accumulated.
  h.set_accumulate_weight_grad(false);
  h.clear_gradient_id();
  const Call dx_only = Run(Rpc::kForwardBackward, h, Rows(b));
  ASSERT_TRUE(dx_only.status.ok()) << dx_only.status.error_message();
  core::StepOptions options{.function = "cross_entropy", .chunk_rows = 8};
  options.normalizer = std::max<int64_t>((b.targets != -100).sum().item<int64_t>(), 1);
  auto want = core::FusedForwardBackward(HeadNamed("teacher"), b, options, nullptr);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_NEAR(dx_only.summary.loss(), want->loss, kTol);
  ExpectClose(dx_only.grad_hidden, want->grad_hidden, "frozen dX");
  EXPECT_EQ(HeadNamed("teacher").grads().weight.abs().sum().item<double>(), 0);
  // A Forward too.
  EXPECT_TRUE(Run(Rpc::kForward, h, Rows(b)).status.ok());

  // Optimizer steps, plain and synchronous: refused, the version unchanged.
  for (const bool synchronous : {false, true}) {
    v1::OptimizerStepRequest step;
    step.set_head_id("teacher");
    step.mutable_sgd()->set_lr(0.1);
    if (synchronous) step.mutable_synchronous()->set_world_size(1);
    grpc::ClientContext context;
    v1::OptimizerStepResponse response;
    const grpc::Status s = stub_->OptimizerStep(&context, step, &response);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << synchronous;
    EXPECT_EQ(DetailOf(s).reason, core::reason::kHeadFrozen);
    EXPECT_EQ(DetailOf(s).metadata["head"], "teacher");
  }
  EXPECT_EQ(Describe("teacher").weight_version(), 0);
}

TEST_F(TeacherStepTest, UploadedFrozenHeadKeepsItsFlagThroughReplaces) {
  torch::manual_seed(4);
  const torch::Tensor w = torch::randn({kVocab, kHidden});
  auto frozen = [](bool value) {
    return [value](v1::UploadHeadRequest& m) {
      if (m.has_header()) m.mutable_header()->set_frozen(value);
    };
  };
  v1::HeadInfo info;
  ASSERT_TRUE(Upload("ref", w, {}, false, frozen(true), &info).ok());
  EXPECT_TRUE(info.frozen());
  // A replace that would unfreeze it: refused, naming the field, both values.
  const grpc::Status refused = Upload("ref", w * 2, {}, /*replace=*/true, frozen(false));
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Mentions(refused, "header.frozen: expected true")) << refused.error_message();
  EXPECT_TRUE(Mentions(refused, "got false")) << refused.error_message();
  EXPECT_TRUE(torch::equal(HeadNamed("ref").weight(), w));
  // The same flag: new weights, still frozen.
  ASSERT_TRUE(Upload("ref", w * 2, {}, /*replace=*/true, frozen(true), &info).ok());
  EXPECT_TRUE(info.frozen());
  EXPECT_TRUE(torch::equal(HeadNamed("ref").weight(), w * 2));
  // A head that is not frozen cannot be frozen by a replace either.
  const grpc::Status freeze = Upload("lm", HeadNamed("lm").weight().clone(),
                                     HeadNamed("lm").bias().clone(), true, frozen(true));
  ASSERT_EQ(freeze.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Mentions(freeze, "header.frozen: expected false")) << freeze.error_message();
}

TEST_F(TeacherStepTest, WrongTeachersAreRefusedNamingFieldExpectedAndActual) {
  ASSERT_TRUE(Create("unfrozen", kVocab, kTeacherHidden, /*frozen=*/false, 12).ok());
  ASSERT_TRUE(Create("small", kVocab - 100, kTeacherHidden, /*frozen=*/true, 13).ok());
  const core::TokenBatch b = TwoHeadBatch();
  struct Case {
    std::string name;
    std::string function;
    std::string teacher;
    grpc::StatusCode code;
    std::string reason;
    std::vector<std::string> mentions;
    std::map<std::string, std::string> metadata;
  };
  const std::vector<Case> cases = {
      {"teacher for a one-head function",
       "cross_entropy",
       "teacher",
       grpc::StatusCode::INVALID_ARGUMENT,
       "INVALID_FIELD",
       {"header.teacher_head_id: expected none", "\"cross_entropy\"", "got \"teacher\""},
       {{"field", "header.teacher_head_id"}}},
      {"no teacher for a two-head function",
       "distill_kl",
       "",
       grpc::StatusCode::INVALID_ARGUMENT,
       "INVALID_FIELD",
       {"header.teacher_head_id: expected the id of a frozen teacher", "got none"},
       {{"field", "header.teacher_head_id"}}},
      {"unknown teacher",
       "distill_kl",
       "nope",
       grpc::StatusCode::NOT_FOUND,
       core::reason::kHeadNotFound,
       {"header.teacher_head_id", "got \"nope\""},
       {{"head", "nope"}}},
      {"the student itself",
       "distill_kl",
       "lm",
       grpc::StatusCode::INVALID_ARGUMENT,
       core::reason::kTeacherIncompatible,
       {"header.teacher_head_id", "got \"lm\""},
       {{"teacher", "lm"}, {"field", "teacher_head_id"}, {"actual", "\"lm\""}}},
      {"not frozen",
       "distill_kl",
       "unfrozen",
       grpc::StatusCode::FAILED_PRECONDITION,
       core::reason::kTeacherIncompatible,
       {"\"unfrozen\"", "frozen: expected true; got false"},
       {{"teacher", "unfrozen"}, {"field", "frozen"}, {"expected", "true"}, {"actual", "false"}}},
      {"another vocabulary",
       "distill_kl",
       "small",
       grpc::StatusCode::INVALID_ARGUMENT,
       core::reason::kTeacherIncompatible,
       {"\"small\"", absl::StrCat("vocab_size: expected ", kVocab, "; got ", kVocab - 100)},
       {{"teacher", "small"},
        {"field", "vocab_size"},
        {"expected", absl::StrCat(kVocab)},
        {"actual", absl::StrCat(kVocab - 100)}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Call call = Run(Rpc::kForwardBackward, Header(c.function, c.teacher, b, true), Rows(b));
    ASSERT_EQ(call.status.error_code(), c.code) << call.status.error_message();
    const Detail d = DetailOf(call.status);
    EXPECT_EQ(d.reason, c.reason) << call.status.error_message();
    for (const std::string& text : c.mentions) {
      EXPECT_TRUE(Mentions(call.status, text)) << text << " in " << call.status.error_message();
    }
    for (const auto& [key, value] : c.metadata) {
      EXPECT_EQ(d.metadata.contains(key) ? d.metadata.at(key) : "(none)", value) << key;
    }
  }
  // teacher_hidden rows that are not the message's hidden rows.
  std::vector<v1::StepRows> rows = Rows(b);
  core::TokenBatch short_rows = b;
  short_rows.teacher_hidden = b.teacher_hidden.narrow(0, 0, 16);
  ASSERT_TRUE(EncodeTensor(short_rows.teacher_hidden, rows[0].mutable_teacher_hidden()).ok());
  const Call mismatched =
      Run(Rpc::kForwardBackward, Header("distill_kl", "teacher", b, true), rows);
  ASSERT_EQ(mismatched.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Mentions(mismatched.status, "rows.teacher_hidden: expected 17 rows"))
      << mismatched.status.error_message();
  EXPECT_TRUE(Mentions(mismatched.status, "got 16 rows")) << mismatched.status.error_message();
  // Nothing was accumulated by any of them, and no teacher_of was recorded.
  EXPECT_EQ(Describe("lm").accumulated_micro_batches(), 0);
  EXPECT_EQ(Describe("teacher").teacher_of_size(), 0);
}

TEST_F(TeacherStepTest, DistillationEqualsTheEngineWithTheSameTwoHeads) {
  const core::TokenBatch b = TwoHeadBatch();
  v1::StepHeader h = Header("distill_kl", "teacher", b, true);
  (*h.mutable_function()->mutable_params())["alpha"] = 0.5;
  (*h.mutable_function()->mutable_params())["temperature"] = 2.0;
  const Call call = Run(Rpc::kForwardBackward, h, Rows(b));
  ASSERT_TRUE(call.status.ok()) << call.status.error_message();
  core::GradientBuffers grads = HeadNamed("lm").NewGradientBuffers();
  const core::FusedResult want =
      Fused("distill_kl", b, {{"alpha", 0.5}, {"temperature", 2.0}}, &HeadNamed("teacher"), &grads);
  EXPECT_GT(want.loss, 0.1);  // a KL between two different heads, and cross-entropy
  EXPECT_NEAR(call.summary.loss(), want.loss, kTol);
  ExpectClose(call.grad_hidden, want.grad_hidden, "dX");
  ExpectClose(HeadWeightGrad(), grads.weight, "dW");
  // The teacher got nothing and now lists its student.
  EXPECT_EQ(HeadNamed("teacher").grads().weight.abs().sum().item<double>(), 0);
  const v1::HeadInfo teacher = Describe("teacher");
  ASSERT_EQ(teacher.teacher_of_size(), 1);
  EXPECT_EQ(teacher.teacher_of(0), "lm");
  EXPECT_EQ(Describe("teacher").weight_version(), 0);
}

TEST_F(TeacherStepTest, ForwardThenBackwardByHandleRetainsTheTeacherHiddenStates) {
  const core::TokenBatch b = TwoHeadBatch(5);
  v1::StepHeader forward = Header("distill_reverse_kl", "teacher", b, false);
  forward.set_retain_inputs_seconds(60);
  const Call f = Run(Rpc::kForward, forward, Rows(b));
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ASSERT_FALSE(f.summary.inputs_handle().empty());
  const core::FusedResult want = Fused("distill_reverse_kl", b, {}, &HeadNamed("teacher"), nullptr);
  EXPECT_NEAR(f.summary.loss(), want.loss, kTol);

  // A Backward by the handle naming another teacher (or none) is refused.
  ASSERT_TRUE(Create("teacher2", kVocab, kTeacherHidden, /*frozen=*/true, 14).ok());
  v1::StepHeader backward = Header("distill_reverse_kl", "teacher2", b, true);
  backward.set_inputs_handle(f.summary.inputs_handle());
  backward.set_upstream_scale(1.0);
  const Call other = Run(Rpc::kBackward, backward, {});
  ASSERT_EQ(other.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Mentions(other.status, "header.teacher_head_id: expected \"teacher\""))
      << other.status.error_message();
  // Sending teacher_hidden again with the handle is refused too.
  backward.set_teacher_head_id("teacher");
  std::vector<v1::StepRows> resent(1);
  ASSERT_TRUE(EncodeTensor(b.teacher_hidden, resent[0].mutable_teacher_hidden()).ok());
  EXPECT_EQ(Run(Rpc::kBackward, backward, resent).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  const Call back = Run(Rpc::kBackward, backward, {});
  ASSERT_TRUE(back.status.ok()) << back.status.error_message();
  ExpectClose(back.grad_hidden, want.grad_hidden, "dX by handle");
  core::GradientBuffers grads = HeadNamed("lm").NewGradientBuffers();
  Fused("distill_reverse_kl", b, {}, &HeadNamed("teacher"), &grads);
  ExpectClose(HeadWeightGrad(), grads.weight, "dW by handle");
  ExpectAdmissionDrains();  // the retained inputs (teacher_hidden included) were released
}

TEST_F(TeacherStepTest, SparseTopkTeacherAuxAreRowsOfK) {
  // A teacher's top-k as a trainer would send it: distinct ids per row, their log-probs.
  constexpr int64_t k = 5;
  core::TokenBatch b = batch_;
  auto gen = at::detail::createCPUGenerator(9);
  const torch::Tensor logprobs =
      torch::log_softmax(at::normal(0.0, 2.0, {kRows, kVocab}, gen), /*dim=*/1);
  const auto [values, ids] = logprobs.topk(k, /*dim=*/1);
  b.aux["teacher_topk_ids"] = ids.contiguous();
  b.aux["teacher_topk_logprobs"] = values.contiguous();
  const Call call = Run(Rpc::kForwardBackward, Header("distill_topk_kl", "", b, true), Rows(b));
  ASSERT_TRUE(call.status.ok()) << call.status.error_message();
  core::GradientBuffers grads = HeadNamed("lm").NewGradientBuffers();
  const core::FusedResult want = Fused("distill_topk_kl", b, {}, nullptr, &grads);
  EXPECT_NEAR(call.summary.loss(), want.loss, kTol);
  ExpectClose(call.grad_hidden, want.grad_hidden, "top-k dX");
  ExpectClose(HeadWeightGrad(), grads.weight, "top-k dW");
}

TEST_F(TeacherStepTest, ListFunctionsMarksTwoHeadFunctionsAndTheirAux) {
  grpc::ClientContext context;
  v1::ListFunctionsResponse response;
  ASSERT_TRUE(stub_->ListFunctions(&context, {}, &response).ok());
  std::map<std::string, v1::FunctionDescription> by_name;
  for (const v1::FunctionDescription& d : response.functions()) by_name[d.name()] = d;
  for (const auto& [name, d] : by_name) {
    const core::TransformFunction* fn = *core::FunctionRegistry::Builtin().Find(name);
    EXPECT_EQ(d.needs_teacher(), fn->needs_teacher) << name;
  }
  ASSERT_TRUE(by_name.contains("distill_kl"));
  EXPECT_TRUE(by_name["distill_kl"].needs_teacher());
  EXPECT_FALSE(by_name["cross_entropy"].needs_teacher());
  const v1::FunctionDescription& topk = by_name["distill_topk_kl"];
  EXPECT_FALSE(topk.needs_teacher());
  const std::vector<std::string> topk_aux(topk.topk_aux().begin(), topk.topk_aux().end());
  EXPECT_EQ(topk_aux, (std::vector<std::string>{"teacher_topk_ids", "teacher_topk_logprobs"}));
  ASSERT_EQ(topk.integral_aux_size(), 1);
  EXPECT_EQ(topk.integral_aux(0), "teacher_topk_ids");
  EXPECT_EQ(by_name["grpo"].topk_aux_size(), 0);
}

// Two frozen heads, each the other's teacher in dX-only steps running at once: both entries'
// locks are taken in one order, so neither request waits on the other forever.
TEST_F(TeacherStepTest, HeadsThatTeachEachOtherAtOnceDoNotDeadlock) {
  ASSERT_TRUE(Create("a", kVocab, kTeacherHidden, /*frozen=*/true, 21).ok());
  ASSERT_TRUE(Create("b", kVocab, kTeacherHidden, /*frozen=*/true, 22).ok());
  core::TokenBatch batch = TwoHeadBatch();
  batch.hidden = batch.teacher_hidden;  // both heads have D = kTeacherHidden
  std::atomic<int> failures{0};
  auto run = [&](const std::string& student, const std::string& teacher) {
    for (int i = 0; i < 6; ++i) {
      v1::StepHeader h = Header("distill_jsd", teacher, batch, false);
      h.set_head_id(student);
      h.mutable_chunking()->set_chunk_rows(1);  // many engine calls, many lock pairs
      const Call call = Run(Rpc::kForwardBackward, h, Rows(batch));
      if (!call.status.ok()) {
        ADD_FAILURE() << student << " taught by " << teacher << ": " << call.status.error_message();
        ++failures;
      }
    }
  };
  std::thread ab([&] { run("a", "b"); });
  std::thread ba([&] { run("b", "a"); });
  ab.join();
  ba.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(Describe("a").teacher_of(0), "b");
  EXPECT_EQ(Describe("b").teacher_of(0), "a");
}

}  // namespace
}  // namespace remotehead
