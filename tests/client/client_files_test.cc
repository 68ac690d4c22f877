// The C++ client's calls that write and read files on the server, against an in-process server
// (the fixture of client_fixture.h): a head's state saved and restored (weights, bias, version,
// optimizer state), and weights saved to safetensors and a head created from the file.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "client/client_fixture.h"
#include "remotehead/server/service/state_store.h"

namespace remotehead {
namespace {

// Its own suite name: gtest requires one fixture class per suite, and client_test.cc's ClientTest
// is another class (the header's anonymous namespace gives each file its own).
class ClientFilesTest : public ClientTest {};

// SaveHeadState / RestoreHeadState against a server with a state store (--state_dir): a
// restore brings back the saved weights and bias bit for bit, the version, zeroed gradients and
// the optimizer state — the step taken after the restore repeats the step first taken from the
// saved state, which AdamW's moments and step count decide (a fresh optimizer state gives
// another update). Errors keep the server's code and name the field.
TEST_F(ClientFilesTest, SaveAndRestoreHeadStateBringBackWeightsAndOptimizerState) {
  const auto no_store = client_->SaveHeadState("lm");
  EXPECT_EQ(no_store.status().code(), absl::StatusCode::kFailedPrecondition) << no_store.status();

  auto store = server::StateStore::Open((checkpoints_.path / "states").string(), 4, {});
  ASSERT_TRUE(store.ok()) << store.status();
  testing::InProcessServer stateful({.response_chunk_bytes = 1024, .state_store = store->get()},
                                    kChunkBytes);
  ASSERT_TRUE(stateful.started());
  auto c = *rc::Client::Create({.target = stateful.target(), .chunk_bytes = kChunkBytes});
  ASSERT_TRUE(c->CreateHead("lm", rc::InitSpec{.vocab_size = kVocab,
                                               .hidden_size = kHidden,
                                               .bias = true,
                                               .seed = 5,
                                               .init_std = 1.0 / std::sqrt(kHidden)})
                  .ok());
  core::Head& head = testing::HeadOf(**stateful.registry().Get("lm"));
  const rc::OptimizerStepOptions adamw{.optimizer = rc::AdamW{.lr = 0.05, .weight_decay = 0.1},
                                       .zero_gradients = true};
  int micro_batch = 0;
  auto step = [&](const core::TokenBatch& batch) {
    const rc::StepSpec spec{
        .head_id = "lm",
        .gradient_id = rc::GradientId{.trainer = "t", .micro_batch = micro_batch++}};
    ASSERT_TRUE(c->ForwardBackward(spec, InputsFor(batch)).ok());
    ASSERT_TRUE(c->OptimizerStep("lm", adamw).ok());
  };
  step(batch_);  // version 1: AdamW's moments are not zero any more
  const core::TokenBatch second =
      reference::MakeTestBatch(head, kRows, "cross_entropy", core::Reduction::kMean, 11);

  auto saved = c->SaveHeadState("lm");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_FALSE(saved->state_id.empty());
  EXPECT_EQ(saved->weight_version, 1);
  const torch::Tensor w1 = head.weight().clone(), b1 = head.bias().clone();

  step(second);  // version 2 from the saved state
  const torch::Tensor w2 = head.weight().clone(), b2 = head.bias().clone();
  ASSERT_FALSE(torch::equal(w2, w1));
  // A micro-batch left in the window: the restore zeroes it.
  ASSERT_TRUE(c->ForwardBackward({.head_id = "lm", .gradient_id = rc::GradientId{.trainer = "u"}},
                                 InputsFor(batch_))
                  .ok());

  auto restored = c->RestoreHeadState("lm", saved->state_id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->weight_version, 1);
  EXPECT_EQ(restored->accumulated_micro_batches, 0);
  EXPECT_EQ(restored->state_id, saved->state_id);
  EXPECT_TRUE(torch::equal(head.weight(), w1));
  EXPECT_TRUE(torch::equal(head.bias(), b1));
  EXPECT_EQ(reference::MaxAbs(head.grads().weight), 0.0);
  EXPECT_EQ(reference::MaxAbs(head.grads().bias), 0.0);

  // The optimizer state: the same micro-batch and step again give version 2's update (to 1e-5
  // of it: the server's fp32 dW may sum in another order from run to run, ~1e-7), which a fresh
  // AdamW state (moments zero, step 1) from the restored weights misses by far more.
  const torch::Tensor update = w2 - w1;
  step(second);
  EXPECT_LE(reference::RelativeError(head.weight() - w1, update), 1e-5);
  EXPECT_LE(reference::RelativeError(head.bias() - b1, b2 - b1), 1e-5);
  ASSERT_TRUE(c->UploadHead("fresh", w1, b1).ok());
  ASSERT_TRUE(
      c->ForwardBackward({.head_id = "fresh", .gradient_id = rc::GradientId{.trainer = "t"}},
                         InputsFor(second))
          .ok());
  ASSERT_TRUE(c->OptimizerStep("fresh", adamw).ok());
  EXPECT_GT(reference::RelativeError(
                testing::HeadOf(**stateful.registry().Get("fresh")).weight() - w1, update),
            0.1);

  // Errors: an unknown state (well-formed id), a malformed id, an unknown head.
  const auto unknown = c->RestoreHeadState("lm", store->get()->NewStateId());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  const auto malformed = c->RestoreHeadState("lm", "../x");
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument) << malformed.status();
  EXPECT_TRUE(absl::StartsWith(malformed.status().message(), "state_id: ")) << malformed.status();
  const auto no_head = c->SaveHeadState("nope");
  EXPECT_EQ(no_head.status().code(), absl::StatusCode::kNotFound) << no_head.status();
  EXPECT_TRUE(absl::StrContains(no_head.status().message(), "nope")) << no_head.status();
  // Nothing the refusals touched.
  EXPECT_EQ(c->DescribeHead("lm")->weight_version, 2);
}

TEST_F(ClientFilesTest, SaveWeightsThenCreateHeadFromTheFile) {
  const std::string path = "lm.safetensors";  // relative to the server's checkpoint directory
  auto bytes = client_->SaveWeights("lm", path, "model.embed_tokens.weight");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_GT(*bytes, kVocab * kHidden * 4);
  EXPECT_TRUE(std::filesystem::exists(checkpoints_.path / path));
  auto info =
      client_->CreateHead("copy", rc::SafetensorsSource{.path = path,
                                                        .weight_name = "model.embed_tokens.weight",
                                                        .bias_name = "lm_head.bias",
                                                        .dtype = torch::kBFloat16});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dtype, torch::kBFloat16);
  auto copy = client_->ExportWeights("copy");
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(torch::equal(copy->weight, Head().weight().to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(copy->bias, Head().bias().to(torch::kBFloat16)));

  const auto missing = client_->CreateHead("other", rc::SafetensorsSource{.path = path});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "safetensors.path: \"lm.safetensors\": tensor \"lm_head.weight\": not in the "
            "checkpoint (it has 2 tensors)");
  const auto outside = client_->SaveWeights("lm", "../lm.safetensors");
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outside.status().message(),
            "path: expected a path inside the checkpoint directory (no \"..\"); got "
            "\"../lm.safetensors\"");
}

}  // namespace
}  // namespace remotehead
