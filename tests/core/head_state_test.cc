// A head's saved training state: encoded and decoded it continues training bit-identically
// (weights, AdamW moments, step count, version); any truncation or corruption is DATA_LOSS
// naming the file, and nothing is half-loaded.
#include "remotehead/core/head_state.h"

#include <gtest/gtest.h>

#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"

namespace remotehead::core {
namespace {

std::unique_ptr<Head> NewHead(uint64_t seed) {
  auto head =
      Head::Initialize({.vocab_size = 40, .hidden_size = 8, .bias = true, .seed = seed}, {});
  EXPECT_TRUE(head.ok()) << head.status();
  return *std::move(head);
}

// k AdamW steps with a gradient that depends on the step, so the moments matter.
void Train(Head& head, OptimizerState* state, int first, int steps) {
  for (int i = first; i < first + steps; ++i) {
    head.grads().weight.copy_(torch::sin(head.weight() * (i + 1)));
    head.grads().bias.copy_(torch::cos(head.bias() + i));
    ASSERT_TRUE(AdamWStep(head, {.lr = 1e-2, .weight_decay = 0.1}, 1.0, state).ok());
  }
}

TEST(HeadState, ASavedStateContinuesTrainingBitIdentically) {
  std::unique_ptr<Head> head = NewHead(1);
  OptimizerState optimizer;
  Train(*head, &optimizer, 0, 3);
  const HeadState saved = CaptureHeadState("lm", "s1", *head, optimizer);
  auto bytes = EncodeHeadState(saved, {});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto decoded = DecodeHeadState(*bytes, "/state/lm/s1.safetensors", {});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->head_id, "lm");
  EXPECT_EQ(decoded->state_id, "s1");
  EXPECT_EQ(decoded->weight_version, 3);
  EXPECT_EQ(decoded->optimizer.kind, "adamw");
  EXPECT_EQ(decoded->optimizer.steps, 3);
  EXPECT_EQ(decoded->optimizer.hyper_parameters.at("lr"), 1e-2);
  EXPECT_EQ(decoded->optimizer.hyper_parameters.at("weight_decay"), 0.1);

  // Another head (other weights) put back to the saved state, then both train on.
  std::unique_ptr<Head> restored = NewHead(2);
  OptimizerState restored_optimizer;
  ASSERT_TRUE(ApplyHeadState(*decoded, restored.get(), &restored_optimizer).ok());
  EXPECT_EQ(restored->version(), 3);
  Train(*head, &optimizer, 3, 2);
  Train(*restored, &restored_optimizer, 3, 2);
  EXPECT_TRUE(torch::equal(restored->weight(), head->weight()));
  EXPECT_TRUE(torch::equal(restored->bias(), head->bias()));
  EXPECT_TRUE(torch::equal(restored_optimizer.weight_buf2, optimizer.weight_buf2));
  EXPECT_EQ(restored->version(), head->version());
}

TEST(HeadState, EveryTruncationAndBitFlipIsDataLossNamingTheFile) {
  std::unique_ptr<Head> head = NewHead(3);
  OptimizerState optimizer;
  Train(*head, &optimizer, 0, 1);
  auto bytes = EncodeHeadState(CaptureHeadState("lm", "s1", *head, optimizer), {});
  ASSERT_TRUE(bytes.ok());
  const std::string source = "/state/lm/s1.safetensors";
  std::vector<std::string> damaged;
  for (size_t keep :
       {size_t{0}, size_t{5}, size_t{8}, size_t{100}, bytes->size() / 2, bytes->size() - 1}) {
    damaged.push_back(bytes->substr(0, keep));
  }
  for (size_t at : {size_t{0}, size_t{3}, size_t{20}, bytes->size() / 2, bytes->size() - 1}) {
    std::string flipped = *bytes;
    flipped[at] ^= 0x10;
    damaged.push_back(flipped);
  }
  for (const std::string& d : damaged) {
    auto decoded = DecodeHeadState(d, source, {});
    ASSERT_FALSE(decoded.ok()) << "a damaged file of " << d.size() << " bytes was loaded";
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
    EXPECT_EQ(decoded.status().message().find(source), 0u) << decoded.status();
    EXPECT_NE(decoded.status().message().find("was not loaded"), std::string::npos);
  }
}

TEST(HeadState, AStateOfAnotherShapeChangesNothing) {
  std::unique_ptr<Head> head = NewHead(4);
  OptimizerState optimizer;
  auto other = Head::Initialize({.vocab_size = 41, .hidden_size = 8, .bias = true}, {});
  ASSERT_TRUE(other.ok());
  const HeadState state = CaptureHeadState("lm", "s1", **other, {});
  const torch::Tensor before = head->weight().clone();
  const absl::Status s = ApplyHeadState(state, head.get(), &optimizer);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(torch::equal(head->weight(), before));
  EXPECT_EQ(head->version(), 0);
}

// A head group's rank saves its shard: the file says which rows of which head they are, and a
// rank restores only its own rows of a head of the same size.
// A frozen head (a distillation teacher) is saved and restored frozen; a state saved before
// frozen heads existed (no "frozen" metadata) decodes as not frozen.
TEST(HeadState, AFrozenHeadIsRestoredFrozen) {
  std::unique_ptr<Head> head = NewHead(6);
  for (const bool frozen : {true, false}) {
    HeadState state = CaptureHeadState("teacher", "s1", *head, {});
    state.frozen = frozen;
    auto bytes = EncodeHeadState(state, {});
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto decoded = DecodeHeadState(*bytes, "/state/teacher/s1.safetensors", {});
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->frozen, frozen);
  }
}

TEST(HeadState, AShardSaysWhichRowsItHoldsAndOnlyThoseAreRestored) {
  std::unique_ptr<Head> head = NewHead(5);  // rows [40, 80) of a head of 120
  HeadState state = CaptureHeadState("lm", "s1", *head, {});
  state.vocab_offset = 40;
  state.vocab_size = 120;
  auto bytes = EncodeHeadState(state, {});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto decoded = DecodeHeadState(*bytes, "/state/rank-1/lm/s1.safetensors", {});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->vocab_offset, 40);
  EXPECT_EQ(decoded->vocab_size, 120);
  EXPECT_TRUE(CheckHeadStateRows(*decoded, 120, 40).ok());
  for (const auto& [size, offset] : {std::pair{120, 0}, std::pair{121, 40}, std::pair{40, 0}}) {
    const absl::Status s = CheckHeadStateRows(*decoded, size, offset);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("got the state of rows [40, 80) of a head of 120 rows"),
              std::string::npos)
        << s;
  }
  // One server's state: the whole head.
  const HeadState whole = CaptureHeadState("lm", "s2", *head, {});
  EXPECT_TRUE(CheckHeadStateRows(whole, 40, 0).ok());
  EXPECT_FALSE(CheckHeadStateRows(whole, 80, 0).ok());
  // Rows outside the head they claim to be a shard of: never decoded.
  state.vocab_size = 60;
  auto outside = EncodeHeadState(state, {});
  ASSERT_TRUE(outside.ok());
  const auto refused = DecodeHeadState(*outside, "f", {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
}

}  // namespace
}  // namespace remotehead::core
