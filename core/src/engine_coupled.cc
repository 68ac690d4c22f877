// A row-coupled call (TransformFunction::couples_rows): a loss in which a token's value depends
// on other tokens of its sequence (GSPO's sequence-level ratio, VESPO's sequence weight), so no
// block of rows can be computed alone. Two passes over the chunks, with the loss between them:
//   1. RunChunks computes every row's per-token value v (per_token_value: the target's
//      log-probability) — one GEMM per chunk, no gradient, [N] values kept;
//   2. the function's coupled_forward runs once on the whole call's v under autograd (plain
//      LibTorch on [N] tensors), the call's reduction is applied, and autograd gives dL/dv;
//   3. RunChunks again, with dL/dv as the upstream gradient of v: dX and dW, three GEMMs per
//      chunk (the logits are recomputed, never kept).
// So a coupled call costs one logits GEMM more than a fused one, and holds [N]-sized tensors
// only; its results do not depend on the chunking, and on a head group every rank computes the
// same v (VocabOps) and so the same dL/dv.
#include <map>
#include <string>
#include <utility>

#include "engine_internal.h"

namespace remotehead::core::engine_internal {
namespace {

struct CoupledLoss {
  torch::Tensor values;         // [N] pass 1's per-token values: the leaf autograd differentiates
  torch::Tensor valid;          // [N] bool
  torch::Tensor token_weights;  // [N] valid × the weights of weighted_sum, values' dtype
  torch::Tensor y;              // [N] the coupled forward's outputs, 0 at ignored rows
  std::map<std::string, torch::Tensor> extras;  // [N] each, detached, 0 at ignored rows
  int64_t num_chunks = 0;
};

// Pass 1 and the coupled forward, with the graph from `values` to `y` when `gradients`.
CoupledLoss Evaluate(const Head& head, const TokenBatch& batch, const Plan& plan, bool gradients) {
  ChunkOutputs first = RunChunks(head, batch, plan, {.keep_per_token = true});
  CoupledLoss loss;
  loss.num_chunks = first.num_chunks;
  loss.values = first.per_token.detach().requires_grad_(gradients);
  const auto dtype = loss.values.scalar_type();
  loss.valid =
      batch.targets.defined()
          ? batch.targets.to(torch::kLong) != plan.ignore_index
          : torch::ones({plan.rows}, torch::TensorOptions(torch::kBool).device(head.device()));
  loss.token_weights = loss.valid.to(dtype);
  if (plan.reduction == Reduction::kWeightedSum) loss.token_weights.mul_(batch.weights.to(dtype));

  CoupledInputs in{.values = loss.values, .valid = loss.valid, .params = &plan.params()};
  for (const auto& [name, tensor] : batch.aux) {
    const AuxKind kind = plan.fn().aux_kind(name);
    const bool ids = kind == AuxKind::kPerTokenIds || kind == AuxKind::kTopkIds;
    in.aux[name] = tensor.to(ids ? torch::kLong : dtype);
  }
  torch::AutoGradMode grad_mode(gradients);
  FunctionOutput out = plan.fn().coupled_forward(in);
  CheckReportedExtras(plan, out.extras);
  loss.y = torch::where(loss.valid, out.per_token, 0.0);
  for (auto& [name, extra] : out.extras) {
    loss.extras[name] = torch::where(loss.valid, extra.detach(), 0.0).to(dtype);
  }
  return loss;
}

// dL/dv for dL/dy = `dy` ([N]), 0 at ignored rows.
torch::Tensor GradientOfValues(const CoupledLoss& loss, const torch::Tensor& dy) {
  torch::Tensor dv = torch::autograd::grad({loss.y}, {loss.values}, {dy.to(loss.y.scalar_type())},
                                           /*retain_graph=*/false, /*create_graph=*/false,
                                           /*allow_unused=*/true)[0];
  if (!dv.defined()) return torch::zeros_like(loss.values);
  return torch::where(loss.valid, dv, 0.0).detach();
}

// Pass 3: dL/dv backpropagated through every chunk's per-token values into dX and dW; the
// head's health with dW (the pass that trains, as in an ordinary call).
HeadHealth Backpropagate(const Head& head, const TokenBatch& batch, const Plan& plan,
                         const torch::Tensor& dv, GradientBuffers* grads,
                         const torch::Tensor& grad_hidden) {
  const UpstreamFn upstream = [&dv](int64_t start, int64_t rows, const torch::Tensor& w) {
    return dv.narrow(0, start, rows).to(w.scalar_type());
  };
  const ChunkOutputs outputs =
      RunChunks(head, batch, plan, TrainingPass(plan, &upstream, grads, grad_hidden));
  return outputs.health.has_value() ? ToHeadHealth(*outputs.health, plan.valid_tokens)
                                    : HeadHealth{};
}

// Σ w·y in fp64 (the loss before its denominator), as the chunk loop sums it.
double WeightedSum(const CoupledLoss& loss) {
  return (loss.y.detach().to(torch::kDouble) * loss.token_weights.to(torch::kDouble))
      .sum()
      .item<double>();
}

// num_chunks counts the chunks of one pass, as for every call (a mode changes it nowhere).
StepStats Stats(const Plan& plan, const CoupledLoss& loss) {
  ChunkOutputs outputs;
  outputs.num_chunks = loss.num_chunks;
  for (const auto& [name, extra] : loss.extras)
    outputs.extras[name] = extra.to(torch::kDouble).sum();
  return MakeStats(plan, outputs);
}

TokenExtras Extras(const Plan& plan, const CoupledLoss& loss) {
  TokenExtras extras;
  for (const std::string& name : plan.token_extras) extras[name] = loss.extras.at(name);
  return extras;
}

}  // namespace

FusedResult FusedCoupled(const Head& head, const TokenBatch& batch, const Plan& plan,
                         double upstream_scale, GradientBuffers* grads, torch::Tensor grad_hidden) {
  const CoupledLoss loss = Evaluate(head, batch, plan, /*gradients=*/true);
  const torch::Tensor dv =
      GradientOfValues(loss, loss.token_weights * (upstream_scale / plan.denominator));
  const HeadHealth health = Backpropagate(head, batch, plan, dv, grads, grad_hidden);
  FusedResult result;
  result.loss = WeightedSum(loss) / plan.denominator;  // read on the host: the rows are coupled
  result.loss_value =
      torch::full({}, result.loss, torch::TensorOptions(torch::kDouble).device(head.device()));
  result.grad_hidden = std::move(grad_hidden);
  result.stats = Stats(plan, loss);
  result.stats.health = health;
  result.token_extras = Extras(plan, loss);
  return result;
}

ForwardResult ForwardCoupled(const Head& head, const TokenBatch& batch, const Plan& plan) {
  const CoupledLoss loss = Evaluate(head, batch, plan, /*gradients=*/false);
  ForwardResult result;
  result.output = plan.reduction == Reduction::kNone
                      ? loss.y.detach()
                      : torch::tensor(WeightedSum(loss) / plan.denominator,
                                      loss.values.options().requires_grad(false));
  result.stats = Stats(plan, loss);
  result.token_extras = Extras(plan, loss);
  return result;
}

BackwardResult BackwardCoupled(const Head& head, const TokenBatch& batch, const Plan& plan,
                               const torch::Tensor& grad_output, GradientBuffers* grads,
                               torch::Tensor grad_hidden) {
  const CoupledLoss loss = Evaluate(head, batch, plan, /*gradients=*/true);
  const torch::Tensor dy =
      plan.reduction == Reduction::kNone
          ? loss.token_weights * grad_output.to(loss.token_weights.scalar_type())
          : loss.token_weights * (grad_output.item<double>() / plan.denominator);
  const HeadHealth health =
      Backpropagate(head, batch, plan, GradientOfValues(loss, dy), grads, grad_hidden);
  BackwardResult result;
  result.grad_hidden = std::move(grad_hidden);
  result.stats = Stats(plan, loss);
  result.stats.health = health;
  result.token_extras = Extras(plan, loss);
  return result;
}

}  // namespace remotehead::core::engine_internal
