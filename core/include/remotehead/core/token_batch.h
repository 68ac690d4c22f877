// The per-token inputs of a step: hidden states X [N, D] and, one value per row, the targets,
// the weights and any auxiliary inputs a function names. Everything that slices, joins or moves
// a batch lives here, so the engine and the server's step session cannot disagree on it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// Per-token float inputs beyond the targets, by name (e.g. "advantages" for GRPO).
using AuxTensors = std::map<std::string, torch::Tensor>;

struct TokenBatch {
  torch::Tensor hidden;   // X [N, D], the head's dtype and device
  torch::Tensor targets;  // [N] int64 or int32 in [0, V) or ignore_index; optional for
                          // functions that need none (then every token is valid)
  torch::Tensor weights;  // [N] floating; required by (and only allowed with) weighted_sum
  AuxTensors aux;         // [N] floating per-token inputs the function names (e.g. advantages);
                          // [N, k] for a function's topk_aux (TransformFunction::aux_kinds)
  torch::Tensor teacher_hidden;  // [N, D_teacher] in the teacher head's dtype: the hidden states
                                 // of a two-head function's teacher (StepOptions::teacher)

  // The batch of fn(t) for every defined tensor t (undefined ones stay undefined).
  template <typename Fn>
  TokenBatch Map(Fn&& fn) const {
    auto apply = [&](const torch::Tensor& t) { return t.defined() ? fn(t) : torch::Tensor(); };
    TokenBatch out;
    out.hidden = apply(hidden);
    out.targets = apply(targets);
    out.weights = apply(weights);
    for (const auto& [name, t] : aux) out.aux[name] = apply(t);
    out.teacher_hidden = apply(teacher_hidden);
    return out;
  }

  // N: hidden's first dimension (0 when hidden is undefined or 0-d).
  int64_t rows() const;
  // Bytes held by all of its tensors.
  int64_t nbytes() const;
  // Rows [start, start + n) of every tensor: views, no copy.
  TokenBatch Slice(int64_t start, int64_t n) const;
  // The rows at `index` ([k] int64, increasing) of every tensor, copied.
  TokenBatch Select(const torch::Tensor& index) const;
  // Every tensor on `device` (no copy for those already there).
  TokenBatch To(const torch::Device& device) const;
  // Owned copies of every tensor (e.g. of rows that alias a request message about to be freed).
  TokenBatch Clone() const;
  // Whether `other` carries the same optional inputs (targets, weights, aux names) with the same
  // dtypes, so that the two can be concatenated.
  bool SameInputs(const TokenBatch& other) const;
  // The rows of consecutive batches (which must have the SameInputs) as one batch.
  static TokenBatch Concat(const std::vector<TokenBatch>& parts);
};

// The tokens a MEAN divides by: targets != ignore_index, or every row when there are no
// targets. The engine, the server and the C++ client all count with this one rule.
int64_t CountValidTokens(const torch::Tensor& targets, int64_t ignore_index, int64_t rows);

// The rows that contribute to a call of a function that says its ignored rows contribute
// nothing (TransformFunction::ignored_rows_contribute_nothing): the indices [k] int64, increasing,
// of targets != ignore_index, on the targets' device. The server drops the other rows before it
// computes, and both clients send only these rows (the rule they share).
torch::Tensor ContributingRows(const torch::Tensor& targets, int64_t ignore_index);

}  // namespace remotehead::core
