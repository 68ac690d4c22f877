// The sampler's kept set: which tokens a top-k / top-p / min-p sampler can draw, and the
// log-probability of a token under the truncated, renormalised distribution it draws from. One
// home for the rule, used by the server's own draw ("sample", sampling.h) and by the functions
// that score a drawn token ("token_logprobs", and the GRPO family through TargetLogProb and
// SamplerParams), so that a token "sample" draws is in the set token_logprobs keeps and its
// log-probability is the one the draw used, by construction.
//
// For each row of logits z (already scaled, soft-capped and divided by the temperature) the kept
// set is K = {j : z_j >= τ}, one threshold τ per row: a token that ties with the boundary token
// is kept (Hugging Face's top-p breaks such ties by the sort's order instead; on continuous
// logits the two never differ). τ is the largest of the thresholds of the active truncations,
// applied in Hugging Face's order (generate()'s warpers, and the server's "sample"):
//   top_k  (> 0): keep the k largest values: τ_k = the k-th largest value (ties with it kept);
//   top_p  (< 1): over the distribution renormalised on what top-k kept, keep the smallest set of
//                 largest tokens whose probability reaches top_p (at least one): with the values
//                 v_1 >= v_2 >= … of that set and C_m = Σ_{i<=m} p(v_i), τ_p = v_m for the first
//                 m with C_m >= top_p (the whole set if rounding leaves every C_m below top_p);
//   min_p  (> 0): keep p_j >= min_p · p_max, i.e. z_j >= max_j z_j + log(min_p). min-p is a
//                 threshold relative to the maximum, which no truncation removes: it commutes with
//                 top-k, but not with top-p, whose renormalisation depends on what was kept before.
// vLLM applies min-p first (its sampler: min-p, then top-k and top-p); min_p_first = 1 gives that
// order (top-p then renormalises over what min-p and top-k kept), so both are exact.
//
// Rounding. τ_k and τ_p are values of z (exact). min-p's z_max + log(min_p) is formed in float64
// and rounded up to the logits' dtype, so the comparison z_j >= τ is the real-number one.
// top-p's cumulative sums are float64 sums of exp(v_i − lse) with the lse of the logits' dtype:
// the choice of the boundary token can differ from exact arithmetic only where top_p is within
// that lse's rounding (~1e-7 relative in float32) of a cumulative sum C_m (Hugging Face and vLLM
// sum float32 probabilities, further from exact).
//
// Head groups. τ is computed through VocabOps (functions.h) without gathering whole rows: the
// k largest values over the whole vocabulary (VocabOps::LargestValues: each rank's local top-k,
// all-gathered, the top-k of the union) and log-sum-exps. Without top_k, top-p asks for the 64,
// 256, 1024, … largest values until every row's cumulative sum reaches top_p (on peaked language
// model rows, a few hundred values; on flat rows up to the whole vocabulary).
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

inline constexpr char kTopKParam[] = "top_k";
inline constexpr char kTopPParam[] = "top_p";
inline constexpr char kMinPParam[] = "min_p";
inline constexpr char kMinPFirstParam[] = "min_p_first";

// top_k (0 = off), top_p (1 = off), min_p (0 = off), min_p_first (0: Hugging Face's order, 1:
// vLLM's): the params of "sample" and of every function that scores a sampled token.
std::vector<ParamSpec> SamplerParams();
// top_k a whole number, min_p_first 0 or 1 (the ranges are the ParamSpecs'). Params without the
// sampler's are accepted.
absl::Status ValidateSamplerParams(const FunctionParams& params);
// Whether `params` truncate the distribution: top_k > 0, top_p < 1 or min_p > 0 (false when
// they hold no sampler params).
bool SamplerActive(const FunctionParams& params);

// Each row's threshold τ ([n], z's dtype, detached): the kept set is {j : z_ij >= τ_i}. With no
// truncation active, −inf. `z` [n, columns]: a whole head's logits, or a shard's with `vocab`
// its ShardVocabOps (a collective per VocabOps call, the same calls on every rank).
torch::Tensor KeptThreshold(const torch::Tensor& z, const FunctionParams& params,
                            const VocabOps& vocab);

struct SampledLogProb {
  // [n]: log p'(t) = z_t − log Σ_{j∈K} exp(z_j) for a target in the kept set; −inf (probability
  // 0) for a target outside it, with a zero gradient. Differentiable through the kept logits (τ
  // is a constant).
  torch::Tensor logprob;
  torch::Tensor kept;  // [n] detached, the logits' dtype: 1 where the target is in K, else 0
};

// The targets' log-probabilities under the sampler's distribution when in.params hold an active
// sampler (SamplerActive), else under the full softmax with `kept` all ones: then `logprob` is
// in.vocab->LogSoftmaxAtTarget(in.logits, in.targets), bit for bit.
SampledLogProb TargetLogProbAndKept(const ChunkInputs& in);
// TargetLogProbAndKept(in).logprob: the log-probability a policy-gradient function scores.
torch::Tensor TargetLogProb(const ChunkInputs& in);

// fp32 [n, columns] buffers that a per-token function's block keeps alive at its peak beyond
// its own workspace when `params` hold an active sampler (else 0): the mask and the masked
// logits, and the largest values with their sort and cumulative sums (top_k of them, or up to
// whole rows for top-p without top-k). `columns`: the block's (a shard's on a head group);
// `ranks`: the group's size (1 on one server), whose candidates a shard gathers.
double SamplerWorkspaceBuffers(const FunctionParams& params, int64_t columns, int64_t ranks);

}  // namespace remotehead::core
