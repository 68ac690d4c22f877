#include "translate/step_header.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"
#include "service/head_expectations.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

absl::StatusOr<core::Reduction> FromWireReduction(v1::Reduction r) {
  switch (r) {
    case v1::REDUCTION_UNSPECIFIED:
    case v1::REDUCTION_MEAN:
      return core::Reduction::kMean;
    case v1::REDUCTION_SUM:
      return core::Reduction::kSum;
    case v1::REDUCTION_WEIGHTED_SUM:
      return core::Reduction::kWeightedSum;
    case v1::REDUCTION_NONE:
      return core::Reduction::kNone;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "header.function.reduction: expected NONE, SUM, MEAN or WEIGHTED_SUM; got ", r));
  }
}

// What to compute: the function, its params, the reduction and what it divides by.
absl::Status ReadFunction(const v1::StepHeader& header, core::CallMode mode,
                          core::StepOptions* options) {
  const v1::FunctionSpec& fn = header.function();
  options->function = fn.name().empty() ? "cross_entropy" : fn.name();
  options->params = core::FunctionParams(fn.params().begin(), fn.params().end());
  ASSIGN_OR_RETURN(options->reduction, FromWireReduction(fn.reduction()));
  if (options->reduction == core::Reduction::kNone && mode == core::CallMode::kFused) {
    return absl::InvalidArgumentError(
        "header.function.reduction: ForwardBackward needs a scalar loss (SUM, MEAN or "
        "WEIGHTED_SUM); got NONE — use Forward and Backward for per-token outputs");
  }
  if (fn.has_ignore_index()) options->ignore_index = fn.ignore_index();
  if (fn.has_normalizer()) {
    options->normalizer = fn.normalizer();
  } else if (options->reduction == core::Reduction::kMean) {
    if (!header.has_valid_tokens() || header.valid_tokens() < 0) {
      return absl::InvalidArgumentError(
          "header.valid_tokens: reduction MEAN without a normalizer needs the number of "
          "targets != ignore_index over all rows; got none");
    }
    // A mean over zero tokens is 0 with zero gradients (the engine's convention).
    options->normalizer = std::max<int64_t>(header.valid_tokens(), 1);
  }
  return absl::OkStatus();
}

// A floating dtype asked for by `field`.
absl::StatusOr<torch::ScalarType> FloatingDtype(v1::DType dtype, const char* field) {
  ASSIGN_OR_RETURN(const torch::ScalarType t, wire::FromWireDtype(dtype, field));
  if (!torch::isFloatingType(t)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected a floating dtype; got ", c10::toString(t)));
  }
  return t;
}

// The dtype of a "logits" Forward's rows (float32 unless asked).
absl::Status ReadOutputDtype(const v1::StepHeader& header, core::StepOptions* options) {
  if (header.output_dtype() == v1::DTYPE_UNSPECIFIED) return absl::OkStatus();
  ASSIGN_OR_RETURN(const core::TransformFunction* fn,
                   core::FunctionRegistry::Builtin().Find(options->function));
  if (fn->output != core::OutputKind::kLogits) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.output_dtype: expected unset (only function \"logits\" returns rows in a chosen "
        "dtype); got ",
        v1::DType_Name(header.output_dtype()), " with function \"", options->function, "\""));
  }
  ASSIGN_OR_RETURN(options->output_dtype,
                   FloatingDtype(header.output_dtype(), "header.output_dtype"));
  return absl::OkStatus();
}

// The dtype the logits GEMM forms the logits in (unset: the head's). Which dtypes are allowed
// is the engine's to say (core::PlanCall names the field, expected and actual).
absl::Status ReadLogitsDtype(const v1::StepHeader& header, core::StepOptions* options) {
  if (header.logits_dtype() == v1::DTYPE_UNSPECIFIED) return absl::OkStatus();
  ASSIGN_OR_RETURN(options->logits_dtype,
                   wire::FromWireDtype(header.logits_dtype(), "header.logits_dtype"));
  return absl::OkStatus();
}

// A two-head function's teacher: named for such a function (FunctionDescription.needs_teacher),
// and only for one. An unknown function is left to the plan, which names it.
absl::Status ReadTeacher(const v1::StepHeader& header, const core::StepOptions& options,
                         std::string* teacher_head_id) {
  const core::FunctionRegistry& registry =
      options.registry != nullptr ? *options.registry : core::FunctionRegistry::Builtin();
  const absl::StatusOr<const core::TransformFunction*> fn = registry.Find(options.function);
  if (!fn.ok()) return absl::OkStatus();
  const std::string& teacher = header.teacher_head_id();
  if ((*fn)->needs_teacher && teacher.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.teacher_head_id: expected the id of a frozen teacher head (function \"",
        options.function, "\" compares the student's logits with a teacher's); got none"));
  }
  if (!(*fn)->needs_teacher && !teacher.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.teacher_head_id: expected none (function \"", options.function,
        "\" uses one head; the two-head functions list needs_teacher); got \"", teacher, "\""));
  }
  *teacher_head_id = teacher;
  return absl::OkStatus();
}

// The fields that only some of the three RPCs take.
absl::Status CheckModeFields(const v1::StepHeader& header, core::CallMode mode) {
  const bool forward = mode == core::CallMode::kForward;
  if (forward && header.accumulate_weight_grad()) {
    return absl::InvalidArgumentError(
        "header.accumulate_weight_grad: Forward computes no gradients; got true");
  }
  if (header.retain_inputs_seconds() != 0 && (!forward || !(header.retain_inputs_seconds() > 0))) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.retain_inputs_seconds: expected 0, or > 0 on a Forward; got ",
                     header.retain_inputs_seconds(), forward ? "" : " on a gradient call"));
  }
  if (!header.inputs_handle().empty() && mode != core::CallMode::kBackward) {
    return absl::InvalidArgumentError(
        "header.inputs_handle: expected none (only Backward takes retained inputs); got one");
  }
  return absl::OkStatus();
}

// The identity an accumulating call's dW is applied under (once: a replay adds nothing), when
// the header names one. Its absence is refused by the session, after the incarnation and version
// checks: a trainer talking to a restarted server hears that first.
std::optional<GradientKey> ReadGradientId(const v1::StepHeader& header) {
  if (!header.has_gradient_id() || header.gradient_id().trainer().empty()) return std::nullopt;
  return GradientKey{header.gradient_id().trainer(), header.gradient_id().step(),
                     header.gradient_id().micro_batch()};
}

}  // namespace

absl::StatusOr<StepCall> ReadStepHeader(const v1::StepHeader& header, core::CallMode mode) {
  StepCall read{.head_id = header.head_id(),
                .rows = header.rows(),
                .expected_incarnation = header.expected_incarnation(),
                .inputs_handle = header.inputs_handle(),
                .retain_inputs_seconds = header.retain_inputs_seconds()};
  core::StepOptions& options = read.options;
  if (header.rows() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected >= 0; got ", header.rows()));
  }
  RETURN_IF_ERROR(ReadFunction(header, mode, &options));
  RETURN_IF_ERROR(CheckModeFields(header, mode));
  if (header.grad_hidden_dtype() != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(read.grad_hidden_dtype,
                     FloatingDtype(header.grad_hidden_dtype(), "header.grad_hidden_dtype"));
  }
  RETURN_IF_ERROR(ReadOutputDtype(header, &options));
  RETURN_IF_ERROR(ReadLogitsDtype(header, &options));
  RETURN_IF_ERROR(ReadTeacher(header, options, &read.teacher_head_id));
  // A server asks for the head's health on every call that trains (core::StepOptions::head_health
  // is off by default): its metrics and GetHead show it. Every rank of a group reads it here.
  options.head_health = true;
  options.chunk_rows = header.chunking().chunk_rows();
  options.memory_budget_bytes = header.chunking().memory_budget_bytes();
  if (header.has_upstream_scale()) options.upstream_scale = header.upstream_scale();
  // Checked against the function by the plan (core::CheckTokenExtras), naming token_extras[i].
  options.token_extras.assign(header.token_extras().begin(), header.token_extras().end());
  if (header.has_valid_tokens()) read.valid_tokens = header.valid_tokens();
  read.expected_weight_version = ExpectedWeightVersion(header);
  read.accumulate_weight_grad = header.accumulate_weight_grad();
  if (read.accumulate_weight_grad) read.gradient = ReadGradientId(header);
  return read;
}

void ToWire(const StepOutcome& outcome, v1::StepSummary* summary) {
  summary->set_replayed(outcome.replayed);
  summary->set_weight_version(outcome.weight_version);
  summary->set_incarnation(ServerIncarnation());
  summary->set_loss(outcome.loss);
  summary->set_valid_tokens(outcome.valid_tokens);
  summary->set_denominator(outcome.denominator);
  summary->set_chunk_rows(outcome.chunk_rows);
  summary->set_num_chunks(outcome.num_chunks);
  for (const auto& [name, value] : outcome.extras) (*summary->mutable_extras())[name] = value;
  if (!outcome.inputs_handle.empty()) summary->set_inputs_handle(outcome.inputs_handle);
}

}  // namespace remotehead::server
