// The C++ client discovers the server's functions (ListFunctions) and shapes a per-row Forward's
// outputs from that listing, not from the function's name: per-token values [N], logits rows
// [N, V] in the asked dtype (and a bf16 head's formed in fp32 when StepSpec::logits_dtype asks),
// a drawn token and its log-probability. Against an in-process server;
// the listing is compared with core's registry and the outputs with the head's own logits.
#include <gtest/gtest.h>

#include <set>

#include "remotehead/client/client.h"
#include "remotehead/core/functions.h"
#include "remotehead/server/rpc/head_service.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

namespace rc = client;

constexpr int64_t kVocab = 97;
constexpr int64_t kHidden = 16;
constexpr int64_t kRows = 23;

rc::OutputKind Expected(core::OutputKind kind) {
  switch (kind) {
    case core::OutputKind::kLogits:
      return rc::OutputKind::kLogits;
    case core::OutputKind::kSample:
      return rc::OutputKind::kSample;
    case core::OutputKind::kPerToken:
      break;
  }
  return rc::OutputKind::kPerToken;
}

class FunctionsClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    client_ = *rc::Client::Create({.target = server_.target()});
    auto info = client_->CreateHead(
        "lm", rc::InitSpec{.vocab_size = kVocab, .hidden_size = kHidden, .bias = true, .seed = 3});
    ASSERT_TRUE(info.ok()) << info.status();
    entry_ = *server_.registry().Get("lm");
    torch::manual_seed(11);
    hidden_ = torch::randn({kRows, kHidden});
  }

  // The head's logits for hidden_, in float64 (the independent reference).
  torch::Tensor Logits() {
    const core::Head& head = testing::HeadOf(*entry_);
    return torch::addmm(head.bias().to(torch::kDouble), hidden_.to(torch::kDouble),
                        head.weight().to(torch::kDouble).t());
  }

  testing::InProcessServer server_{server::ServiceOptions{}};
  std::shared_ptr<rc::Client> client_;
  std::shared_ptr<server::HeadEntry> entry_;
  torch::Tensor hidden_;
};

TEST_F(FunctionsClientTest, ListFunctionsDescribesEveryRegisteredFunction) {
  const absl::StatusOr<std::vector<rc::FunctionInfo>> listed = client_->ListFunctions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  ASSERT_EQ(listed->size(), registry.Functions().size());
  for (const rc::FunctionInfo& info : *listed) {
    SCOPED_TRACE(info.name);
    const absl::StatusOr<const core::TransformFunction*> fn = registry.Find(info.name);
    ASSERT_TRUE(fn.ok()) << fn.status();
    EXPECT_EQ(info.needs_targets, (*fn)->needs_targets);
    EXPECT_EQ(info.required_aux, (*fn)->required_aux);
    EXPECT_EQ(info.optional_aux, (*fn)->optional_aux);
    EXPECT_EQ(info.output_kind, Expected((*fn)->output));
    EXPECT_EQ(info.differentiable, (*fn)->output == core::OutputKind::kPerToken);
    EXPECT_EQ(info.vocab_decomposable, (*fn)->vocab_decomposable);
    EXPECT_EQ(info.output_dtype, core::OutputDtype((*fn)->output, torch::kFloat, torch::kFloat));
    // Its own params, then the common ones, each once.
    std::set<std::string> names;
    for (const rc::FunctionParameter& p : info.params) EXPECT_TRUE(names.insert(p.name).second);
    EXPECT_EQ(names.size(), (*fn)->params.size() + core::FunctionRegistry::CommonParams().size());
    EXPECT_TRUE(names.count(core::kTemperatureParam));
  }
}

TEST_F(FunctionsClientTest, PerRowForwardIsShapedByTheListing) {
  const torch::Tensor targets = torch::randint(0, kVocab, {kRows}, torch::kLong);
  const torch::Tensor logits = Logits();
  const torch::Tensor logprobs = torch::log_softmax(logits, 1);

  // Per-token: [N] float32, the targets' log-probabilities.
  auto per_token = client_->Forward(
      {.head_id = "lm", .function = "token_logprobs", .reduction = rc::Reduction::kNone},
      {.hidden = hidden_, .targets = targets});
  ASSERT_TRUE(per_token.ok()) << per_token.status();
  EXPECT_EQ(per_token->outputs.sizes(), torch::IntArrayRef({kRows}));
  EXPECT_EQ(per_token->outputs.scalar_type(), torch::kFloat);
  EXPECT_FALSE(per_token->token_ids.defined());
  EXPECT_TRUE(torch::allclose(per_token->outputs.to(torch::kDouble),
                              logprobs.gather(1, targets.unsqueeze(1)).squeeze(1), 1e-5, 1e-5));

  // Logits: [N, V], float32 by default and in the dtype asked for.
  auto rows = client_->Forward(
      {.head_id = "lm", .function = "logits", .reduction = rc::Reduction::kNone},
      {.hidden = hidden_});
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->outputs.sizes(), torch::IntArrayRef({kRows, kVocab}));
  EXPECT_EQ(rows->outputs.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(rows->outputs.to(torch::kDouble), logits, 1e-5, 1e-5));
  auto bf16 = client_->Forward({.head_id = "lm",
                                .function = "logits",
                                .reduction = rc::Reduction::kNone,
                                .output_dtype = torch::kBFloat16},
                               {.hidden = hidden_});
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->outputs.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(bf16->outputs.to(torch::kDouble), logits, 2e-2, 2e-2));

  // Sample, greedy: the argmax and its log-probability.
  auto drawn = client_->Forward({.head_id = "lm",
                                 .function = "sample",
                                 .params = {{"greedy", 1.0}},
                                 .reduction = rc::Reduction::kNone},
                                {.hidden = hidden_});
  ASSERT_TRUE(drawn.ok()) << drawn.status();
  ASSERT_TRUE(drawn->token_ids.defined());
  EXPECT_EQ(drawn->token_ids.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(drawn->token_ids, logits.argmax(1)));
  EXPECT_TRUE(
      torch::allclose(drawn->outputs.to(torch::kDouble), std::get<0>(logprobs.max(1)), 1e-5, 1e-5));
}

// StepSpec::logits_dtype travels as StepHeader.logits_dtype: a bf16 head's "logits" rows are
// the bf16-rounded product unset, the fp32 product of the same bf16 values with float32; any
// other dtype is refused by the server naming the field.
TEST_F(FunctionsClientTest, LogitsDtypeAsksForFp32LogitsOfABf16Head) {
  auto created = client_->CreateHead("lm16", rc::InitSpec{.vocab_size = kVocab,
                                                          .hidden_size = kHidden,
                                                          .seed = 5,
                                                          .init_std = 1.0,
                                                          .dtype = torch::kBFloat16});
  ASSERT_TRUE(created.ok()) << created.status();
  const core::Head& head = testing::HeadOf(**server_.registry().Get("lm16"));
  const torch::Tensor x = hidden_.to(torch::kBFloat16);
  const torch::Tensor exact = torch::mm(x.to(torch::kDouble), head.weight().to(torch::kDouble).t());
  const double scale = exact.abs().max().item<double>();
  rc::StepSpec spec{.head_id = "lm16", .function = "logits", .reduction = rc::Reduction::kNone};
  auto unset = client_->Forward(spec, {.hidden = x});
  spec.logits_dtype = torch::kFloat;
  auto fp32 = client_->Forward(spec, {.hidden = x});
  ASSERT_TRUE(unset.ok() && fp32.ok()) << unset.status() << " " << fp32.status();
  EXPECT_GE((unset->outputs.to(torch::kDouble) - exact).abs().max().item<double>(), 1e-3 * scale)
      << "bf16 logits are rounded";
  EXPECT_LE((fp32->outputs.to(torch::kDouble) - exact).abs().max().item<double>(), 1e-6 * scale);
  spec.logits_dtype = torch::kBFloat16;
  auto refused = client_->Forward(spec, {.hidden = x});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "logits_dtype: expected float32 (fp32 logits from the head's bfloat16 weights) or "
            "unset (logits in the head's dtype); got bfloat16");
}

TEST_F(FunctionsClientTest, AnUnknownFunctionIsRefusedByTheServer) {
  auto refused = client_->Forward(
      {.head_id = "lm", .function = "no_such_function", .reduction = rc::Reduction::kNone},
      {.hidden = hidden_});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("no_such_function"), std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace remotehead
