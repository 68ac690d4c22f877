#include "remotehead/core/sampling.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "remotehead/core/sampler_kept_set.h"
#include "vocab_ops.h"

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

}  // namespace

std::vector<ParamSpec> SamplingParams() {
  std::vector<ParamSpec> params = {
      {"greedy", 0.0, 0.0, 1.0, "1: the most likely token (argmax); 0: drawn at random"}};
  for (ParamSpec& p : SamplerParams()) params.push_back(std::move(p));
  params.push_back({"seed", 0.0, 0.0, kMaxExactInteger, "row r of the request draws with seed + r"});
  return params;
}

absl::Status ValidateSamplingParams(const FunctionParams& params, const AuxTensors&, bool) {
  const double greedy = params.at("greedy");
  if (greedy != 0.0 && greedy != 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("params[\"greedy\"]: expected 0 or 1; got ", greedy));
  }
  if (absl::Status s = ValidateSamplerParams(params); !s.ok()) return s;
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
    // The kept set of sampler_kept_set.h, the one token_logprobs scores a token against.
    torch::Tensor scores = logits;
    if (SamplerActive(params)) {
      const torch::Tensor tau = KeptThreshold(logits, params, LocalVocabOps(logits.size(1)));
      scores = logits.masked_fill(logits < tau.unsqueeze(1), -std::numeric_limits<double>::infinity());
    }
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
