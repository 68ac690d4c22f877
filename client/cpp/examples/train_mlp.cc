// remotehead-example-trainer: a LibTorch trainer whose LM head lives on a remotehead server.
//
//   remotehead-server --listen 127.0.0.1:50051 &
//   remotehead-example-trainer --server 127.0.0.1:50051 --steps 30
//
// The body (embedding, two linear layers) is trained locally; the head W [V, D] is created on
// the server (from a seed, or uploaded from a local nn::Linear) and trained there by the
// server's optimizer from the dW that every micro-batch's ForwardBackward accumulates. The data
// is synthetic next-token prediction generated in code: each token is followed by a fixed
// successor 90% of the time, so the loss falls from about ln(V) towards the noise floor.
//
// Prints one line per step: "step <i> loss <mean loss over the step's tokens> …".
//
// Data-parallel: run W processes with --world=W and --rank=0 … W-1 (same other flags). Each
// rank builds the same global micro-batches of W × --batch sequences (same seed) and trains on
// sequences r, r+W, r+2W, … of each, so the ranks' shares are disjoint and together the whole
// batch. Every rank adds its dW under its own trainer identity ("example/rank-<r>") and the
// head's optimizer step is the ranks' synchronous step: applied once, when all W asked for it,
// dW averaged over the ranks. Each rank prints its own lines (its loss, its tokens). The body is
// each rank's own: this example has no collective library to average the bodies' gradients as
// DDP would, so only the head is trained on the whole batch.
//
//   for r in 0 1; do remotehead-example-trainer --world=2 --rank=$r & done; wait
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "remotehead/client/client.h"
#include "remotehead/client/remote_head.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "the remotehead server, host:port");
ABSL_FLAG(std::string, head_id, "example-lm", "id of the head created on the server");
ABSL_FLAG(std::string, head_source, "seed",
          "seed: the server initialises the head from --seed; upload: upload a local nn::Linear");
ABSL_FLAG(int64_t, steps, 30, "optimizer steps");
ABSL_FLAG(int64_t, vocab, 512, "vocabulary size V");
ABSL_FLAG(int64_t, hidden, 64, "hidden size D");
ABSL_FLAG(int64_t, batch, 8, "sequences per micro-batch");
ABSL_FLAG(int64_t, seq_len, 32, "tokens per sequence");
ABSL_FLAG(int64_t, micro_batches, 2, "micro-batches per step (gradient accumulation)");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or sgd, for the body and the head");
ABSL_FLAG(double, lr, 1e-2, "learning rate of the body (local)");
ABSL_FLAG(double, head_lr, 1e-2, "learning rate of the head (server-side optimizer)");
ABSL_FLAG(uint64_t, seed, 0, "seed of the data, the body and the head");
ABSL_FLAG(bool, keep_head, false, "leave the head on the server at the end (default: drop it)");
ABSL_FLAG(int32_t, rank, 0, "this trainer's rank among --world data-parallel trainers");
ABSL_FLAG(int32_t, world, 1, "data-parallel trainer processes that train the head together");

namespace {

namespace rc = remotehead::client;

struct BodyImpl : torch::nn::Module {
  BodyImpl(int64_t vocab, int64_t hidden)
      : embedding(register_module("embedding", torch::nn::Embedding(vocab, hidden))),
        fc1(register_module("fc1", torch::nn::Linear(hidden, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))) {}

  torch::Tensor forward(const torch::Tensor& tokens) {
    return fc2(torch::tanh(fc1(embedding(tokens))));
  }

  torch::nn::Embedding embedding;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Body);

// Sequences where each token is followed by successor[token] with probability 0.9 and by a
// uniformly random token otherwise. Returns inputs [B, T] and next-token labels [B, T].
std::pair<torch::Tensor, torch::Tensor> MakeBatch(const torch::Tensor& successor, int64_t batch,
                                                  int64_t seq_len) {
  const int64_t vocab = successor.size(0);
  torch::Tensor tokens = torch::empty({batch, seq_len + 1}, torch::kLong);
  tokens.select(1, 0).copy_(torch::randint(vocab, {batch}, torch::kLong));
  for (int64_t t = 1; t <= seq_len; ++t) {
    const torch::Tensor follow = successor.index_select(0, tokens.select(1, t - 1));
    const torch::Tensor noise = torch::randint(vocab, {batch}, torch::kLong);
    tokens.select(1, t).copy_(torch::where(torch::rand({batch}) < 0.9, follow, noise));
  }
  return {tokens.narrow(1, 0, seq_len), tokens.narrow(1, 1, seq_len)};
}

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "remotehead-example-trainer: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  return 1;
}

int Run() {
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  const int64_t hidden = absl::GetFlag(FLAGS_hidden);
  const std::string head_id = absl::GetFlag(FLAGS_head_id);
  const bool adamw = absl::GetFlag(FLAGS_optimizer) == "adamw";
  if (!adamw && absl::GetFlag(FLAGS_optimizer) != "sgd") {
    return Fail("--optimizer", absl::InvalidArgumentError("expected adamw or sgd"));
  }
  const int world = absl::GetFlag(FLAGS_world);
  const int rank = absl::GetFlag(FLAGS_rank);
  if (world < 1) {
    return Fail("--world", absl::InvalidArgumentError(absl::StrCat("expected >= 1; got ", world)));
  }
  if (rank < 0 || rank >= world) {
    return Fail("--rank", absl::InvalidArgumentError(
                              absl::StrCat("expected in [0, ", world, ") (--world); got ", rank)));
  }
  torch::manual_seed(absl::GetFlag(FLAGS_seed));

  auto client = rc::Client::Create({.target = absl::GetFlag(FLAGS_server)});
  if (!client.ok()) return Fail("client", client.status());

  // The head: initialised on the server, or uploaded from a local layer.
  absl::StatusOr<rc::HeadInfo> created;
  if (absl::GetFlag(FLAGS_head_source) == "upload") {
    torch::nn::Linear local(torch::nn::LinearOptions(hidden, vocab).bias(false));
    torch::nn::init::normal_(local->weight, 0.0, 0.02);
    created = (*client)->UploadHead(head_id, local->weight.detach());
  } else {
    created = (*client)->CreateHead(head_id, rc::InitSpec{.vocab_size = vocab,
                                                          .hidden_size = hidden,
                                                          .seed = absl::GetFlag(FLAGS_seed)});
  }
  // Every rank creates the head from the same seed (or uploads the same layer): whichever comes
  // first makes it, and the others find it there. No rank has to wait for another to create it.
  const bool made_by_another_rank =
      world > 1 && created.status().code() == absl::StatusCode::kAlreadyExists;
  if (!created.ok() && !made_by_another_rank) {
    return Fail("creating head \"" + head_id + "\"", created.status());
  }

  auto head = rc::RemoteHead::Attach(
      *client,
      {.head_id = head_id,
       .gradient_id = rc::GradientId{.trainer = absl::StrCat("example/rank-", rank)}},
      {.rank = rank, .world_size = world});
  if (!head.ok()) return Fail("attaching to the head", head.status());

  Body body(vocab, hidden);
  std::unique_ptr<torch::optim::Optimizer> body_optimizer;
  rc::OptimizerStepOptions head_step{.zero_gradients = true};
  if (adamw) {
    body_optimizer = std::make_unique<torch::optim::AdamW>(
        body->parameters(), torch::optim::AdamWOptions(absl::GetFlag(FLAGS_lr)));
    head_step.optimizer = rc::AdamW{.lr = absl::GetFlag(FLAGS_head_lr)};
  } else {
    body_optimizer = std::make_unique<torch::optim::SGD>(
        body->parameters(), torch::optim::SGDOptions(absl::GetFlag(FLAGS_lr)));
    head_step.optimizer = rc::Sgd{.lr = absl::GetFlag(FLAGS_head_lr)};
  }
  const torch::Tensor successor = torch::randperm(vocab, torch::kLong);

  const int64_t micro_batches = absl::GetFlag(FLAGS_micro_batches);
  // This rank's sequences of a global micro-batch: r, r+W, r+2W, …
  const torch::Tensor mine =
      torch::arange(rank, absl::GetFlag(FLAGS_batch) * world, world, torch::kLong);
  for (int64_t step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
    int64_t global_tokens = 0, tokens = 0;
    for (int64_t m = 0; m < micro_batches; ++m) {
      auto [inputs, labels] =
          MakeBatch(successor, absl::GetFlag(FLAGS_batch) * world, absl::GetFlag(FLAGS_seq_len));
      global_tokens += (labels != -100).sum().item<int64_t>();
      if (world > 1) {
        inputs = inputs.index_select(0, mine);
        labels = labels.index_select(0, mine);
      }
      tokens += (labels != -100).sum().item<int64_t>();
      batches.emplace_back(inputs, labels);
    }
    // Each micro-batch's loss is its token sum over (the whole step's tokens, all ranks') / W,
    // so the sum of all ranks' micro-batches' dW is W × the gradient of the step's mean, which
    // the synchronous step divides by W — exact accumulation (W = 1: the step's tokens).
    const double normalizer = static_cast<double>(global_tokens) / world;
    body_optimizer->zero_grad();
    double step_loss = 0;
    try {
      for (const auto& [inputs, labels] : batches) {
        torch::Tensor loss = head->loss(body->forward(inputs), labels, {.normalizer = normalizer});
        loss.backward();
        step_loss += loss.item<double>();
      }
    } catch (const rc::StatusError& e) {
      return Fail("step " + std::to_string(step), e.status());
    }
    body_optimizer->step();
    auto info = head->OptimizerStep(head_step);
    if (!info.ok()) return Fail("head optimizer step", info.status());
    std::printf("step %lld loss %.6f tokens %lld head_version %lld\n", static_cast<long long>(step),
                step_loss, static_cast<long long>(tokens),
                static_cast<long long>(info->weight_version));
    std::fflush(stdout);
  }
  // Rank 0 drops the head: once the last synchronous step was applied every rank has its
  // answer and is done with the head (one whose answer got lost would find it gone).
  if (!absl::GetFlag(FLAGS_keep_head) && rank == 0) {
    const absl::Status dropped = (*client)->DropHead(head_id);
    if (!dropped.ok()) return Fail("dropping the head", dropped);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains a small MLP body locally against an LM head on a remotehead server");
  absl::ParseCommandLine(argc, argv);
  return Run();
}
