// The C++ client's memory over many steps: a step's responses, received as gRPC hands them over
// (step_frames: RawResponse), are freed once their rows are copied out — a loop of steps keeps no
// received bytes. The heap in use (malloc's, mallinfo2: gRPC's receive buffers are malloc'd) is
// compared before and after 16 steps whose responses come in hundreds of messages each: a leak of
// the received messages keeps every step's dX (2 MiB) and more, 32 MiB in all (34 MB measured
// before the fix); the heap may grow by a quarter of that (fragmentation, gRPC's caches; 2.4 MB
// seen with 4 streams while other tests ran).
#include <gtest/gtest.h>
#include <malloc.h>

#include "absl/strings/str_cat.h"
#include "remotehead/client/client.h"
#include "support/in_process_server.h"

// Its own namespace: the file is compiled in one unit with the target's other files.
namespace remotehead::step_memory_test {
namespace {

namespace rc = client;

constexpr int64_t kVocab = 64;
constexpr int64_t kHidden = 256;
constexpr int64_t kRows = 2048;  // dX: 2 MiB of float32 per step, in 4 KiB responses
constexpr int kSteps = 16;

// Bytes malloc has handed out and not had back (its arenas and its own mappings).
int64_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

class StepMemoryTest : public ::testing::TestWithParam<int> {
 protected:
  testing::InProcessServer server_{{.response_chunk_bytes = 4096}};
};

TEST_P(StepMemoryTest, RepeatedStepsKeepNoReceivedBytes) {
  ASSERT_TRUE(server_.started());
  auto c = rc::Client::Create({.target = server_.target(), .streams = GetParam()});
  ASSERT_TRUE(c.ok()) << c.status();
  rc::Client& client = **c;
  ASSERT_TRUE(
      client.CreateHead("lm", rc::InitSpec{.vocab_size = kVocab, .hidden_size = kHidden}).ok());
  torch::manual_seed(3);
  const rc::StepInputs inputs{.hidden = torch::randn({kRows, kHidden}),
                              .targets = torch::randint(0, kVocab, {kRows}, torch::kLong)};
  const rc::StepSpec fused{.head_id = "lm", .accumulate_weight_grad = false};
  const rc::StepSpec per_token{
      .head_id = "lm", .function = "token_logprobs", .reduction = rc::Reduction::kNone};
  auto steps = [&](int n) {
    for (int i = 0; i < n; ++i) {
      auto fb = client.ForwardBackward(fused, inputs);
      ASSERT_TRUE(fb.ok()) << fb.status();
      ASSERT_EQ(fb->grad_hidden.sizes(), inputs.hidden.sizes());
      auto out = client.Forward(per_token, inputs);
      ASSERT_TRUE(out.ok()) << out.status();
    }
  };
  steps(3);  // gRPC's and the allocator's caches filled
  const int64_t before = HeapInUse();
  steps(kSteps);
  const int64_t grown = HeapInUse() - before;
  const int64_t dx_bytes = kRows * kHidden * 4;
  EXPECT_LT(grown, kSteps * dx_bytes / 4)
      << "the heap grew by " << grown << " bytes over " << kSteps << " steps of " << dx_bytes
      << " bytes of dX each";
}

INSTANTIATE_TEST_SUITE_P(Streams, StepMemoryTest, ::testing::Values(1, 4),
                         [](const auto& info) { return absl::StrCat(info.param, "_streams"); });

}  // namespace
}  // namespace remotehead::step_memory_test
