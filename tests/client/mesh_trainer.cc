// One trainer of tests/python/test_mesh_eviction.py's run, through the C++ client's RemoteHead:
// the loop of that file's train() (its `loop(t)`), for trainer `--rank` of `--world`.
//
//   remotehead-mesh-trainer --fronts=HOST:PORT,HOST:PORT --rank=T [--world=4] [--head=h]
//                           [--barrier_dir=DIR] [--steps=6] [--micro_batches=3]
//                           [--kill_step=2] [--heal_step=-1] [--rows=10] [--hidden=16]
//                           [--vocab=40]
//
// Trainer T's client dials fronts[T mod R]; its RemoteHead is trainer "run", rank T of --world
// (synchronous steps), reduction sum. Each step adds --micro_batches micro-batches — micro-batch
// mb of step s is torch::Generator seeded 1000·T + 10·s + mb, randn(rows, hidden) then
// randint(0, vocab, (rows,)): the numbers Python's torch.Generator().manual_seed(…) gives on the
// CPU — then takes AdamW(lr 0.05, betas 0.9 / 0.999, eps 1e-6, weight decay 0.01).
// --barrier_dir: after adding micro-batch 0 of step --kill_step, the trainer writes
// DIR/at-kill-T and waits (up to 120 s) for DIR/resume to exist (the test kills a replica
// in between); likewise after micro-batch 0 of step --heal_step (when >= 0), DIR/at-heal-T and
// DIR/resume-heal (the test restarts the killed process and waits for its heal). At the end it
// prints one line, JSON: {"rank", "moves", "replays", "replica",
// "weight_version"} (its client's moves and replays). Exit code: 0 when every step ran, 1 on any
// error (printed), 2 on bad usage.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "remotehead/client/client.h"
#include "remotehead/client/remote_head.h"

namespace {

namespace rc = remotehead::client;

struct Flags {
  std::vector<std::string> fronts;
  std::string head = "h";
  std::string barrier_dir;
  int64_t rank = -1, world = 4, steps = 6, micro_batches = 3, kill_step = 2, heal_step = -1;
  int64_t rows = 10, hidden = 16, vocab = 40;
};

// The flags, or the reason they are refused.
Flags Parse(int argc, char** argv) {
  std::map<std::string, std::string> given;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      throw std::invalid_argument(absl::StrCat("expected --name=value; got ", arg));
    }
    given[arg.substr(2, eq - 2)] = arg.substr(eq + 1);
  }
  Flags flags;
  const std::map<std::string, int64_t*> numbers = {
      {"rank", &flags.rank},           {"world", &flags.world},
      {"steps", &flags.steps},         {"micro_batches", &flags.micro_batches},
      {"kill_step", &flags.kill_step}, {"heal_step", &flags.heal_step},
      {"rows", &flags.rows},           {"hidden", &flags.hidden},
      {"vocab", &flags.vocab}};
  for (const auto& [name, value] : given) {
    if (name == "fronts") {
      flags.fronts = absl::StrSplit(value, ',');
    } else if (name == "head") {
      flags.head = value;
    } else if (name == "barrier_dir") {
      flags.barrier_dir = value;
    } else if (!numbers.contains(name) || !absl::SimpleAtoi(value, numbers.at(name))) {
      throw std::invalid_argument(absl::StrCat("--", name, ": unknown, or not a number: ", value));
    }
  }
  if (flags.fronts.empty() || flags.rank < 0 || flags.rank >= flags.world) {
    throw std::invalid_argument("expected --fronts=A,B… and --rank in [0, --world)");
  }
  return flags;
}

// Micro-batch `mb` of step `step` of trainer `t`, as test_mesh_eviction.py's micro_batch().
std::pair<torch::Tensor, torch::Tensor> MicroBatch(const Flags& f, int64_t step, int64_t mb) {
  const uint64_t seed = static_cast<uint64_t>(1000 * f.rank + 10 * step + mb);
  at::Generator generator = at::detail::createCPUGenerator(seed);
  torch::Tensor hidden = torch::randn({f.rows, f.hidden}, generator);
  torch::Tensor labels =
      torch::randint(0, f.vocab, {f.rows}, generator, torch::TensorOptions(torch::kLong));
  return {hidden, labels};
}

// Says this trainer reached the point `point` ("kill", "heal"), then waits for the test's word
// to go on (`resume`).
void Barrier(const Flags& f, const std::string& point, const std::string& resume) {
  const std::filesystem::path dir(f.barrier_dir);
  std::ofstream(dir / absl::StrCat("at-", point, "-", f.rank)).close();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!std::filesystem::exists(dir / resume)) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(absl::StrCat(f.barrier_dir, "/", resume, ": not there after 120 s"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int Train(const Flags& f) {
  rc::ClientOptions options{.fronts = f.fronts, .rank = static_cast<int>(f.rank)};
  options.retry.initial_backoff = std::chrono::milliseconds(50);
  options.retry.max_backoff = std::chrono::milliseconds(500);
  absl::StatusOr<std::shared_ptr<rc::Client>> client = rc::Client::Create(options);
  if (!client.ok()) throw rc::StatusError(client.status());
  rc::StepSpec spec{.head_id = f.head, .reduction = rc::Reduction::kSum};
  spec.gradient_id = rc::GradientId{.trainer = "run"};
  absl::StatusOr<rc::RemoteHead> head = rc::RemoteHead::Attach(
      *client, spec, {.rank = static_cast<int>(f.rank), .world_size = static_cast<int>(f.world)});
  if (!head.ok()) throw rc::StatusError(head.status());
  for (int64_t step = 0; step < f.steps; ++step) {
    for (int64_t mb = 0; mb < f.micro_batches; ++mb) {
      auto [hidden, labels] = MicroBatch(f, step, mb);
      hidden.requires_grad_(true);
      head->loss(hidden, labels).backward();
      if (!f.barrier_dir.empty() && step == f.kill_step && mb == 0) Barrier(f, "kill", "resume");
      if (!f.barrier_dir.empty() && step == f.heal_step && mb == 0) {
        Barrier(f, "heal", "resume-heal");
      }
    }
    const absl::StatusOr<rc::HeadInfo> info = head->OptimizerStep(
        {.optimizer =
             rc::AdamW{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-6, .weight_decay = 0.01},
         .zero_gradients = true});
    if (!info.ok()) throw rc::StatusError(info.status());
  }
  const rc::ClientStats stats = (*client)->stats();
  std::cout << "{\"rank\": " << f.rank << ", \"moves\": " << stats.moves
            << ", \"replays\": " << stats.replays << ", \"replica\": " << (*client)->replica()
            << ", \"weight_version\": " << head->info().weight_version << "}" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  try {
    flags = Parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << argv[0] << ": " << e.what() << "\n";
    return 2;
  }
  try {
    return Train(flags);
  } catch (const std::exception& e) {
    std::cerr << "remotehead-mesh-trainer rank " << flags.rank << ": " << e.what() << std::endl;
    return 1;
  }
}
