// The head commands' one codec (translate/head_commands.h): what the front logs is what every
// other rank decodes and applies (replication/apply_head_command.h). Every alternative of
// HeadCommand has a sample here with every field set away from its default; each must come back
// from the log as the same alternative whose encoding is byte for byte the front's, with its
// tensors' shapes and dtypes. What is not a head command is refused, never applied.
#include "translate/head_commands.h"

#include <gtest/gtest.h>

#include <set>

#include "translate/group_commands.h"

namespace remotehead::server {
namespace {

namespace hc = head_command;

OptimizerStepSpec AdamWSpec() {
  return {.optimizer =
              core::AdamWOptions{
                  .lr = 0.25, .beta1 = 0.5, .beta2 = 0.75, .eps = 1e-3, .weight_decay = 0.125},
          .grad_scale = 0.5,
          .zero_gradients = true,
          .expected_weight_version = 7};
}

std::vector<HeadCommand> Samples() {
  const HeadTraits traits{.frozen = true, .grad_dtype = torch::kBFloat16};
  const torch::Tensor weight = torch::zeros({5, 3}, torch::kBFloat16);
  const torch::Tensor ids = torch::tensor({4, 1}, torch::kInt64);
  hc::EmbeddingGradient gradient{
      .id = "e", .ids = ids, .rows = torch::zeros({2, 3}), .expected_weight_version = 3};
  gradient.key = {.trainer = "t", .step = 9, .micro_batch = 2, .use = GradientUse::kEmbedding};
  return {
      hc::CreateFromSeed{.id = "a",
                         .init = {.vocab_size = 11,
                                  .hidden_size = 4,
                                  .dtype = torch::kBFloat16,
                                  .bias = true,
                                  .seed = 5,
                                  .init_std = 0.5},
                         .traits = traits},
      hc::CreateFromSafetensors{.id = "b",
                                .source = {.path = "p.safetensors",
                                           .weight_name = "w",
                                           .bias_name = "b",
                                           .dtype = torch::kHalf},
                                .traits = traits},
      hc::Upload{.id = "c",
                 .weight = weight,
                 .bias = torch::zeros({5}, torch::kBFloat16),
                 .replace = true,
                 .traits = traits},
      hc::Drop{.id = "d"},
      hc::UndoCreate{.id = "u"},
      hc::ZeroGradients{.id = "z"},
      hc::OptimizerStep{.id = "o", .spec = AdamWSpec()},
      hc::ReduceStep{
          .id = "r",
          .spec = {.optimizer =
                       core::SgdOptions{.lr = 0.5, .momentum = 0.25, .weight_decay = 0.125},
                   .grad_scale = 2.0},
          .attempt = "0123456789abcdef0123456789abcdef"},
      hc::Heal{.epoch = 3, .replica = 1},
      hc::SaveState{.id = "s", .state_id = "state-1"},
      hc::RestoreState{.id = "s", .state_id = "state-2", .check_only = true},
      hc::Gather{.id = "g", .dtype = torch::kFloat, .gradients = true},
      hc::EmbeddingLookup{.id = "l", .ids = ids, .dtype = torch::kBFloat16},
      gradient,
  };
}

TEST(HeadCommands, EveryAlternativeHasASample) {
  std::set<size_t> seen;
  for (const HeadCommand& c : Samples()) seen.insert(c.index());
  EXPECT_EQ(seen.size(), std::variant_size_v<HeadCommand>);
}

TEST(HeadCommands, EachComesBackFromTheLogAsTheFrontLoggedIt) {
  for (const HeadCommand& sample : Samples()) {
    const v1::GroupCommand logged = Encode(sample);
    SCOPED_TRACE(CommandName(logged));
    ASSERT_TRUE(IsHeadCommand(logged));
    // Through the log's bytes, as a follower reads them.
    v1::GroupCommand read;
    ASSERT_TRUE(read.ParseFromString(ToLog(logged).bytes));
    const absl::StatusOr<HeadCommand> decoded = DecodeHeadCommand(read, torch::kCPU);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->index(), sample.index());
    EXPECT_EQ(Encode(*decoded).SerializeAsString(), logged.SerializeAsString());
  }
}

TEST(HeadCommands, TensorsComeBackAsShapesToShareInto) {
  const torch::Tensor rows = torch::zeros({2, 3}, torch::kFloat);
  hc::EmbeddingGradient sent{.id = "e", .ids = torch::tensor({4, 1}), .rows = rows};
  sent.key = {.trainer = "t", .step = 1, .micro_batch = 0, .use = GradientUse::kEmbedding};
  const absl::StatusOr<HeadCommand> decoded = DecodeHeadCommand(Encode(sent), torch::kCPU);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const auto& got = std::get<hc::EmbeddingGradient>(*decoded);
  EXPECT_EQ(got.ids.sizes(), sent.ids.sizes());
  EXPECT_EQ(got.ids.scalar_type(), torch::kInt64);
  EXPECT_EQ(got.rows.sizes(), rows.sizes());
  EXPECT_EQ(got.rows.scalar_type(), torch::kFloat);
  EXPECT_EQ(got.key, sent.key);
  EXPECT_FALSE(got.expected_weight_version.has_value());
  // The field a version mismatch names is the caller's on the front, the header's elsewhere.
  EXPECT_EQ(got.version_field, "header.expected_weight_version");
}

TEST(HeadCommands, WhatIsNoHeadCommandIsRefused) {
  v1::GroupCommand drain;
  drain.mutable_drain();
  v1::GroupCommand step;
  step.mutable_step_batch();
  v1::GroupCommand front;
  front.mutable_front()->set_address("127.0.0.1:1");
  for (const v1::GroupCommand& entry : {drain, step, front, MeshGradientsCommand("h")}) {
    SCOPED_TRACE(CommandName(entry));
    EXPECT_FALSE(IsHeadCommand(entry));
    const absl::StatusOr<HeadCommand> decoded = DecodeHeadCommand(entry, torch::kCPU);
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInternal);
    EXPECT_NE(decoded.status().message().find("is not a head operation"), std::string::npos);
  }
}

}  // namespace
}  // namespace remotehead::server
