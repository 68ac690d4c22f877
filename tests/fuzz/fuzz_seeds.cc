// Writes the fuzz targets' seed corpora (valid inputs, and a few near-valid ones): run by
// `scripts/fuzz --seeds`, which replaces tests/fuzz/corpus/<target>/seed-* with its output.
// Usage: fuzz_seeds CORPUS_DIR (writes CORPUS_DIR/<target>/seed-<name>).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/head.h"
#include "remotehead/core/head_state.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::fuzz {
namespace {

namespace fs = std::filesystem;

fs::path g_root;

void Save(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream out(dir / ("seed-" + name), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Fail("cannot write " + (dir / name).string());
}

v1::Tensor Wire(const torch::Tensor& t) {
  v1::Tensor w;
  if (!wire::EncodeTensor(t, &w).ok()) Fail("EncodeTensor");
  return w;
}

// ----- fuzz_step_session -----

constexpr uint8_t kNew = 0x80, kQueued = 0x01, kAbandon = 0x04, kStop = 0x08;
constexpr uint8_t kFused = 0x00, kForward = 0x10, kBackward = 0x20;

// The functions some seed has a fused call of (Part records them): every other registered
// per-token function gets one of its own at the end of StepSessionSeeds.
std::set<std::string> g_fused_functions;

std::string Part(uint8_t ctl, const v1::StepRequest& r) {
  if ((ctl & kNew) != 0 && (ctl & (kForward | kBackward)) == 0 && r.has_header()) {
    g_fused_functions.insert(r.header().function().name());
  }
  return std::string(1, static_cast<char>(ctl)) + r.SerializeAsString();
}

v1::StepRequest Header(const std::string& head, const std::string& fn, v1::Reduction reduction,
                       int64_t rows, bool accumulate) {
  v1::StepRequest r;
  v1::StepHeader* h = r.mutable_header();
  h->set_head_id(head);
  h->mutable_function()->set_name(fn);
  h->mutable_function()->set_reduction(reduction);
  h->set_rows(rows);
  h->mutable_chunking()->set_chunk_rows(2);
  if (accumulate) {
    h->set_accumulate_weight_grad(true);
    h->mutable_gradient_id()->set_trainer("fuzz");
    h->mutable_gradient_id()->set_step(1);
  }
  return r;
}

struct RowsSpec {
  torch::ScalarType dtype = torch::kFloat;
  bool weights = false;
  bool grpo = false;
  bool grad_output = false;
  bool hidden = true;
  std::vector<std::string> aux;  // other per-token inputs, each row - 1
};

v1::StepRequest Rows(int64_t offset, int64_t n, const RowsSpec& spec) {
  v1::StepRequest r;
  v1::StepRows* rows = r.mutable_rows();
  rows->set_row_offset(offset);
  const auto range = torch::arange(offset, offset + n, torch::kFloat);
  if (spec.hidden) {
    *rows->mutable_hidden() =
        Wire((torch::arange(n * 4, torch::kFloat).reshape({n, 4}) * 0.1 + offset).to(spec.dtype));
    torch::Tensor targets = (torch::arange(offset, offset + n, torch::kLong) * 5) % 17;
    if (n > 1) targets[1] = -100;  // an ignored token
    *rows->mutable_targets() = Wire(targets);
  }
  if (spec.weights) *rows->mutable_weights() = Wire(range * 0.5 + 1);
  if (spec.grpo) {
    (*rows->mutable_aux())["advantages"] = Wire(range - 1);
    (*rows->mutable_aux())["old_logprobs"] = Wire(torch::full({n}, -2.5));
  }
  for (const std::string& name : spec.aux) (*rows->mutable_aux())[name] = Wire(range - 1);
  if (spec.grad_output) *rows->mutable_grad_output() = Wire(torch::full({n}, 0.25));
  return r;
}

void StepSessionSeeds() {
  const std::string t = "fuzz_step_session";
  // ForwardBackward, mean cross-entropy over valid tokens, 5 rows in two messages.
  {
    v1::StepRequest h = Header("h", "cross_entropy", v1::REDUCTION_MEAN, 5, true);
    h.mutable_header()->set_valid_tokens(4);
    Save(t, "fused-mean",
         JoinParts(
             {Part(kNew | kFused, h), Part(kQueued, Rows(0, 3, {})), Part(0, Rows(3, 2, {}))}));
  }
  // bf16 head, sum, label smoothing, dX as fp32, frozen head.
  {
    v1::StepRequest h = Header("b", "cross_entropy", v1::REDUCTION_SUM, 3, false);
    (*h.mutable_header()->mutable_function()->mutable_params())["label_smoothing"] = 0.1;
    h.mutable_header()->set_grad_hidden_dtype(v1::DTYPE_FLOAT32);
    Save(t, "fused-bf16-sum",
         JoinParts({Part(kNew | kFused, h), Part(0, Rows(0, 3, {.dtype = torch::kBFloat16}))}));
  }
  // Weighted token log-probs with a normalizer and an upstream scale.
  {
    v1::StepRequest h = Header("h", "token_logprobs", v1::REDUCTION_WEIGHTED_SUM, 4, true);
    h.mutable_header()->mutable_function()->set_normalizer(8);
    h.mutable_header()->set_upstream_scale(0.5);
    Save(t, "fused-weighted",
         JoinParts({Part(kNew | kFused, h), Part(0, Rows(0, 4, {.weights = true}))}));
  }
  // GRPO with aux inputs and params, then a replay of the same gradient id.
  {
    v1::StepRequest h = Header("h", "grpo", v1::REDUCTION_SUM, 3, true);
    auto& params = *h.mutable_header()->mutable_function()->mutable_params();
    params["epsilon_low"] = 0.2;
    params["epsilon_high"] = 0.28;
    Save(t, "fused-grpo-replay",
         JoinParts({Part(kNew | kFused, h), Part(0, Rows(0, 3, {.grpo = true})),
                    Part(kNew | kFused, h), Part(0, Rows(0, 3, {.grpo = true}))}));
  }
  // Forward per token, retaining the inputs; then Backward by handle with dL/dy.
  {
    v1::StepRequest f = Header("h", "token_logprobs", v1::REDUCTION_NONE, 4, false);
    f.mutable_header()->set_retain_inputs_seconds(1);
    v1::StepRequest b = Header("h", "token_logprobs", v1::REDUCTION_NONE, 4, true);
    b.mutable_header()->set_inputs_handle("@");
    Save(t, "forward-retain-backward-handle",
         JoinParts({Part(kNew | kForward, f), Part(0, Rows(0, 4, {})), Part(kNew | kBackward, b),
                    Part(kQueued, Rows(0, 2, {.grad_output = true, .hidden = false})),
                    Part(0, Rows(2, 2, {.grad_output = true, .hidden = false}))}));
  }
  // Forward scalar; Backward with a scalar reduction, X re-sent, dL/dloss as upstream_scale.
  {
    v1::StepRequest f = Header("h", "cross_entropy", v1::REDUCTION_SUM, 3, false);
    v1::StepRequest b = Header("h", "cross_entropy", v1::REDUCTION_SUM, 3, true);
    b.mutable_header()->set_upstream_scale(0.5);
    b.mutable_header()->set_expected_weight_version(0);
    Save(t, "forward-then-backward-scalar",
         JoinParts({Part(kNew | kForward, f), Part(0, Rows(0, 3, {})), Part(kNew | kBackward, b),
                    Part(0, Rows(0, 3, {}))}));
  }
  // Backward per token with X re-sent on the bf16 head.
  {
    v1::StepRequest b = Header("b", "entropy", v1::REDUCTION_NONE, 2, true);
    Save(t, "backward-none-bf16",
         JoinParts({Part(kNew | kBackward, b),
                    Part(0, Rows(0, 2, {.dtype = torch::kBFloat16, .grad_output = true}))}));
  }
  // A cancelled request and an abandoned one: nothing may change.
  {
    v1::StepRequest h = Header("h", "cross_entropy", v1::REDUCTION_SUM, 4, true);
    Save(t, "cancelled-and-abandoned",
         JoinParts({Part(kNew | kFused | kStop, h), Part(0, Rows(0, 4, {})), Part(kNew | kFused, h),
                    Part(kAbandon, Rows(0, 2, {}))}));
  }
  // Refusals: rows before the header, a missing row, an unknown head.
  {
    v1::StepRequest h = Header("h", "cross_entropy", v1::REDUCTION_SUM, 4, true);
    v1::StepRequest unknown = Header("nope", "cross_entropy", v1::REDUCTION_SUM, 1, false);
    Save(t, "refusals",
         JoinParts({Part(kNew | kFused, Rows(0, 1, {})), Part(kNew | kFused, h),
                    Part(0, Rows(0, 3, {})), Part(kNew | kForward, unknown)}));
  }
  // Every registered per-token function without a fused seed above (entropy, MSE, sigmoid-sum,
  // ...), fused with a sum, its required aux inputs given.
  for (const core::TransformFunction* fn : core::FunctionRegistry::Builtin().Functions()) {
    if (fn->output != core::OutputKind::kPerToken || g_fused_functions.contains(fn->name)) {
      continue;
    }
    v1::StepRequest h = Header("h", fn->name, v1::REDUCTION_SUM, 2, true);
    Save(t, "fused-" + fn->name,
         JoinParts({Part(kNew | kFused, h), Part(0, Rows(0, 2, {.aux = fn->required_aux}))}));
  }
}

// ----- fuzz_tensor_codec -----

void TensorCodecSeeds() {
  const std::string t = "fuzz_tensor_codec";
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat,  torch::kBFloat16, torch::kHalf,
                                                 torch::kDouble, torch::kLong,     torch::kInt};
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const torch::ScalarType dtype = dtypes[i];
    const torch::Tensor full = (torch::arange(12, torch::kDouble) - 3).reshape({4, 3}).to(dtype);
    // Destination: this dtype, 4 rows of 3, no conversion; two chunks that fill it.
    v1::TensorChunk a, b;
    a.set_row_offset(0);
    *a.mutable_values() = Wire(full.narrow(0, 0, 1));
    b.set_row_offset(1);
    *b.mutable_values() = Wire(full.narrow(0, 1, 3));
    const uint8_t ctl = static_cast<uint8_t>(i | (4 << 3));
    Save(t, "chunks-" + std::string(c10::toString(dtype)),
         JoinParts({std::string(1, static_cast<char>(ctl)) + Wire(full).SerializeAsString(),
                    a.SerializeAsString(), b.SerializeAsString()}));
  }
  // 0-d, empty, 1-D into a 1-D destination with conversion (float32 chunk into int64).
  v1::TensorChunk c;
  *c.mutable_values() = Wire(torch::tensor({1.5f, -2.0f}));
  const uint8_t ctl = static_cast<uint8_t>(4 | (2 << 3) | 0x40 | 0x80);
  Save(t, "scalar-and-convert",
       JoinParts({std::string(1, static_cast<char>(ctl)) +
                      Wire(torch::tensor(3.25, torch::kDouble)).SerializeAsString(),
                  c.SerializeAsString()}));
  Save(t, "empty", std::string(1, '\0') + Wire(torch::zeros({0, 4})).SerializeAsString());
}

// ----- fuzz_safetensors, fuzz_head_state -----

std::string FileBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::unique_ptr<core::Head> TinyHead(torch::ScalarType dtype, bool bias) {
  auto head = core::Head::Initialize(
      {.vocab_size = 5, .hidden_size = 2, .dtype = dtype, .bias = bias, .seed = 3}, {});
  if (!head.ok()) Fail(head.status().ToString());
  return *std::move(head);
}

void CheckpointSeeds(const fs::path& tmp) {
  const std::string t = "fuzz_safetensors";
  const fs::path file = tmp / "seed.safetensors";
  auto dir = core::CheckpointDir::Open(tmp.string());
  if (!dir.ok()) Fail(dir.status().ToString());
  auto head = TinyHead(torch::kFloat, true);
  if (!core::WriteSafetensors(**dir, file.filename().string(),
                              {{"lm_head.weight", head->weight()}, {"lm_head.bias", head->bias()}})
           .ok()) {
    Fail("WriteSafetensors");
  }
  Save(t, "f32-with-bias", FileBytes(file));
  auto bf16 = TinyHead(torch::kBFloat16, false);
  if (!core::WriteSafetensors(
           **dir, file.filename().string(),
           {{"weight", bf16->weight()}, {"model.embed_tokens.weight", bf16->weight()}})
           .ok()) {
    Fail("WriteSafetensors");
  }
  const std::string shard = FileBytes(file);
  Save(t, "bf16-tied", shard);
  const std::string index =
      R"({"metadata": {"total_size": 40}, "weight_map": {"weight": )"
      R"("model-00001-of-00001.safetensors", "lm_head.weight": "model-00001-of-00001.safetensors"}})";
  Save(t, "sharded-index", JoinParts({index, shard}));

  const std::string s = "fuzz_head_state";
  for (const bool bias : {false, true}) {
    auto h = TinyHead(bias ? torch::kFloat : torch::kBFloat16, bias);
    core::OptimizerState optimizer;
    if (bias) {
      optimizer.kind = "adamw";
      optimizer.steps = 2;
      optimizer.hyper_parameters = {{"lr", 1e-3}, {"beta1", 0.9}};
      optimizer.weight_buf1 = torch::full({5, 2}, 0.5);
      optimizer.weight_buf2 = torch::full({5, 2}, 0.25);
      optimizer.bias_buf1 = torch::full({5}, 0.5);
      optimizer.bias_buf2 = torch::full({5}, 0.25);
    }
    const core::HeadState state = core::CaptureHeadState("policy", "state-1", *h, optimizer);
    auto bytes = core::EncodeHeadState(state, {});  // unsealed: the target decodes without a secret
    if (!bytes.ok()) Fail(bytes.status().ToString());
    Save(s, bias ? "adamw-bias" : "bf16-fresh", *bytes);
  }
}

}  // namespace
}  // namespace remotehead::fuzz

int main(int argc, char** argv) {
  using namespace remotehead::fuzz;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  const fs::path tmp = fs::temp_directory_path() / "remotehead-fuzz-seeds";
  fs::create_directories(tmp);
  StepSessionSeeds();
  TensorCodecSeeds();
  CheckpointSeeds(tmp);
  fs::remove_all(tmp);
  return 0;
}

// libFuzzer's runtime (linked for the instrumented libraries' coverage callbacks) may ask for
// it; this program never fuzzes.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }
