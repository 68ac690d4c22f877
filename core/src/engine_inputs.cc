// Every input of an engine call checked against the head, the function and the options before
// any state is touched, and the call's Plan (engine_internal.h).
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_internal.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/row_field.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core::engine_internal {
namespace {

// The checks a per-token input ([N], CheckPerToken) and a top-k aux input ([N, k], CheckTopkAux)
// share once their shape is right: on `device`; int64 / int32 when `integral`, else a floating
// dtype with finite values — a bad row of [N] names its value, one of [N, k] says NaN or Inf.
absl::Status CheckValues(const torch::Tensor& t, const std::string& field,
                         const torch::Device& device, bool integral, const Plan& plan) {
  if (t.device() != device) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected device ", device.str(), "; got ", t.device().str()));
  }
  const torch::ScalarType dt = t.scalar_type();
  if (integral ? (dt != torch::kLong && dt != torch::kInt) : !IsFloating(dt)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected dtype ",
                                                   integral ? "int64 or int32" : "a floating dtype",
                                                   "; got ", DtypeName(dt)));
  }
  const int64_t bad = integral ? -1 : FirstNonFiniteRow(t);
  if (bad < 0) return absl::OkStatus();
  if (t.dim() == 1) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[", plan.RowNumber(bad),
                                                   "]: expected a finite value; got ",
                                                   t[bad].item<double>()));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, "[", plan.RowNumber(bad), "]: expected finite values; got NaN or Inf"));
}

absl::Status CheckTargets(const Head& head, const TokenBatch& batch, const Plan& plan) {
  RETURN_IF_ERROR(CheckPerToken(batch.targets, "targets", plan.rows, head.device(), true, plan));
  const torch::Tensor t = batch.targets;
  const torch::Tensor bad =
      (t != plan.ignore_index).logical_and((t < 0).logical_or(t >= plan.vocab_size));
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    return absl::InvalidArgumentError(absl::StrCat(
        "targets[", plan.RowNumber(i), "]: expected a token id in [0, ", plan.vocab_size,
        ") or ignore_index (", plan.ignore_index, "); got ", t[i].item<int64_t>()));
  }
  return absl::OkStatus();
}

// A top-k aux input: [N, k] with the same k as every other top-k input of the call; ids in
// [0, V) and distinct within their row, values finite.
absl::Status CheckTopkAux(const torch::Tensor& t, const std::string& field, AuxKind kind,
                          const Head& head, const Plan& plan, int64_t* k) {
  if (t.dim() != 2 || t.size(0) != plan.rows || (*k >= 0 && t.size(1) != *k)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected shape [", plan.rows, ", ", *k >= 0 ? absl::StrCat(*k) : "k",
        "] (k per row of hidden", *k >= 0 ? ", as the other top-k inputs" : "", "); got ",
        ShapeOf(t)));
  }
  *k = t.size(1);
  const bool ids = kind == AuxKind::kTopkIds;
  RETURN_IF_ERROR(CheckValues(t, field, head.device(), ids, plan));
  if (!ids) return absl::OkStatus();
  const torch::Tensor out_of_range = ((t < 0).logical_or(t >= plan.vocab_size)).any(1);
  if (out_of_range.any().item<bool>()) {
    const int64_t row = out_of_range.nonzero()[0][0].item<int64_t>();
    return absl::InvalidArgumentError(absl::StrCat(field, "[", plan.RowNumber(row),
                                                   "]: expected token ids in [0, ", plan.vocab_size,
                                                   "); got ", c10::str(t[row])));
  }
  if (t.size(1) > 1) {
    const torch::Tensor sorted = std::get<0>(t.sort(1));
    const torch::Tensor repeated =
        (sorted.narrow(1, 1, t.size(1) - 1) == sorted.narrow(1, 0, t.size(1) - 1)).any(1);
    if (repeated.any().item<bool>()) {
      const int64_t row = repeated.nonzero()[0][0].item<int64_t>();
      return absl::InvalidArgumentError(absl::StrCat(field, "[", plan.RowNumber(row),
                                                     "]: expected distinct token ids; got ",
                                                     c10::str(t[row])));
    }
  }
  return absl::OkStatus();
}

// A function's validate names a row by its index in the batch it is given ("aux[\"x\"][3]: …",
// the message's leading field); the caller's request numbers that row otherwise (rows the
// server left out, a call's later messages). The leading field, and the ErrorInfo metadata
// "field" made from it, become plan.RowNumber's name for the row.
absl::Status NameRowAsRequested(absl::Status status, const Plan& plan) {
  if (status.ok()) return status;
  ErrorReason reason = ReasonOf(status);
  const auto field = reason.metadata.find("field");
  if (field == reason.metadata.end()) return status;
  const std::optional<RowField> named = ParseRowField(field->second);
  if (!named) return status;
  return RenameField(status, std::move(reason),
                     absl::StrCat(named->input, "[", plan.RowNumber(named->row), "]"));
}

absl::Status CheckAux(const Head& head, const TokenBatch& batch, const Plan& plan) {
  const TransformFunction& fn = plan.fn();
  int64_t k = -1;  // the top-k inputs' k, once one is seen
  for (const auto& [name, tensor] : batch.aux) {
    const bool known = std::count(fn.required_aux.begin(), fn.required_aux.end(), name) +
                           std::count(fn.optional_aux.begin(), fn.optional_aux.end(), name) >
                       0;
    if (!known) {
      std::vector<std::string> accepted = fn.required_aux;
      accepted.insert(accepted.end(), fn.optional_aux.begin(), fn.optional_aux.end());
      return absl::InvalidArgumentError(
          absl::StrCat("aux[\"", name, "\"]: function ", fn.name, " accepts ",
                       accepted.empty() ? std::string("no per-token inputs")
                                        : absl::StrCat("only ", absl::StrJoin(accepted, ", "))));
    }
    const std::string field = absl::StrCat("aux[\"", name, "\"]");
    const AuxKind kind = fn.aux_kind(name);
    if (kind == AuxKind::kPerToken || kind == AuxKind::kPerTokenIds) {
      RETURN_IF_ERROR(CheckPerToken(tensor, field, plan.rows, head.device(),
                                    kind == AuxKind::kPerTokenIds, plan));
    } else {
      RETURN_IF_ERROR(CheckTopkAux(tensor, field, kind, head, plan, &k));
    }
  }
  for (const std::string& name : fn.required_aux) {
    if (!batch.aux.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("aux[\"", name, "\"]: function ", fn.name,
                                                     " needs this per-token input; got none"));
    }
  }
  if (fn.validate) {
    RETURN_IF_ERROR(
        NameRowAsRequested(fn.validate(plan.params(), batch.aux, batch.targets.defined()), plan));
  }
  return absl::OkStatus();
}

// A two-head function's teacher and its hidden states; neither for any other function.
absl::Status CheckTeacher(const Head& head, const TokenBatch& batch, const StepOptions& options,
                          const Plan& plan) {
  const TransformFunction& fn = plan.fn();
  if (!fn.needs_teacher) {
    if (options.teacher != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "teacher: function ", fn.name, " takes no teacher head (only two-head functions do)"));
    }
    if (batch.teacher_hidden.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("teacher_hidden: function ", fn.name, " takes no teacher hidden states; got ",
                       ShapeOf(batch.teacher_hidden)));
    }
    return absl::OkStatus();
  }
  const Head* teacher = options.teacher;
  if (teacher == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher: function ", fn.name, " compares the head with a teacher head; got none"));
  }
  if (teacher->vocab_size() != head.vocab_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("teacher.vocab_size: expected ", head.vocab_size(),
                     " (the student head's rows); got ", teacher->vocab_size()));
  }
  if (teacher->device() != head.device()) {
    return absl::InvalidArgumentError(absl::StrCat("teacher: expected device ",
                                                   head.device().str(), " (the student's); got ",
                                                   teacher->device().str()));
  }
  const torch::Tensor& xt = batch.teacher_hidden;
  if (!xt.defined() || xt.dim() != 2 || xt.size(0) != plan.rows ||
      xt.size(1) != teacher->hidden_size()) {
    return absl::InvalidArgumentError(absl::StrCat("teacher_hidden: expected shape [", plan.rows,
                                                   ", ", teacher->hidden_size(),
                                                   "] (rows of hidden, the teacher's D); got ",
                                                   ShapeOf(xt)));
  }
  if (xt.scalar_type() != teacher->dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat("teacher_hidden.dtype: expected ", DtypeName(teacher->dtype()),
                     " (the teacher head's); got ", DtypeName(xt.scalar_type())));
  }
  if (xt.device() != teacher->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_hidden: expected device ", teacher->device().str(), "; got ", xt.device().str()));
  }
  return absl::OkStatus();
}

absl::Status CheckHidden(const Head& head, const TokenBatch& batch) {
  const torch::Tensor& x = batch.hidden;
  if (!x.defined() || x.dim() != 2 || x.size(1) != head.hidden_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: expected shape [N, ", head.hidden_size(), "]; got ", ShapeOf(x)));
  }
  if (x.scalar_type() != head.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("hidden.dtype: expected ",
                                                   DtypeName(head.dtype()), " (the head's); got ",
                                                   DtypeName(x.scalar_type())));
  }
  if (x.device() != head.device()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: expected device ", head.device().str(), "; got ", x.device().str()));
  }
  return absl::OkStatus();
}

// Row-chunked so that the check's own memory stays within one chunk.
absl::Status CheckHiddenFinite(const torch::Tensor& x, const std::string& field, int64_t chunk_rows,
                               const Plan& plan) {
  torch::NoGradGuard no_grad;
  for (int64_t start = 0; start < x.size(0); start += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, x.size(0) - start);
    const int64_t bad = FirstNonFiniteRow(x.narrow(0, start, rows));
    if (bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", plan.RowNumber(start + bad),
                                                     "]: expected finite values; got NaN or Inf"));
    }
  }
  return absl::OkStatus();
}

// Checks the per-token inputs against the head and the function: targets, weights and aux.
absl::Status CheckTokenInputs(const Head& head, const TokenBatch& batch, const StepOptions& options,
                              const Plan& plan) {
  if (batch.targets.defined() && plan.fn().output != OutputKind::kPerToken) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets: function ", plan.fn().name,
        " takes none (it is computed from hidden alone); got ", ShapeOf(batch.targets)));
  }
  if (batch.targets.defined()) {
    RETURN_IF_ERROR(CheckTargets(head, batch, plan));
  } else if (plan.fn().needs_targets) {
    return absl::InvalidArgumentError(absl::StrCat("targets: function ", plan.fn().name,
                                                   " needs per-token targets [", plan.rows,
                                                   "]; got none"));
  }
  if (options.reduction == Reduction::kWeightedSum) {
    if (!batch.weights.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weights: reduction weighted_sum needs per-token weights [", plan.rows, "]; got none"));
    }
    RETURN_IF_ERROR(CheckPerToken(batch.weights, "weights", plan.rows, head.device(), false, plan));
  } else if (batch.weights.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: only used by reduction weighted_sum; got weights with reduction ",
                     std::string(ReductionName(options.reduction))));
  }
  RETURN_IF_ERROR(CheckTeacher(head, batch, options, plan));
  return CheckAux(head, batch, plan);
}

absl::Status CheckScalarOptions(const StepOptions& options) {
  if (options.normalizer.has_value() &&
      (!std::isfinite(*options.normalizer) || *options.normalizer <= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer: expected a finite value > 0; got ", *options.normalizer));
  }
  if (!std::isfinite(options.upstream_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("upstream_scale: expected a finite value; got ", options.upstream_scale));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsFloating(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kDouble || t == torch::kBFloat16 || t == torch::kHalf;
}

std::string ShapeOf(const torch::Tensor& t) {
  return t.defined() ? c10::str(t.sizes()) : std::string("no tensor");
}

int64_t FirstNonFiniteRow(const torch::Tensor& t) {
  // One pass first: a NaN or an Inf anywhere makes the sum NaN or Inf, so a finite sum means
  // every value is finite (the common case, read once, nothing allocated but the sum). A sum
  // that is not finite — a bad value, or finite values too large to add up — is then searched
  // element by element. fp16's range is too small for sums: its sum is taken in fp32.
  const torch::Tensor sum =
      t.scalar_type() == torch::kHalf ? t.sum(torch::kFloat) : t.sum();
  if (std::isfinite(sum.item<double>())) return -1;
  const torch::Tensor bad = torch::isfinite(t).logical_not();
  const torch::Tensor rows = t.dim() == 1 ? bad : bad.any(1);
  if (!rows.any().item<bool>()) return -1;
  return rows.nonzero()[0][0].item<int64_t>();
}

absl::Status CheckPerToken(const torch::Tensor& t, const std::string& field, int64_t n,
                           const torch::Device& device, bool integral, const Plan& plan) {
  if (t.dim() != 1 || t.size(0) != n) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape [", n,
                                                   "] (one per row of hidden); got ", ShapeOf(t)));
  }
  return CheckValues(t, field, device, integral, plan);
}

absl::StatusOr<Plan> MakePlan(const Head& head, const TokenBatch& batch, const StepOptions& options,
                              CallMode mode) {
  Plan plan;
  if (options.shard != nullptr) RETURN_IF_ERROR(CheckVocabShard(*options.shard, head.vocab_size()));
  ASSIGN_OR_RETURN(plan.call, PlanCall(head, options));
  RETURN_IF_ERROR(CheckCallMode(plan.call, mode, options.reduction));
  plan.shard = options.shard;
  plan.vocab_size = options.shard != nullptr ? options.shard->vocab_size() : head.vocab_size();
  if (options.shard != nullptr && options.shard->ranges.size() > 1) {
    plan.vocab = std::make_unique<ShardVocabOps>(*options.shard);
  } else {
    plan.vocab = std::make_unique<LocalVocabOps>(head.vocab_size());
  }
  plan.reduction = options.reduction;
  plan.should_stop = options.should_stop;
  plan.head_health = options.head_health;
  plan.phases = options.phases;
  plan.logits_workspace = options.logits_workspace;
  plan.first_row = options.first_row;
  plan.row_numbers = options.row_numbers;
  plan.ignore_index = options.ignore_index;
  // From here on the inputs' values are checked: reads on the host of values on the device.
  const PhaseScope checks(options.phases, StepPhase::kHostSync);
  RETURN_IF_ERROR(CheckHidden(head, batch));
  plan.rows = batch.rows();

  torch::NoGradGuard no_grad;
  RETURN_IF_ERROR(CheckTokenInputs(head, batch, options, plan));
  RETURN_IF_ERROR(CheckTokenExtras(plan.fn(), plan.params(), &batch.aux, options.token_extras));
  plan.reported_extras = plan.fn().ReportedExtras(plan.params(), batch.aux);
  plan.token_extras = options.token_extras;
  plan.teacher = plan.fn().needs_teacher ? options.teacher : nullptr;
  RETURN_IF_ERROR(CheckScalarOptions(options));
  plan.chunk_rows = plan.call.ChunkRowsFor(plan.rows);
  plan.block_rows = plan.call.BlockRowsFor(plan.rows);
  RETURN_IF_ERROR(CheckHiddenFinite(batch.hidden, "hidden", plan.chunk_rows, plan));
  if (plan.teacher != nullptr) {
    RETURN_IF_ERROR(
        CheckHiddenFinite(batch.teacher_hidden, "teacher_hidden", plan.chunk_rows, plan));
  }

  plan.valid_tokens = CountValidTokens(batch.targets, options.ignore_index, plan.rows);
  if (options.normalizer.has_value()) {
    plan.denominator = *options.normalizer;
  } else if (options.reduction == Reduction::kMean) {
    plan.denominator = std::max<int64_t>(plan.valid_tokens, 1);  // Σ over 0 tokens is 0
  }
  return plan;
}

}  // namespace remotehead::core::engine_internal
