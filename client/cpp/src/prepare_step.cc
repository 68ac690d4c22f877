#include "prepare_step.h"

#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/row_field.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/token_batch.h"
#include "status.h"

namespace remotehead::client::internal {

wire::Frames PreparedStep::RowsFrames(int64_t offset, int64_t count) const {
  struct Field {
    const torch::Tensor* tensor;
    v1::Tensor* (v1::StepRows::*head)();
    int number;
  };
  const Field fields[] = {
      {&hidden, &v1::StepRows::mutable_hidden, v1::StepRows::kHiddenFieldNumber},
      {&targets, &v1::StepRows::mutable_targets, v1::StepRows::kTargetsFieldNumber},
      {&weights, &v1::StepRows::mutable_weights, v1::StepRows::kWeightsFieldNumber},
      {&grad_output, &v1::StepRows::mutable_grad_output, v1::StepRows::kGradOutputFieldNumber},
      {&teacher_hidden, &v1::StepRows::mutable_teacher_hidden,
       v1::StepRows::kTeacherHiddenFieldNumber}};
  // The message without the tensors' bytes (their dtypes and shapes), then each tensor's bytes
  // from where they lie, then each aux tensor whole (a map entry).
  v1::StepRequest message;
  v1::StepRows* r = message.mutable_rows();
  r->set_row_offset(offset);
  std::vector<wire::RowBytes> spans;
  for (const Field& f : fields) {
    if (f.tensor->defined()) {
      spans.push_back(wire::EncodeRowsHead(*f.tensor, offset, count, (r->*f.head)()));
    }
  }
  wire::Frames frames;
  frames.AppendMessage(message);
  size_t next = 0;
  for (const Field& f : fields) {
    if (!f.tensor->defined()) continue;
    frames.AppendTensorData({v1::StepRequest::kRowsFieldNumber, f.number},
                            v1::Tensor::kDataFieldNumber, spans[next++], wire::Holding(*f.tensor));
  }
  for (const auto& [name, t] : aux) {
    v1::Tensor head;
    const wire::RowBytes span = wire::EncodeRowsHead(t, offset, count, &head);
    frames.AppendMapTensor({v1::StepRequest::kRowsFieldNumber}, v1::StepRows::kAuxFieldNumber, name,
                           head, span, wire::Holding(t));
  }
  return frames;
}

torch::Tensor PreparedStep::Expand(const torch::Tensor& t) const {
  if (!t.defined() || !kept.defined()) return t;
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] = caller_rows;
  torch::Tensor full = torch::zeros(sizes, t.options());
  full.index_copy_(0, kept, t);
  return full;
}

namespace {

// Whether `name` is how the server names one of the per-row inputs `p` sent — the only fields
// whose index is a row (token_extras[1] or params["x"] name something else).
bool NamesRowInput(const PreparedStep& p, std::string_view name) {
  const std::pair<std::string_view, const torch::Tensor*> inputs[] = {
      {"hidden", &p.hidden},
      {"targets", &p.targets},
      {"weights", &p.weights},
      {"grad_output", &p.grad_output},
      {"teacher_hidden", &p.teacher_hidden}};
  for (const auto& [input, t] : inputs) {
    if (name == input) return t->defined();
  }
  for (const auto& [aux, t] : p.aux) {
    if (name == absl::StrCat("aux[\"", aux, "\"]")) return true;
  }
  return false;
}

}  // namespace

absl::Status PreparedStep::CallerError(absl::Status status) const {
  if (status.ok() || !kept.defined()) return status;
  std::optional<core::ErrorReason> reason = core::GetReason(status);
  if (!reason.has_value() || !reason->metadata.contains("field")) return status;
  const std::optional<core::RowField> named = core::ParseRowField(reason->metadata.at("field"));
  if (!named || !NamesRowInput(*this, named->input) || named->row >= kept.size(0)) {
    return status;  // not a row this client sent: as the server said it
  }
  return core::RenameField(status, *std::move(reason),
                           absl::StrCat(named->input, "[", kept[named->row].item<int64_t>(), "]"));
}

namespace {

v1::Reduction ToWire(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone:
      return v1::REDUCTION_NONE;
    case Reduction::kSum:
      return v1::REDUCTION_SUM;
    case Reduction::kWeightedSum:
      return v1::REDUCTION_WEIGHTED_SUM;
    case Reduction::kMean:
      break;
  }
  return v1::REDUCTION_MEAN;
}

// A per-token [N] input: checked, converted to a wire dtype (integers to int64/int32 for
// targets, anything floating kept as it is) and laid out for the wire.
absl::StatusOr<torch::Tensor> PreparePerToken(const torch::Tensor& t, int64_t rows,
                                              const std::string& field, bool integral) {
  if (t.dim() != 1 || t.size(0) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected shape [", rows, "]; got ", ShapeOf(t)));
  }
  const torch::ScalarType dtype = t.scalar_type();
  if (integral) {
    if (!c10::isIntegralType(dtype, /*includeBool=*/false)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": expected integer token ids; got ",
                                                     std::string(c10::toString(dtype))));
    }
    const bool on_wire = dtype == torch::kLong || dtype == torch::kInt;
    return wire::ToWireLayout(t, on_wire ? dtype : torch::kLong);
  }
  if (!c10::isFloatingType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected a floating tensor; got ",
                                                   std::string(c10::toString(dtype))));
  }
  RETURN_IF_ERROR(wire::ToWireDtype(dtype, field).status());
  return wire::ToWireLayout(t);
}

// An aux input: [N] or [N, k] (a function's topk_aux), floating, or integer token ids (its
// integral_aux: int64 / int32 as they are, other integer dtypes as int64); laid out for the wire.
// Which shape and dtype each name needs is the server's to check.
absl::StatusOr<torch::Tensor> PrepareAux(const torch::Tensor& t, int64_t rows,
                                         const std::string& field) {
  if ((t.dim() != 1 && t.dim() != 2) || t.size(0) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected shape [", rows, "] or [", rows, ", k]; got ", ShapeOf(t)));
  }
  const torch::ScalarType dtype = t.scalar_type();
  if (c10::isIntegralType(dtype, /*includeBool=*/false)) {
    const bool on_wire = dtype == torch::kLong || dtype == torch::kInt;
    return wire::ToWireLayout(t, on_wire ? dtype : torch::kLong);
  }
  if (!c10::isFloatingType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected a floating or integer tensor; got ", std::string(c10::toString(dtype))));
  }
  RETURN_IF_ERROR(wire::ToWireDtype(dtype, field).status());
  return wire::ToWireLayout(t);
}

// A two-head call's teacher hidden states: [N, D_teacher], floating, sent in their own dtype.
absl::StatusOr<torch::Tensor> PrepareTeacherHidden(const StepSpec& spec, const torch::Tensor& t,
                                                   int64_t rows) {
  if (spec.teacher_head_id.empty()) {
    return absl::InvalidArgumentError(
        "inputs.teacher_hidden: expected none without spec.teacher_head_id; got a tensor");
  }
  if (t.dim() != 2 || t.size(0) != rows || !c10::isFloatingType(t.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.teacher_hidden: expected a floating [", rows, ", D_teacher] tensor; got ",
        std::string(c10::toString(t.scalar_type())), " ", ShapeOf(t)));
  }
  RETURN_IF_ERROR(wire::ToWireDtype(t.scalar_type(), "inputs.teacher_hidden").status());
  return wire::ToWireLayout(t);
}

// Checks the caller's inputs and lays out what travels with the rows. A Backward by inputs
// handle sends none of them (they are not even copied), but its targets still count the valid
// tokens of a MEAN.
absl::Status PrepareInputs(const StepSpec& spec, const StepInputs& inputs, PreparedStep& p) {
  const torch::Tensor& x = inputs.hidden;
  if (!x.defined() || x.dim() != 2 || !c10::isFloatingType(x.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.hidden: expected a floating [N, D] tensor; got ",
        x.defined() ? absl::StrCat(std::string(c10::toString(x.scalar_type())), " ", ShapeOf(x))
                    : "none"));
  }
  p.rows = x.size(0);
  p.hidden_size = x.size(1);
  p.result_dtype = x.scalar_type();
  const torch::ScalarType send_dtype = spec.wire_dtype.value_or(x.scalar_type());
  RETURN_IF_ERROR(wire::ToWireDtype(send_dtype, "spec.wire_dtype").status());
  RETURN_IF_ERROR(wire::ToWireDtype(p.result_dtype, "inputs.hidden").status());
  if (inputs.targets.defined()) {
    ASSIGN_OR_RETURN(p.targets, PreparePerToken(inputs.targets, p.rows, "inputs.targets", true));
  }
  if (p.by_handle()) return absl::OkStatus();
  p.hidden = wire::ToWireLayout(x, send_dtype);
  if (inputs.weights.defined()) {
    ASSIGN_OR_RETURN(p.weights, PreparePerToken(inputs.weights, p.rows, "inputs.weights", false));
  }
  for (const auto& [name, t] : inputs.aux) {
    ASSIGN_OR_RETURN(torch::Tensor prepared,
                     PrepareAux(t, p.rows, absl::StrCat("inputs.aux[\"", name, "\"]")));
    p.aux.emplace_back(name, std::move(prepared));
  }
  if (inputs.teacher_hidden.defined()) {
    ASSIGN_OR_RETURN(p.teacher_hidden, PrepareTeacherHidden(spec, inputs.teacher_hidden, p.rows));
  } else if (!spec.teacher_head_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.teacher_hidden: expected the teacher's hidden states [", p.rows,
        ", D_teacher] with spec.teacher_head_id \"", spec.teacher_head_id, "\"; got none"));
  }
  return absl::OkStatus();
}

// The header fields every step call sends: what to compute, how many rows, and the count of
// valid tokens a MEAN without normalizer divides by — the server scales each chunk's dX by it
// before the later rows arrive, so it needs the count up front.
absl::Status WriteHeader(const StepSpec& spec, const PreparedStep& p, v1::StepHeader* h) {
  h->set_head_id(spec.head_id);
  v1::FunctionSpec* fn = h->mutable_function();
  fn->set_name(spec.function);
  for (const auto& [name, value] : spec.params) (*fn->mutable_params())[name] = value;
  fn->set_reduction(ToWire(spec.reduction));
  fn->set_ignore_index(spec.ignore_index);
  if (spec.normalizer.has_value()) fn->set_normalizer(*spec.normalizer);
  h->mutable_chunking()->set_chunk_rows(spec.chunk_rows);
  h->mutable_chunking()->set_memory_budget_bytes(spec.memory_budget_bytes);
  h->set_rows(p.rows);
  if (spec.expected_weight_version.has_value()) {
    h->set_expected_weight_version(*spec.expected_weight_version);
  }
  if (!spec.expected_incarnation.empty()) h->set_expected_incarnation(spec.expected_incarnation);
  if (spec.reduction == Reduction::kMean && !spec.normalizer.has_value()) {
    if (p.by_handle() && !spec.valid_tokens.has_value() && !p.targets.defined()) {
      return absl::InvalidArgumentError(
          "inputs.targets: a Backward by inputs_handle with reduction MEAN and no normalizer "
          "needs the targets (or spec.valid_tokens) to count the valid tokens; got neither");
    }
    h->set_valid_tokens(spec.valid_tokens.has_value()
                            ? *spec.valid_tokens
                            : core::CountValidTokens(p.targets, spec.ignore_index, p.rows));
  }
  if (p.mode == core::CallMode::kForward && spec.retain_inputs_seconds > 0) {
    h->set_retain_inputs_seconds(spec.retain_inputs_seconds);
  }
  if (p.by_handle()) h->set_inputs_handle(spec.inputs_handle);
  if (!spec.teacher_head_id.empty()) h->set_teacher_head_id(spec.teacher_head_id);
  for (const std::string& name : spec.token_extras) h->add_token_extras(name);
  if (spec.output_dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType dtype,
                     wire::ToWireDtype(*spec.output_dtype, "spec.output_dtype"));
    h->set_output_dtype(dtype);
  }
  if (spec.logits_dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType dtype,
                     wire::ToWireDtype(*spec.logits_dtype, "spec.logits_dtype"));
    h->set_logits_dtype(dtype);
  }
  return absl::OkStatus();
}

// What a gradient call adds to the header: whether and under which identity dW accumulates,
// dX's dtype, and the upstream gradient — up front for ForwardBackward (upstream_scale); for a
// Backward, dL/dy per row (reduction NONE) or dL/d(loss) as the header's upstream_scale.
absl::Status PrepareGradient(const StepSpec& spec, const torch::Tensor& grad_output,
                             PreparedStep& p, v1::StepHeader* h) {
  if (p.mode == core::CallMode::kForward) return absl::OkStatus();
  h->set_accumulate_weight_grad(spec.accumulate_weight_grad);
  ASSIGN_OR_RETURN(const v1::DType dx_dtype, wire::ToWireDtype(p.result_dtype, "inputs.hidden"));
  h->set_grad_hidden_dtype(dx_dtype);
  if (spec.gradient_id.has_value()) {
    h->mutable_gradient_id()->set_trainer(spec.gradient_id->trainer);
    h->mutable_gradient_id()->set_step(spec.gradient_id->step);
    h->mutable_gradient_id()->set_micro_batch(spec.gradient_id->micro_batch);
  }
  if (p.mode == core::CallMode::kFused) {
    h->set_upstream_scale(spec.upstream_scale);
    return absl::OkStatus();
  }
  if (spec.reduction == Reduction::kNone) {
    if (!grad_output.defined()) {
      return absl::InvalidArgumentError(
          "grad_output: Backward with reduction NONE needs dL/dy for every row; got none");
    }
    ASSIGN_OR_RETURN(p.grad_output,
                     PreparePerToken(grad_output, p.rows, "grad_output", /*integral=*/false));
    return absl::OkStatus();
  }
  if (!grad_output.defined() || grad_output.numel() != 1 ||
      !c10::isFloatingType(grad_output.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_output: expected one floating value (dL/d(loss)) for a scalar reduction; got ",
        grad_output.defined() ? ShapeOf(grad_output) : "none"));
  }
  h->set_upstream_scale(grad_output.item<double>());
  return absl::OkStatus();
}

// Row messages sized on all the bytes of a row — hidden, targets, weights, grad_output, aux —
// plus their framing, so that no message exceeds chunk_bytes.
absl::Status PlanRows(int64_t chunk_bytes, PreparedStep& p) {
  int64_t bytes_per_row =
      p.hidden.defined() ? p.hidden_size * static_cast<int64_t>(p.hidden.element_size()) : 0;
  int64_t tensors = p.hidden.defined() ? 1 : 0, name_bytes = 0;
  for (const torch::Tensor* t : {&p.targets, &p.weights, &p.grad_output}) {
    if (!t->defined()) continue;
    bytes_per_row += t->element_size();
    ++tensors;
  }
  for (const auto& [name, t] : p.aux) {
    bytes_per_row += t.element_size() * (t.dim() == 2 ? t.size(1) : 1);
    ++tensors;
    name_bytes += static_cast<int64_t>(name.size());
  }
  if (p.teacher_hidden.defined()) {
    bytes_per_row +=
        p.teacher_hidden.size(1) * static_cast<int64_t>(p.teacher_hidden.element_size());
    ++tensors;
  }
  ASSIGN_OR_RETURN(p.chunks,
                   wire::PlanRequestChunks(p.rows, bytes_per_row,
                                           wire::FramingBytes(tensors, name_bytes), chunk_bytes));
  return absl::OkStatus();
}

// Keeps only the rows `keep` ([k] int64, increasing) of every per-row tensor that travels: the
// header says their number, and p.kept records which rows of the caller's they are. Keeping
// every row leaves the step as it is.
void CompactRows(const torch::Tensor& keep, PreparedStep& p) {
  if (keep.size(0) == p.rows) return;
  p.kept = keep;
  p.caller_rows = p.rows;
  for (torch::Tensor* t : {&p.hidden, &p.targets, &p.weights, &p.grad_output, &p.teacher_hidden}) {
    if (t->defined()) *t = t->index_select(0, keep);
  }
  for (auto& [name, t] : p.aux) t = t.index_select(0, keep);
  p.rows = keep.size(0);
  p.header.mutable_header()->set_rows(p.rows);
}

}  // namespace

absl::StatusOr<PreparedStep> PrepareStep(const StepSpec& spec, const StepInputs& inputs,
                                         core::CallMode mode, const torch::Tensor& grad_output,
                                         int64_t chunk_bytes, bool compact,
                                         const torch::Tensor& keep, int64_t keep_of) {
  PreparedStep p;
  p.mode = mode;
  p.inputs_handle = mode == core::CallMode::kBackward ? spec.inputs_handle : "";
  RETURN_IF_ERROR(PrepareInputs(spec, inputs, p));
  v1::StepHeader* h = p.header.mutable_header();
  RETURN_IF_ERROR(WriteHeader(spec, p, h));
  RETURN_IF_ERROR(PrepareGradient(spec, grad_output, p, h));
  // What to leave out: the rows whose target is ignore_index (core::ContributingRows, the
  // server's rule), or what the Forward of this Backward's handle left out (when of these rows;
  // otherwise the server says what is wrong).
  if (keep.defined() && keep_of == p.rows) {
    CompactRows(keep, p);
  } else if (compact && p.targets.defined()) {
    CompactRows(core::ContributingRows(p.targets, spec.ignore_index), p);
  }
  if (p.by_handle()) {
    // The server has the inputs: only dL/dy goes with the rows, and a scalar reduction sends no
    // rows at all.
    p.targets = torch::Tensor();  // read for the valid-token count only
    if (!p.grad_output.defined()) return p;
  }
  RETURN_IF_ERROR(PlanRows(chunk_bytes, p));
  return p;
}

}  // namespace remotehead::client::internal
