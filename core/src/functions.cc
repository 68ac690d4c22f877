// The built-in transformation functions. Each is forward-only LibTorch code on an fp32
// logits chunk that reduces over the vocabulary only through VocabOps (the rules are in
// functions.h), so the same code runs on a whole head and on a shard of a head group; autograd
// provides every derivative. To add a function, append one entry to BuiltinFunctions() below.
#include "remotehead/core/functions.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/head.h"
#include "remotehead/core/sampler_kept_set.h"

namespace remotehead::core {
namespace {

// Cross-entropy with label smoothing and z-loss, as torch.nn.functional.cross_entropy defines
// smoothing: −(1−ε)·log p_t − ε·mean_j log p_j, plus z_loss·lse² (PaLM's auxiliary loss).
// mean_j log p_j = Σ_j z_j / V − lse, with the global V. lse is asked for only when smoothing or
// the z-loss need it: log p_t alone is one fused pass.
FunctionOutput CrossEntropy(const ChunkInputs& in) {
  const VocabOps& vocab = *in.vocab;
  const double eps = in.param("label_smoothing");
  const double z_coef = in.param("z_loss");
  const torch::Tensor nll = -vocab.LogSoftmaxAtTarget(in.logits, in.targets);
  torch::Tensor loss = nll;
  torch::Tensor lse;
  if (eps > 0 || z_coef > 0) lse = vocab.LogSumExp(in.logits);
  if (eps > 0) {
    const double v = static_cast<double>(vocab.vocab_size());
    loss = (1.0 - eps) * nll - eps * (vocab.Sum(in.logits) / v - lse);
  }
  FunctionOutput out;
  if (z_coef > 0) {
    const torch::Tensor z_loss = z_coef * lse.square();
    loss = loss + z_loss;
    out.extras["z_loss"] = z_loss.detach();
  }
  out.extras["nll"] = nll.detach();
  out.per_token = loss;
  return out;
}

// log p(target): the selected-token log-probabilities of RL trainers; with sampler params, under
// the sampler's truncated, renormalised distribution (sampler_kept_set.h).
FunctionOutput TokenLogprobs(const ChunkInputs& in) {
  SampledLogProb logp = TargetLogProbAndKept(in);
  return {std::move(logp.logprob), {{"kept", std::move(logp.kept)}}};
}

// Entropy of the predicted distribution: H = −Σ_j p_j log p_j = lse − E_p[z].
FunctionOutput Entropy(const ChunkInputs& in) {
  const torch::Tensor lse = in.vocab->LogSumExp(in.logits);
  return {lse - in.vocab->SoftmaxMean(in.logits, in.logits), {}};
}

// Mean squared error between the logits and the one-hot target, averaged over the vocabulary
// (so a mean over tokens equals torch.nn.MSELoss()(logits, one_hot)). Expanded as
// (Σ_j z_j² − 2·z_t + 1) / V to avoid materialising the one-hot matrix.
FunctionOutput MseOnehot(const ChunkInputs& in) {
  const VocabOps& vocab = *in.vocab;
  const double v = static_cast<double>(vocab.vocab_size());
  return {(vocab.Sum(in.logits.square()) - 2.0 * vocab.AtTarget(in.logits, in.targets) + 1.0) / v,
          {}};
}

// Σ_j sigmoid(z_j): the seed's "other function" (reduction=sum gives sum(sigmoid(X Wᵀ))).
FunctionOutput SigmoidSum(const ChunkInputs& in) {
  return {in.vocab->Sum(torch::sigmoid(in.logits)), {}};
}

std::vector<TransformFunction> BuiltinFunctions() {
  std::vector<TransformFunction> functions = {
      {.name = "cross_entropy",
       .help = "next-token cross-entropy with label smoothing and z-loss",
       .params = {{"label_smoothing", 0.0, 0.0, 1.0, "ε of torch's label smoothing"},
                  {"z_loss", 0.0, 0.0, kInf, "coefficient of lse² (PaLM z-loss)"}},
       .extras = {{"nll", "−log p(target), without smoothing or z-loss"},
                  {.name = "z_loss",
                   .help = "z_loss·lse², the auxiliary term",
                   .when_param = "z_loss"}},
       .workspace_logit_buffers = 3,
       .ignored_rows_contribute_nothing = true,
       .forward = CrossEntropy,
       .fused = FusedKind::kCrossEntropy},
      {.name = "token_logprobs",
       .help = "log-probability of the target token; with top_k / top_p / min_p, under the "
               "sampler's truncated, renormalised distribution (−inf, zero gradient, for a target "
               "outside the kept set)",
       .params = SamplerParams(),
       .extras = {{"kept",
                   "1 if the target is in the sampler's kept set, else 0 (always 1 without "
                   "top_k / top_p / min_p)"}},
       .workspace_logit_buffers = 3,
       .ignored_rows_contribute_nothing = true,
       .forward = TokenLogprobs,
       .fused = FusedKind::kTokenLogprobs,
       .validate = [](const FunctionParams& params, const AuxTensors&,
                      bool) { return ValidateSamplerParams(params); }},
      {.name = "entropy",
       .help = "entropy of the predicted distribution",
       .needs_targets = false,
       .workspace_logit_buffers = 4,
       .ignored_rows_contribute_nothing = true,
       .forward = Entropy,
       .fused = FusedKind::kEntropy},
      {.name = "mse_onehot",
       .help = "mean squared error of the logits to the one-hot target",
       .workspace_logit_buffers = 2,
       .ignored_rows_contribute_nothing = true,
       .forward = MseOnehot},
      {.name = "sigmoid_sum",
       .help = "sum over the vocabulary of sigmoid(logits)",
       .needs_targets = false,
       .workspace_logit_buffers = 1,
       .ignored_rows_contribute_nothing = true,
       .forward = SigmoidSum},
      // Generation outputs (OutputKind): computed by the engine's decode loop, no forward.
      {.name = "logits",
       .help = "the rows' logits [rows, V] (softcap and temperature applied), for generation",
       .needs_targets = false,
       .workspace_logit_buffers = 0,
       .output = OutputKind::kLogits},
      SampleFunction(),
  };
  for (TransformFunction& fn : PolicyLossFunctions()) functions.push_back(std::move(fn));
  for (TransformFunction& fn : DistillationFunctions()) functions.push_back(std::move(fn));
  return functions;
}

}  // namespace

bool ExtraSpec::ReportedWith(const FunctionParams& params, const AuxTensors& aux) const {
  if (!when_param.empty() && !(params.at(when_param) > 0)) return false;
  return when_aux.empty() || aux.contains(when_aux);
}

std::vector<std::string> TransformFunction::ReportedExtras(const FunctionParams& params,
                                                           const AuxTensors& aux) const {
  std::vector<std::string> names;
  for (const ExtraSpec& extra : extras) {
    if (extra.ReportedWith(params, aux)) names.push_back(extra.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

namespace {

// Why `extra` is not reported by a call that does not meet its condition.
std::string ConditionText(const ExtraSpec& extra) {
  if (!extra.when_param.empty()) {
    return absl::StrCat("reported only with params[\"", extra.when_param, "\"] > 0");
  }
  return absl::StrCat("reported only with aux[\"", extra.when_aux, "\"]");
}

}  // namespace

absl::Status CheckTokenExtras(const TransformFunction& fn, const FunctionParams& params,
                              const AuxTensors* aux, const std::vector<std::string>& token_extras) {
  const AuxTensors none;
  for (size_t i = 0; i < token_extras.size(); ++i) {
    const std::string& name = token_extras[i];
    const std::string field = absl::StrCat("token_extras[", i, "]");
    for (size_t j = 0; j < i; ++j) {
      if (token_extras[j] == name) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": expected distinct names; got \"",
                                                       name, "\" again (token_extras[", j, "])"));
      }
    }
    const auto spec = std::find_if(fn.extras.begin(), fn.extras.end(),
                                   [&](const ExtraSpec& e) { return e.name == name; });
    const std::vector<std::string> reported = fn.ReportedExtras(params, aux ? *aux : none);
    const std::string expected =
        reported.empty() ? absl::StrCat("no name: function ", fn.name, " reports no extras")
                         : absl::StrCat("one of the extras function ", fn.name, " reports (",
                                        absl::StrJoin(reported, ", "), ")");
    if (spec == fn.extras.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected ", expected, "; got \"", name, "\""));
    }
    const bool param_unmet = !spec->when_param.empty() && !(params.at(spec->when_param) > 0);
    const bool aux_unmet =
        aux != nullptr && !spec->when_aux.empty() && !aux->contains(spec->when_aux);
    if (param_unmet || aux_unmet) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, "; got \"",
                                                     name, "\", ", ConditionText(*spec)));
    }
  }
  return absl::OkStatus();
}

const std::vector<ParamSpec>& FunctionRegistry::CommonParams() {
  static const auto* specs = new std::vector<ParamSpec>{
      {kTemperatureParam, 1.0, 1e-6, kInf, "logits are divided by this"},
      {kSoftcapParam, 0.0, 0.0, kInf, "if > 0: logits <- softcap * tanh(logits / softcap)"},
      {kLogitScaleParam, 1.0, 1e-6, kInf,
       "logits are first multiplied by this (Cohere's logit_scale, Granite's 1 / logits_scaling)"},
  };
  return *specs;
}

torch::ScalarType OutputDtype(OutputKind kind, torch::ScalarType head_dtype,
                              torch::ScalarType logits_dtype) {
  if (kind == OutputKind::kLogits) return logits_dtype;
  return AccumulationDtype(head_dtype);
}

FunctionRegistry::FunctionRegistry(std::vector<TransformFunction> functions) {
  for (TransformFunction& fn : functions) {
    std::string name = fn.name;
    functions_.emplace(std::move(name), std::move(fn));
  }
}

const FunctionRegistry& FunctionRegistry::Builtin() {
  static const FunctionRegistry* registry = new FunctionRegistry(BuiltinFunctions());
  return *registry;
}

absl::StatusOr<const TransformFunction*> FunctionRegistry::Find(const std::string& name) const {
  const auto it = functions_.find(name);
  if (it == functions_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "function: expected one of ", absl::StrJoin(Names(), ", "), "; got \"", name, "\""));
  }
  return &it->second;
}

std::vector<std::string> FunctionRegistry::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, fn] : functions_) names.push_back(name);
  return names;
}

std::vector<const TransformFunction*> FunctionRegistry::Functions() const {
  std::vector<const TransformFunction*> functions;
  for (const auto& [name, fn] : functions_) functions.push_back(&fn);
  return functions;
}

absl::StatusOr<FunctionParams> FunctionRegistry::ResolveParams(const TransformFunction& fn,
                                                               const FunctionParams& given) const {
  std::vector<const ParamSpec*> specs;
  for (const ParamSpec& p : fn.params) specs.push_back(&p);
  for (const ParamSpec& p : CommonParams()) specs.push_back(&p);

  FunctionParams resolved;
  for (const ParamSpec* spec : specs) resolved[spec->name] = spec->default_value;
  for (const auto& [name, value] : given) {
    const ParamSpec* spec = nullptr;
    for (const ParamSpec* s : specs) {
      if (s->name == name) spec = s;
    }
    if (spec == nullptr) {
      std::vector<std::string> known;
      for (const ParamSpec* s : specs) known.push_back(s->name);
      return absl::InvalidArgumentError(absl::StrCat("params[\"", name, "\"]: function ", fn.name,
                                                     " expects only ", absl::StrJoin(known, ", ")));
    }
    if (!std::isfinite(value) || value < spec->min_value || value > spec->max_value) {
      return absl::InvalidArgumentError(
          absl::StrCat("params[\"", name, "\"]: expected a finite value in [", spec->min_value,
                       ", ", spec->max_value, "]; got ", value));
    }
    resolved[name] = value;
  }
  return resolved;
}

}  // namespace remotehead::core
