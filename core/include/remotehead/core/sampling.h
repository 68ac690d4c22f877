// Drawing the next token on the server ("sample", a generation output of a Forward): what a
// decode step needs from the head without sending [B, V] logits to the trainer. B·D goes up,
// B token ids and their log-probabilities come back.
//
// The same pipeline as Hugging Face's generate(do_sample=True), in its order:
//   z ← softcap·tanh(z / softcap) (if softcap > 0), z ← z / temperature   (the engine's transforms)
//   top-k (keep the k largest; ties with the k-th kept), then top-p (keep the smallest set of
//   largest tokens whose probability reaches top_p, at least one), then min-p (keep
//   p >= min_p·p_max; min_p_first = 1: min-p first, vLLM's order): the kept set K = {z >= τ} of
//   sampler_kept_set.h, the one token_logprobs with the same params scores a token against
//   → probabilities p = softmax(z masked to −inf outside K)
//   token = torch.multinomial(p, 1, generator = a CPU generator seeded with seed + row)
// where `row` is the row's index in the request, so a request draws the same tokens however the
// server chunks it, and a trainer can reproduce a draw locally with
// torch.multinomial(p_row, 1, generator=torch.Generator().manual_seed(seed + row)).
// greedy = 1: token = argmax(z) (the first of equal maxima, as torch.argmax), nothing drawn.
// The log-probability returned is the token's under softmax(z) of the transformed logits, before
// top-k / top-p / min-p: what token_logprobs gives for that token with the same temperature and
// softcap (the policy's log-probability that RL trainers keep as old_logprobs); token_logprobs
// with the sampler's params too gives its log-probability under p, the distribution drawn from.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// The params of "sample" (besides the common temperature and softcap): greedy, the sampler's
// (top_k, top_p, min_p, min_p_first: SamplerParams()), seed.
std::vector<ParamSpec> SamplingParams();
// greedy and min_p_first are 0 or 1; top_k and seed are whole numbers.
absl::Status ValidateSamplingParams(const FunctionParams& params, const AuxTensors& aux,
                                    bool has_targets = false);
// fp32 [n, V] buffers one block of sampling keeps alive at its peak beyond its input logits
// (the sort's values and int64 indices, probabilities, cumulative sums, masks, log-softmax).
inline constexpr double kSamplingWorkspaceBuffers = 8.0;

struct SampledTokens {
  torch::Tensor token_ids;  // [n] int64
  torch::Tensor logprobs;   // [n], the logits' dtype
};

// Draws one token per row of `logits` ([n, V], already soft-capped and divided by the
// temperature) with `params` resolved by the registry; row i is the request's row first_row + i.
SampledTokens SampleTokens(const torch::Tensor& logits, const FunctionParams& params,
                           int64_t first_row);

}  // namespace remotehead::core
