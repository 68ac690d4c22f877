#include "remotehead/core/sampling.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace remotehead::core {
namespace {

constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53: doubles hold every integer below

absl::Status CheckWhole(const FunctionParams& params, const char* name) {
  const double v = params.at(name);
  if (v != std::floor(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("params[\"", name, "\"]: expected a whole number; got ", v));
  }
  return absl::OkStatus();
}

// Hugging Face's TopKLogitsWarper: tokens below the k-th largest score get -inf.
void KeepTopK(torch::Tensor& scores, int64_t k) {
  if (k <= 0 || k >= scores.size(1)) return;
  const torch::Tensor kth = std::get<0>(scores.topk(k, 1)).narrow(1, k - 1, 1);
  scores.masked_fill_(scores < kth, -std::numeric_limits<float>::infinity());
}

// Hugging Face's TopPLogitsWarper (min_tokens_to_keep = 1): in ascending order, the tokens whose
// cumulative probability stays <= 1 - top_p are removed; the largest is always kept.
void KeepTopP(torch::Tensor& scores, double top_p) {
  if (top_p >= 1.0) return;
  const auto [sorted, indices] = scores.sort(1, /*descending=*/false);
  torch::Tensor remove = sorted.softmax(1).cumsum(1) <= (1.0 - top_p);
  remove.narrow(1, scores.size(1) - 1, 1).fill_(false);
  scores.masked_fill_(remove.scatter(1, indices, remove), -std::numeric_limits<float>::infinity());
}

}  // namespace

std::vector<ParamSpec> SamplingParams() {
  return {
      {"greedy", 0.0, 0.0, 1.0, "1: the most likely token (argmax); 0: drawn at random"},
      {"top_k", 0.0, 0.0, 2147483647.0, "if > 0: only the k most likely tokens are drawn"},
      {"top_p", 1.0, 1e-9, 1.0, "nucleus: the smallest set of tokens with probability >= top_p"},
      {"seed", 0.0, 0.0, kMaxExactInteger, "row r of the request draws with seed + r"},
  };
}

absl::Status ValidateSamplingParams(const FunctionParams& params, const AuxTensors&, bool) {
  const double greedy = params.at("greedy");
  if (greedy != 0.0 && greedy != 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("params[\"greedy\"]: expected 0 or 1; got ", greedy));
  }
  if (absl::Status s = CheckWhole(params, "top_k"); !s.ok()) return s;
  return CheckWhole(params, "seed");
}

TransformFunction SampleFunction() {
  return {.name = "sample",
          .help = "a token drawn from each row's distribution, with its log-probability",
          .needs_targets = false,
          .params = SamplingParams(),
          .workspace_logit_buffers = kSamplingWorkspaceBuffers,
          .output = OutputKind::kSample,
          .validate = ValidateSamplingParams};
}

SampledTokens SampleTokens(const torch::Tensor& logits, const FunctionParams& params,
                           int64_t first_row) {
  torch::NoGradGuard no_grad;
  const int64_t n = logits.size(0);
  SampledTokens out;
  if (params.at("greedy") != 0.0) {
    out.token_ids = logits.argmax(1);
  } else {
    torch::Tensor scores = logits.clone();
    KeepTopK(scores, static_cast<int64_t>(params.at("top_k")));
    KeepTopP(scores, params.at("top_p"));
    // The draw runs on the CPU with one generator per row: the tokens depend only on the seed
    // and the row, not on the device, the chunking or the other rows.
    const torch::Tensor probs = scores.softmax(1).to(torch::kCPU);
    scores.reset();
    torch::Tensor ids = torch::empty({n}, torch::kLong);
    int64_t* id = ids.data_ptr<int64_t>();
    const auto seed = static_cast<uint64_t>(params.at("seed"));
    for (int64_t i = 0; i < n; ++i) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + first_row + i);
      id[i] = torch::multinomial(probs[i], 1, /*replacement=*/false, gen).item<int64_t>();
    }
    out.token_ids = ids.to(logits.device());
  }
  out.logprobs = logits.log_softmax(1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1);
  return out;
}

}  // namespace remotehead::core
