#include "core/reference.h"

#include "core/policy_reference.h"

#include <torch/nn/functional.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"

namespace remotehead::reference {
namespace F = torch::nn::functional;

namespace {

double Param(const core::FunctionParams& params, const std::string& name, double fallback) {
  const auto it = params.find(name);
  return it == params.end() ? fallback : it->second;
}

torch::Tensor TargetLogprob(const torch::Tensor& z, const torch::Tensor& t) {
  return torch::log_softmax(z, 1).gather(1, t.unsqueeze(1)).squeeze(1);
}

torch::Tensor CrossEntropy(const torch::Tensor& z, const torch::Tensor& t, const core::AuxTensors&,
                           const core::FunctionParams& params) {
  torch::Tensor y = F::cross_entropy(z, t,
                                     F::CrossEntropyFuncOptions()
                                         .reduction(torch::kNone)
                                         .label_smoothing(params.at("label_smoothing")));
  const double zc = params.at("z_loss");
  if (zc > 0) y = y + zc * torch::logsumexp(z, 1).pow(2);
  return y;
}

// The policy losses' inputs: advantages ~ N(0.75, 1) (both signs, mostly positive, so that a
// summed loss does not cancel to near 0, where the comparison would measure only rounding);
// old, ref and sampling log-probs the head's
// true log-probs (of the logits without softcap or temperature) plus N(0, 0.3²) noise; an
// importance-sampling ratio e^{N(0, 0.2²)} per sequence; a 0/1 policy mask; 4 sequences,
// interleaved.
void PolicyAux(const core::Head& head, at::Generator& gen, core::TokenBatch* batch) {
  const int64_t rows = batch->hidden.size(0);
  batch->aux["advantages"] = at::normal(0.75, 1.0, {rows}, gen);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(torch::kCPU);
  torch::Tensor z = torch::mm(batch->hidden.to(f64), head.weight().to(f64).t());
  if (head.has_bias()) z = z + head.bias().to(f64);
  const torch::Tensor targets = batch->targets.clamp_min(0);
  const torch::Tensor logp = TargetLogprob(z, targets).to(torch::kFloat);
  for (const char* name : {"old_logprobs", "ref_logprobs", "sampling_logprobs"}) {
    batch->aux[name] = logp + 0.3 * at::normal(0.0, 1.0, {rows}, gen);
  }
  // (A per-token draw, kept so that the draws after it stay as they were; the ratio is below.)
  (void)at::normal(0.0, 1.0, {rows}, gen);
  batch->aux["policy_mask"] = (at::rand({rows}, gen) > 0.3).to(torch::kFloat);
  batch->aux["sequence_ids"] = at::randint(0, 4, {rows}, gen).to(torch::kLong);
  // One ratio per sequence, the same at each of its tokens (drawn after the others, which stay
  // as they were): what importance_sampling_per_sequence = 1 requires, and per token a ratio
  // like any other. Its spread is 0.06 rather than a token's 0.2: counted per token, a
  // sequence's n equal logs add up coherently (n·0.06 where n independent ones gave √n·0.2), and
  // vespo's weight e^{k·log w − λ·w} of a larger log w would magnify fp32's rounding past the
  // fp32 tolerance (2e-5) without testing anything more.
  batch->aux["importance_sampling_ratio"] =
      torch::exp(0.06 * at::normal(0.0, 1.0, {4}, gen)).index_select(0, batch->aux["sequence_ids"]);
}

}  // namespace

torch::Tensor ReferenceKeptMask(const torch::Tensor& logits, const core::FunctionParams& params) {
  torch::NoGradGuard no_grad;
  const torch::Tensor z = logits.detach();
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t v = z.size(1);
  const auto top_k = static_cast<int64_t>(Param(params, "top_k", 0));
  const double top_p = Param(params, "top_p", 1);
  const double min_p = Param(params, "min_p", 0);
  torch::Tensor keep = torch::ones_like(z, torch::kBool);
  const auto masked = [&] { return z.masked_fill(keep.logical_not(), -inf); };
  const auto apply_min_p = [&] {
    if (min_p <= 0) return;
    const torch::Tensor p = torch::softmax(masked(), 1);
    keep = keep.logical_and(p >= min_p * std::get<0>(p.max(1, /*keepdim=*/true)));
  };
  if (Param(params, "min_p_first", 0) != 0) apply_min_p();
  if (top_k > 0 && top_k < v) {
    const torch::Tensor sorted = std::get<0>(masked().sort(1, /*descending=*/true));
    keep = keep.logical_and(z >= sorted.narrow(1, top_k - 1, 1));
  }
  if (top_p < 1) {
    const torch::Tensor sorted = std::get<0>(masked().sort(1, /*descending=*/true));
    const torch::Tensor reached = torch::softmax(sorted, 1).cumsum(1) >= top_p;
    const torch::Tensor last = reached.logical_not().sum(1, /*keepdim=*/true).clamp_max(v - 1);
    keep = keep.logical_and(z >= sorted.gather(1, last));
  }
  if (Param(params, "min_p_first", 0) == 0) apply_min_p();
  return keep;
}

namespace {

// log p'(t) under the renormalised distribution of the kept set (decided on `head_z`); −inf
// with no gradient outside it.
torch::Tensor SamplerTargetLogprob(const torch::Tensor& z, const torch::Tensor& head_z,
                                   const torch::Tensor& t, const core::FunctionParams& params) {
  const torch::Tensor keep = ReferenceKeptMask(head_z, params);
  const double inf = std::numeric_limits<double>::infinity();
  const torch::Tensor y = TargetLogprob(z.masked_fill(keep.logical_not(), -inf), t);
  return torch::where(keep.gather(1, t.unsqueeze(1)).squeeze(1), y, -inf);
}

// token_logprobs' targets: each valid row's largest or second largest logit (alternately), which
// every test sampler keeps, so that the derived cases compare finite values and gradients
// (sampler_logprobs_test covers targets outside the kept set).
void TokenLogprobsTargets(const core::Head& head, at::Generator&, core::TokenBatch* batch) {
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(torch::kCPU);
  torch::Tensor z = torch::mm(batch->hidden.to(f64), head.weight().to(f64).t());
  if (head.has_bias()) z = z + head.bias().to(f64);
  const torch::Tensor top2 = std::get<1>(z.topk(std::min<int64_t>(2, z.size(1)), 1));
  const torch::Tensor which = torch::arange(z.size(0), torch::kLong).remainder(top2.size(1));
  const torch::Tensor chosen = top2.gather(1, which.unsqueeze(1)).squeeze(1);
  batch->targets = torch::where(batch->targets < 0, batch->targets, chosen);
}

// The policy losses score the sampled token (under the sampler's params, when given): targets
// the test samplers keep, as token_logprobs', then their inputs. Their clipping, caps and masks
// are discontinuous in log p, so the reference takes log p's value from the logits as the head
// forms them (`head_z`: a bf16 head's rounded product, on which the engine decides too) and its
// gradient from the float64 logits — one rounding of the logits cannot then flip a clip.
ReferenceFunction Policy(PolicyLoss kind, core::FunctionParams test_values) {
  return {.sampled = [kind](const torch::Tensor& z, const torch::Tensor& head_z,
                            const torch::Tensor& t, const core::AuxTensors& aux,
                            const core::FunctionParams& params) {
            const torch::Tensor logp = SamplerTargetLogprob(z, head_z, t, params);
            const torch::Tensor at_head = SamplerTargetLogprob(head_z, head_z, t, params);
            const torch::Tensor kept = torch::isfinite(at_head);
            const torch::Tensor value = torch::where(
                kept, logp + (torch::where(kept, at_head, 0.0) - torch::where(kept, logp, 0.0)).detach(),
                logp);
            return PolicyReference(kind, value, aux, params);
          },
          .make_aux =
              [](const core::Head& head, at::Generator& gen, core::TokenBatch* batch) {
                TokenLogprobsTargets(head, gen, batch);
                PolicyAux(head, gen, batch);
              },
          .test_values = std::move(test_values)};
}

// The hard-label cross-entropy a distillation mixes in: of the student's logits at temperature 1.
torch::Tensor MixCrossEntropy(const torch::Tensor& divergence, const torch::Tensor& z,
                              const torch::Tensor& t, const core::FunctionParams& params) {
  const double alpha = params.at("alpha");
  if (alpha == 0) return divergence;
  const torch::Tensor ce = F::cross_entropy(z * params.at("temperature"), t,
                                            F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (1 - alpha) * divergence + alpha * ce;
}

// TRL's generalized_jsd_loss (trl/experimental/gkd): torch's kl_div with log targets, the
// mixture as a logsumexp of the two weighted log-probabilities.
torch::Tensor GeneralizedJsd(const torch::Tensor& zs, const torch::Tensor& zt, double beta) {
  const auto kl = [](const torch::Tensor& input, const torch::Tensor& target) {
    return F::kl_div(input, target, F::KLDivFuncOptions().reduction(torch::kNone).log_target(true))
        .sum(1);
  };
  const torch::Tensor ls = torch::log_softmax(zs, 1);
  const torch::Tensor lt = torch::log_softmax(zt, 1);
  if (beta == 0) return kl(ls, lt);
  if (beta == 1) return kl(lt, ls);
  const torch::Tensor mixture =
      torch::logsumexp(torch::stack({ls + std::log(1 - beta), lt + std::log(beta)}), 0);
  return beta * kl(mixture, lt) + (1 - beta) * kl(mixture, ls);
}

ReferenceFunction TwoHeadReference(double fixed_beta, bool with_beta) {
  return {.two_head =
              [fixed_beta, with_beta](const torch::Tensor& z, const torch::Tensor& zt,
                                      const torch::Tensor& t, const core::FunctionParams& params) {
                const double beta = with_beta ? params.at("beta") : fixed_beta;
                return MixCrossEntropy(GeneralizedJsd(z, zt, beta), z, t, params);
              },
          .test_values = with_beta ? core::FunctionParams{{"alpha", 0.3},
                                                          {"beta", 0.3},
                                                          {"teacher_softcap", 3.0},
                                                          {"teacher_logit_scale", 1.4}}
                                   : core::FunctionParams{{"alpha", 0.3},
                                                          {"teacher_softcap", 3.0},
                                                          {"teacher_logit_scale", 1.4}}};
}

// The sparse divergences written directly: the (k+1)-bucket distributions (tail = 0) or the
// renormalised k ids (tail = 1).
torch::Tensor SparseKlReference(const torch::Tensor& lp, const torch::Tensor& lq, bool renormalise) {
  if (renormalise) {
    const torch::Tensor p = torch::softmax(lp, 1);
    return (p * (torch::log(p) - torch::log_softmax(lq, 1))).sum(1);
  }
  const torch::Tensor p_tail = 1 - torch::exp(lp).sum(1);
  const torch::Tensor q_tail = 1 - torch::exp(lq).sum(1);
  return (torch::exp(lp) * (lp - lq)).sum(1) + p_tail * torch::log(p_tail / q_tail);
}

ReferenceFunction SparseReference(bool reverse) {
  return {.per_token =
              [reverse](const torch::Tensor& z, const torch::Tensor& t,
                        const core::AuxTensors& aux, const core::FunctionParams& params) {
                const torch::Tensor ls =
                    torch::log_softmax(z, 1).gather(1, aux.at("teacher_topk_ids"));
                const torch::Tensor& lt = aux.at("teacher_topk_logprobs");
                const bool renormalise = params.at("tail") != 0;
                const torch::Tensor d = reverse ? SparseKlReference(ls, lt, renormalise)
                                                : SparseKlReference(lt, ls, renormalise);
                return MixCrossEntropy(d, z, t, params);
              },
          // k = 4 distinct ids per row and their log-probabilities under a random teacher
          // distribution over the whole vocabulary (so the tail holds real mass).
          .make_aux =
              [](const core::Head& head, at::Generator& gen, core::TokenBatch* batch) {
                const int64_t rows = batch->hidden.size(0);
                const int64_t v = head.vocab_size();
                const torch::Tensor ids =
                    at::rand({rows, v}, gen).argsort(int64_t{1}).narrow(1, 0, std::min<int64_t>(4, v));
                const torch::Tensor teacher =
                    torch::log_softmax(2.0 * at::normal(0.0, 1.0, {rows, v}, gen), 1);
                batch->aux["teacher_topk_ids"] = ids.contiguous();
                batch->aux["teacher_topk_logprobs"] = teacher.gather(1, ids).contiguous();
              },
          .test_values = {{"alpha", 0.3}, {"tail", 1.0}}};
}

std::map<std::string, ReferenceFunction> MakeReferenceFunctions() {
  std::map<std::string, ReferenceFunction> table;
  table["cross_entropy"] = {.per_token = CrossEntropy,
                            .test_values = {{"label_smoothing", 0.1}, {"z_loss", 1e-3}}};
  table["token_logprobs"] = {
      .sampled = [](const torch::Tensor& z, const torch::Tensor& head_z, const torch::Tensor& t,
                    const core::AuxTensors&, const core::FunctionParams& params) {
        return SamplerTargetLogprob(z, head_z, t, params);
      },
      .make_aux = TokenLogprobsTargets,
      .test_values = {{"top_k", 8}, {"top_p", 0.9}, {"min_p", 0.05}, {"min_p_first", 1}}};
  table["entropy"] = {.per_token = [](const torch::Tensor& z, const torch::Tensor&,
                                      const core::AuxTensors&, const core::FunctionParams&) {
    return -(torch::softmax(z, 1) * torch::log_softmax(z, 1)).sum(1);
  }};
  // top_k 64: a truncation that leaves the sampled token's log-probability near the inputs'
  // (drawn from the full softmax); at 8, VESPO's weight of a whole sequence's shifted ratios
  // underflows to 0 and its reference gradient with it.
  const core::FunctionParams policy = {
      {"beta", 0.04},           {"bias_correction_kl", 1}, {"sequence_level", 1},
      {"off_policy_mask", 1},   {"off_policy_threshold", 0.05}, {"top_k", 64},
      {"importance_sampling_per_sequence", 1},
      {"top_p", 0.9},           {"min_p", 0.05},           {"min_p_first", 1}};
  const auto with = [&policy](core::FunctionParams own) {
    own.insert(policy.begin(), policy.end());
    return own;
  };
  table["grpo"] = Policy(PolicyLoss::kClip,
                         with({{"epsilon_low", 0.1}, {"epsilon_high", 0.28}, {"delta", 1.2}}));
  table["cispo"] = Policy(PolicyLoss::kCispo, with({{"epsilon_high", 1.1}}));
  table["sapo"] =
      Policy(PolicyLoss::kSapo, with({{"temperature_pos", 0.8}, {"temperature_neg", 1.3}}));
  table["vespo"] = Policy(PolicyLoss::kVespo, with({{"k_pos", 1.5},
                                                    {"lambda_pos", 2.5},
                                                    {"k_neg", 2.5},
                                                    {"lambda_neg", 1.5}}));
  table["mse_onehot"] = {.per_token = [](const torch::Tensor& z, const torch::Tensor& t,
                                         const core::AuxTensors&, const core::FunctionParams&) {
    const torch::Tensor one_hot = F::one_hot(t, z.size(1)).to(torch::kDouble);
    return (z - one_hot).pow(2).mean(1);
  }};
  table["sigmoid_sum"] = {
      .per_token = [](const torch::Tensor& z, const torch::Tensor&, const core::AuxTensors&,
                      const core::FunctionParams&) { return torch::sigmoid(z).sum(1); }};
  table["distill_kl"] = TwoHeadReference(0.0, false);
  table["distill_reverse_kl"] = TwoHeadReference(1.0, false);
  table["distill_jsd"] = TwoHeadReference(0.0, true);
  table["distill_topk_kl"] = SparseReference(false);
  table["distill_topk_reverse_kl"] = SparseReference(true);
  // Generation outputs: no per-token reference here (generation_test checks them).
  table["logits"] = {};
  table["sample"] = {};
  return table;
}

}  // namespace

const std::map<std::string, ReferenceFunction>& ReferenceFunctions() {
  static const auto* table = new std::map<std::string, ReferenceFunction>(MakeReferenceFunctions());
  return *table;
}

torch::Tensor ReferencePerToken(const std::string& function, const torch::Tensor& z,
                                const core::TokenBatch& batch, const torch::Tensor& t,
                                const core::FunctionParams& params, const torch::Tensor& teacher_z,
                                int64_t ignore_index, const torch::Tensor& head_z) {
  const auto entry = ReferenceFunctions().find(function);
  if (entry == ReferenceFunctions().end() ||
      !(entry->second.per_token || entry->second.two_head || entry->second.sampled)) {
    throw std::runtime_error("reference: no per-token reference for function " + function);
  }
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  auto resolved = registry.ResolveParams(**registry.Find(function), params);
  if (!resolved.ok()) throw std::runtime_error(std::string(resolved.status().message()));
  if (entry->second.two_head) {
    if (!teacher_z.defined()) throw std::runtime_error("reference: " + function + " needs a teacher");
    return entry->second.two_head(z, teacher_z, t, *resolved);
  }
  core::AuxTensors aux;
  for (const auto& [name, tensor] : batch.aux) {
    aux[name] = tensor.to(torch::kCPU, torch::isFloatingType(tensor.scalar_type())
                                           ? torch::kDouble
                                           : torch::kLong);
  }
  // The rows that count (a row-coupled loss sums over its sequence's valid rows only).
  aux["valid"] = batch.targets.defined()
                     ? batch.targets.to(torch::kCPU).to(torch::kLong) != ignore_index
                     : torch::ones({z.size(0)}, torch::kBool);
  if (entry->second.sampled) {
    return entry->second.sampled(z, head_z.defined() ? head_z : z.detach(), t, aux, *resolved);
  }
  return entry->second.per_token(z, t, aux, *resolved);
}

namespace {

// A head's float64 logits of `hidden` with the given scale, softcap and temperature, as
// transformers and TRL apply them: (X·Wᵀ + b)·scale, softcap·tanh(z / softcap), z / T.
torch::Tensor Transformed(torch::Tensor z, double scale, double cap, double temperature) {
  z = z * scale;
  if (cap > 0) z = cap * torch::tanh(z / cap);
  return z / temperature;
}

torch::Tensor TransformedLogits(const torch::Tensor& x, const torch::Tensor& w,
                                const torch::Tensor& b, double scale, double cap,
                                double temperature) {
  torch::Tensor z = torch::mm(x, w.t());
  if (b.defined()) z = z + b;
  return Transformed(z, scale, cap, temperature);
}

}  // namespace

torch::Tensor HeadLogits(const core::Head& head, const torch::Tensor& hidden,
                         const core::FunctionParams& params) {
  torch::NoGradGuard no_grad;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(torch::kCPU);
  torch::Tensor z = torch::mm(hidden.to(f64), head.weight().to(f64).t());
  if (head.has_bias()) z = z + head.bias().to(f64);
  z = z.to(head.dtype()).to(torch::kDouble);
  return Transformed(z, Param(params, "logit_scale", 1.0), Param(params, "softcap", 0.0),
                     Param(params, "temperature", 1.0));
}

ReferenceResult NaiveReference(const core::Head& head, const core::TokenBatch& batch,
                               const core::StepOptions& options, const torch::Tensor& grad_output) {
  torch::AutoGradMode grad_mode(true);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(torch::kCPU);
  torch::Tensor x = batch.hidden.to(f64).detach().requires_grad_(true);
  torch::Tensor w = head.weight().to(f64).detach().requires_grad_(true);
  torch::Tensor b;
  if (head.has_bias()) b = head.bias().to(f64).detach().requires_grad_(true);
  const double temperature = Param(options.params, "temperature", 1.0);
  const torch::Tensor z =
      TransformedLogits(x, w, b, Param(options.params, "logit_scale", 1.0),
                        Param(options.params, "softcap", 0.0), temperature);
  torch::Tensor teacher_z;
  if (options.teacher != nullptr) {
    const core::Head& t = *options.teacher;
    teacher_z = TransformedLogits(batch.teacher_hidden.to(f64), t.weight().to(f64),
                                  t.has_bias() ? t.bias().to(f64) : torch::Tensor(),
                                  Param(options.params, "teacher_logit_scale", 1.0),
                                  Param(options.params, "teacher_softcap", 0.0), temperature)
                    .detach();
  }

  const int64_t n = x.size(0);
  torch::Tensor valid = torch::ones({n}, f64.dtype(torch::kBool));
  torch::Tensor safe_targets = torch::zeros({n}, f64.dtype(torch::kLong));
  if (batch.targets.defined()) {
    const torch::Tensor t = batch.targets.to(torch::kCPU).to(torch::kLong);
    valid = t != options.ignore_index;
    safe_targets = torch::where(valid, t, torch::zeros_like(t));
  }
  core::TokenBatch cpu_batch = batch;
  for (auto& [name, tensor] : cpu_batch.aux) tensor = tensor.to(torch::kCPU);
  const torch::Tensor y = torch::where(
      valid,
      ReferencePerToken(options.function, z, cpu_batch, safe_targets, options.params, teacher_z,
                        options.ignore_index, HeadLogits(head, batch.hidden, options.params)),
      torch::zeros({n}, f64));

  ReferenceResult r;
  torch::Tensor upstream;
  if (options.reduction == core::Reduction::kNone) {
    r.output = y;
    upstream = grad_output.defined() ? grad_output.to(f64) : torch::ones({n}, f64);
  } else {
    torch::Tensor weighted = y;
    if (options.reduction == core::Reduction::kWeightedSum) weighted = y * batch.weights.to(f64);
    double denom = 1.0;
    if (options.normalizer) {
      denom = *options.normalizer;
    } else if (options.reduction == core::Reduction::kMean) {
      denom = std::max<double>(1.0, valid.sum().item<double>());
    }
    r.output = weighted.sum() / denom;
    upstream = grad_output.defined() ? grad_output.to(f64).reshape({})
                                     : torch::full({}, options.upstream_scale, f64);
  }
  r.output.backward(upstream);
  r.output = r.output.detach();
  r.grad_hidden = x.grad();
  r.grad_weight = w.grad();
  if (b.defined()) r.grad_bias = b.grad();
  return r;
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.detach().to(torch::kCPU).to(torch::kDouble) -
          b.detach().to(torch::kCPU).to(torch::kDouble))
      .abs()
      .max()
      .item<double>();
}

double MaxAbs(const torch::Tensor& a) {
  return a.detach().to(torch::kCPU).to(torch::kDouble).abs().max().item<double>();
}

double RelativeError(double actual, double expected, double floor) {
  if (actual == expected) return 0.0;  // equal infinities too
  const double diff = std::abs(actual - expected);
  const double scale = std::max(std::abs(expected), floor);
  if (diff == 0) return 0.0;
  return scale > 0 ? diff / scale : std::numeric_limits<double>::infinity();
}

double RelativeError(const torch::Tensor& actual, const torch::Tensor& expected, double floor) {
  if (actual.sizes() != expected.sizes()) return std::numeric_limits<double>::infinity();
  if (actual.numel() == 0) return 0.0;
  const torch::Tensor a = actual.detach().to(torch::kCPU).to(torch::kDouble);
  const torch::Tensor e = expected.detach().to(torch::kCPU).to(torch::kDouble);
  const double diff = torch::where(a == e, 0.0, (a - e).abs()).max().item<double>();
  const torch::Tensor finite = e.masked_select(e.isfinite());
  const double scale = std::max(finite.numel() > 0 ? MaxAbs(finite) : 0.0, floor);
  if (diff == 0) return 0.0;
  return scale > 0 ? diff / scale : std::numeric_limits<double>::infinity();
}

}  // namespace remotehead::reference

namespace remotehead::reference {

std::unique_ptr<core::Head> MakeTestHead(int64_t vocab, int64_t hidden, torch::ScalarType dtype,
                                         bool bias, uint64_t seed,
                                         std::optional<torch::ScalarType> grad_dtype,
                                         torch::Device device) {
  core::HeadInit init{.vocab_size = vocab,
                      .hidden_size = hidden,
                      .dtype = dtype,
                      .bias = bias,
                      .seed = seed,
                      .init_std = 1.0 / std::sqrt(static_cast<double>(hidden))};
  auto head = core::Head::Initialize(init, {.device = device, .grad_dtype = grad_dtype});
  if (!head.ok()) throw std::runtime_error(std::string(head.status().message()));
  if (bias) {
    torch::NoGradGuard no_grad;
    auto gen = at::detail::createCPUGenerator(seed + 1000);
    (*head)->mutable_bias().copy_(at::normal(0.0, 0.5, {vocab}, gen));
  }
  return std::move(head).value();
}

core::TokenBatch MakeTestBatch(const core::Head& head, int64_t rows, const std::string& function,
                               core::Reduction reduction, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  core::TokenBatch batch;
  batch.hidden = at::normal(0.0, 1.0, {rows, head.hidden_size()}, gen).to(head.dtype());
  torch::Tensor targets = at::randint(head.vocab_size(), {rows}, gen, torch::kLong);
  const torch::Tensor ignored = at::rand({rows}, gen) < 0.2;
  batch.targets = targets.masked_fill(ignored, -100);
  if (reduction == core::Reduction::kWeightedSum) {
    batch.weights = at::rand({rows}, gen) + 0.5;
  }
  const auto entry = ReferenceFunctions().find(function);
  const auto fn = core::FunctionRegistry::Builtin().Find(function);
  if (entry != ReferenceFunctions().end() && entry->second.make_aux) {
    entry->second.make_aux(head, gen, &batch);
  } else if (fn.ok()) {
    for (const auto* names : {&(*fn)->required_aux, &(*fn)->optional_aux}) {
      for (const std::string& name : *names) batch.aux[name] = at::normal(0.0, 1.0, {rows}, gen);
    }
  }
  if (const core::Head* teacher = TestTeacher(head, function); teacher != nullptr) {
    batch.teacher_hidden =
        at::normal(0.0, 1.0, {rows, teacher->hidden_size()}, gen).to(teacher->dtype());
  }
  return batch.To(head.device());
}

const core::Head* TestTeacher(const core::Head& student, const std::string& function) {
  const auto fn = core::FunctionRegistry::Builtin().Find(function);
  if (!fn.ok() || !(*fn)->needs_teacher) return nullptr;
  static std::mutex mu;
  static auto* teachers = new std::map<std::string, std::unique_ptr<core::Head>>();
  const std::string key =
      absl::StrCat(student.vocab_size(), "x", student.hidden_size(), " ",
                   core::DtypeName(student.dtype()), " ", student.device().str());
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<core::Head>& teacher = (*teachers)[key];
  if (teacher == nullptr) {
    teacher = MakeTestHead(student.vocab_size(), student.hidden_size() + 5, student.dtype(),
                           /*bias=*/true, /*seed=*/77, std::nullopt, student.device());
  }
  return teacher.get();
}

}  // namespace remotehead::reference
