// The distillation functions: the student's logits (this head's, in.logits) against a teacher's.
//
// Two-head functions (needs_teacher): the teacher is a frozen head on the same server (or head
// group), its logits formed chunk by chunk from its own hidden states beside the student's, with
// its own logit scale, softcap and bias and the shared temperature (ChunkInputs::teacher_logits,
// a constant). The divergences are TRL's (trl.kernels.chunked_divergence, the
// DistillationTrainer's loss): beta = 0 the forward KL(p_t ‖ p_s), beta = 1 the reverse
// KL(p_s ‖ p_t), otherwise the generalized JSD β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m) with
// m = (1 − β)·p_s + β·p_t. All are exact over the whole vocabulary.
//
// Sparse functions: a teacher that is not on the server sends its top-k token ids and their
// log-probabilities per token (aux inputs [N, k]); the rest of its mass is either one bucket
// (tail = 0) or dropped with both distributions renormalised over the k ids (tail = 1).
//
// Every function may mix in the hard-label cross-entropy of the student at temperature 1:
// per-token loss = (1 − α)·divergence + α·CE.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace {

constexpr char kTopkIds[] = "teacher_topk_ids";
constexpr char kTopkLogprobs[] = "teacher_topk_logprobs";
// The smallest tail mass whose log a sparse divergence takes: a teacher that reports all of its
// mass in its top k (tail 0) would otherwise make the reverse KL's tail term infinite.
constexpr double kMinTailMass = 1e-30;

// The per-token divergence between the two log-probability rows, TRL's definition. Written
// with as few passes over the [n, V] block as the formula allows (each element-wise op is one):
// the JSD's weights β and 1 − β go into the exponents its mixture already forms.
VocabOps::PairTerm DivergenceTerm(double beta) {
  if (beta == 0.0) {
    return [](const torch::Tensor& ls, const torch::Tensor& lt) {
      return torch::exp(lt) * (lt - ls);
    };
  }
  if (beta == 1.0) {
    return [](const torch::Tensor& ls, const torch::Tensor& lt) {
      return torch::exp(ls) * (ls - lt);
    };
  }
  return [beta](const torch::Tensor& ls, const torch::Tensor& lt) {
    const torch::Tensor weighted_s = ls + std::log1p(-beta);  // log((1 − β)·p_s)
    const torch::Tensor weighted_t = lt + std::log(beta);     // log(β·p_t)
    const torch::Tensor log_m = torch::logaddexp(weighted_s, weighted_t);
    return torch::exp(weighted_t) * (lt - log_m) + torch::exp(weighted_s) * (ls - log_m);
  };
}

// The student's logits at temperature 1 (after its scale and softcap): what the hard-label
// cross-entropy sees.
torch::Tensor UntemperedLogits(const ChunkInputs& in) {
  const double temperature = in.param(kTemperatureParam);
  return temperature == 1.0 ? in.logits : in.logits * temperature;
}

// The student's p·log p, from its log-probabilities (the pair's first row): its sum is minus
// the entropy (negated per token, not per element: one pass fewer).
torch::Tensor StudentNegEntropyTerm(const torch::Tensor& ls, const torch::Tensor&) {
  return torch::exp(ls) * ls;
}

// (1 − α)·divergence + α·CE, with the extras every distillation function reports: the divergence,
// the student's entropy (at the temperature, as TRL logs it; computed here when not given) and,
// with α > 0, the nll.
FunctionOutput MixWithCrossEntropy(const ChunkInputs& in, const torch::Tensor& divergence,
                                   torch::Tensor entropy = {}) {
  const VocabOps& vocab = *in.vocab;
  FunctionOutput out;
  out.per_token = divergence;
  const double alpha = in.param("alpha");
  if (alpha > 0) {
    const torch::Tensor nll = -vocab.LogSoftmaxAtTarget(UntemperedLogits(in), in.targets);
    out.per_token = (1.0 - alpha) * divergence + alpha * nll;
    out.extras["nll"] = nll.detach();
  }
  out.extras["divergence"] = divergence.detach();
  if (!entropy.defined()) {
    torch::NoGradGuard no_grad;
    const torch::Tensor z = in.logits.detach();
    entropy = vocab.LogSumExp(z) - vocab.SoftmaxMean(z, z);
  }
  out.extras["entropy"] = entropy;
  return out;
}

std::function<FunctionOutput(const ChunkInputs&)> TwoHeadDivergence(std::string beta_param,
                                                                     double fixed_beta) {
  return [beta_param, fixed_beta](const ChunkInputs& in) {
    const double beta = beta_param.empty() ? fixed_beta : in.param(beta_param);
    const std::vector<torch::Tensor> sums = in.vocab->SumsOfLogSoftmaxPair(
        {DivergenceTerm(beta), StudentNegEntropyTerm}, in.logits, in.teacher_logits);
    return MixWithCrossEntropy(in, sums[0], -sums[1]);
  };
}

// log(1 − Σ_k exp(l_k)) from the log-probabilities l [n, k], accurately near Σ = 1.
torch::Tensor LogTailMass(const torch::Tensor& l) {
  const torch::Tensor lse = torch::logsumexp(l, 1).clamp_max(0.0);
  return torch::log(torch::clamp_min(-torch::expm1(lse), kMinTailMass));
}

// KL(p ‖ q) of two sparse rows [n, k] of log-probabilities, with the rest of each one's mass
// as one more bucket (tail = 0) or both renormalised over the k ids (tail = 1).
torch::Tensor SparseKl(const torch::Tensor& lp, const torch::Tensor& lq, bool renormalise) {
  if (renormalise) {
    const torch::Tensor p = lp - torch::logsumexp(lp, 1, /*keepdim=*/true);
    const torch::Tensor q = lq - torch::logsumexp(lq, 1, /*keepdim=*/true);
    return (torch::exp(p) * (p - q)).sum(1);
  }
  const torch::Tensor p_tail_log = LogTailMass(lp);
  const torch::Tensor p_tail = torch::exp(p_tail_log);
  return (torch::exp(lp) * (lp - lq)).sum(1) + p_tail * (p_tail_log - LogTailMass(lq));
}

std::function<FunctionOutput(const ChunkInputs&)> SparseDivergence(bool reverse) {
  return [reverse](const ChunkInputs& in) {
    const torch::Tensor& ids = in.aux.at(kTopkIds);
    const torch::Tensor& teacher = in.aux.at(kTopkLogprobs);
    const torch::Tensor student = in.vocab->LogSoftmaxAtTarget(in.logits, ids);
    const bool renormalise = in.param("tail") != 0;
    const torch::Tensor divergence = reverse ? SparseKl(student, teacher, renormalise)
                                             : SparseKl(teacher, student, renormalise);
    return MixWithCrossEntropy(in, divergence);
  };
}

absl::Status ValidateAlphaTargets(const FunctionParams& params, bool has_targets) {
  if (params.at("alpha") > 0 && !has_targets) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets: expected per-token targets because alpha = ", params.at("alpha"),
        " > 0 mixes in the hard-label cross-entropy; got none"));
  }
  return absl::OkStatus();
}

// A sparse teacher's log-probabilities: each ≤ 0 and, with the tail as a bucket, summing to at
// most 1 per row (within fp32 rounding of a teacher that reports its whole distribution).
absl::Status ValidateSparse(const FunctionParams& params, const AuxTensors& aux,
                            bool has_targets) {
  RETURN_IF_ERROR(ValidateAlphaTargets(params, has_targets));
  if (params.at("tail") != 0 && params.at("tail") != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "params[\"tail\"]: expected 0 (the rest as one bucket) or 1 (renormalised); got ",
        params.at("tail")));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor lp = aux.at(kTopkLogprobs).to(torch::kDouble);
  const torch::Tensor positive = (lp > 0).any(1);
  if (positive.any().item<bool>()) {
    const int64_t row = positive.nonzero()[0][0].item<int64_t>();
    return absl::InvalidArgumentError(absl::StrCat(
        "aux[\"", kTopkLogprobs, "\"][", row, "]: expected log-probabilities <= 0; got max ",
        lp[row].max().item<double>()));
  }
  if (params.at("tail") == 0 && lp.size(1) > 0) {
    const torch::Tensor mass = torch::exp(torch::logsumexp(lp, 1));
    const torch::Tensor over = mass > 1.0 + 1e-4;
    if (over.any().item<bool>()) {
      const int64_t row = over.nonzero()[0][0].item<int64_t>();
      return absl::InvalidArgumentError(absl::StrCat(
          "aux[\"", kTopkLogprobs, "\"][", row,
          "]: expected probabilities summing to at most 1 (tail = 0 keeps the rest as one "
          "bucket); got ",
          mass[row].item<double>()));
    }
  }
  return absl::OkStatus();
}

// What every distillation function reports (MixWithCrossEntropy).
std::vector<ExtraSpec> DistillationExtras() {
  return {{"divergence", "the per-token divergence, before the alpha mix"},
          {"entropy", "the student's entropy at the temperature (what TRL logs)"},
          {.name = "nll",
           .help = "the hard-label cross-entropy at temperature 1",
           .when_param = "alpha"}};
}

const ParamSpec kAlpha = {"alpha", 0.0, 0.0, 1.0,
                          "weight of the hard-label cross-entropy (temperature 1): loss = "
                          "(1 - alpha) * divergence + alpha * CE; > 0 needs targets"};

std::vector<ParamSpec> TwoHeadParams(bool with_beta) {
  std::vector<ParamSpec> params;
  if (with_beta) {
    params.push_back({"beta", 0.5, 0.0, 1.0,
                      "generalized JSD (TRL): 0 forward KL(teacher||student), 1 reverse "
                      "KL(student||teacher), else JSD with mixture (1-beta) p_s + beta p_t"});
  }
  params.push_back(kAlpha);
  params.push_back({kTeacherLogitScaleParam, 1.0, 1e-6, kInf,
                    "the teacher's logits are first multiplied by this"});
  params.push_back({kTeacherSoftcapParam, 0.0, 0.0, kInf,
                    "if > 0: teacher logits <- softcap * tanh(logits / softcap)"});
  return params;
}

TransformFunction TwoHead(std::string name, std::string help, bool with_beta, double beta) {
  return {.name = std::move(name),
          .help = std::move(help),
          .needs_targets = false,
          .needs_teacher = true,
          .params = TwoHeadParams(with_beta),
          .extras = DistillationExtras(),
          .workspace_logit_buffers = with_beta ? 11.0 : 6.0,
          .ignored_rows_contribute_nothing = true,
          .forward = TwoHeadDivergence(with_beta ? "beta" : "", beta),
          .validate = [](const FunctionParams& params, const AuxTensors&, bool has_targets) {
            return ValidateAlphaTargets(params, has_targets);
          }};
}

TransformFunction Sparse(std::string name, std::string help, bool reverse) {
  return {.name = std::move(name),
          .help = std::move(help),
          .needs_targets = false,
          .required_aux = {kTopkIds, kTopkLogprobs},
          .aux_kinds = {{kTopkIds, AuxKind::kTopkIds}, {kTopkLogprobs, AuxKind::kTopkValues}},
          .params = {kAlpha,
                     {"tail", 0.0, 0.0, 1.0,
                      "0: the mass outside the top k is one more bucket on both sides; 1: both "
                      "distributions renormalised over the k ids"}},
          .extras = DistillationExtras(),
          .workspace_logit_buffers = 3,
          .ignored_rows_contribute_nothing = true,
          .forward = SparseDivergence(reverse),
          .validate = ValidateSparse};
}

}  // namespace

std::vector<TransformFunction> DistillationFunctions() {
  return {
      TwoHead("distill_kl", "forward KL(teacher || student) against a frozen teacher head", false,
              0.0),
      TwoHead("distill_reverse_kl", "reverse KL(student || teacher) against a frozen teacher head",
              false, 1.0),
      TwoHead("distill_jsd", "generalized Jensen-Shannon divergence (TRL's beta) against a frozen "
              "teacher head", true, 0.0),
      Sparse("distill_topk_kl",
             "forward KL(teacher || student) against a teacher's top-k log-probs (aux)", false),
      Sparse("distill_topk_reverse_kl",
             "reverse KL(student || teacher) against a teacher's top-k log-probs (aux)", true),
  };
}

}  // namespace remotehead::core
