// The server's function listing (functions.h): ListFunctions read once per Client, each
// function's description converted from the wire.
#include "functions.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::client::internal {
namespace {

absl::StatusOr<OutputKind> OutputKindFromWire(v1::OutputKind kind, const std::string& function) {
  switch (kind) {
    case v1::OUTPUT_KIND_PER_TOKEN:
      return OutputKind::kPerToken;
    case v1::OUTPUT_KIND_LOGITS:
      return OutputKind::kLogits;
    case v1::OUTPUT_KIND_SAMPLE:
      return OutputKind::kSample;
    default:
      return absl::InternalError(absl::StrCat("functions[\"", function,
                                              "\"].output_kind: expected PER_TOKEN, LOGITS or "
                                              "SAMPLE; got ",
                                              static_cast<int>(kind)));
  }
}

absl::StatusOr<FunctionInfo> FunctionFromWire(const v1::FunctionDescription& d) {
  FunctionInfo info{.name = d.name(),
                    .help = d.help(),
                    .needs_targets = d.needs_targets(),
                    .required_aux = {d.required_aux().begin(), d.required_aux().end()},
                    .optional_aux = {d.optional_aux().begin(), d.optional_aux().end()},
                    .output_float64_on_float64_heads = d.output_float64_on_float64_heads(),
                    .differentiable = d.differentiable(),
                    .vocab_decomposable = d.vocab_decomposable(),
                    .needs_teacher = d.needs_teacher(),
                    .topk_aux = {d.topk_aux().begin(), d.topk_aux().end()},
                    .integral_aux = {d.integral_aux().begin(), d.integral_aux().end()},
                    .ignored_rows_contribute_nothing = d.ignored_rows_contribute_nothing()};
  for (const v1::FunctionParameter& p : d.params()) {
    info.params.push_back({.name = p.name(),
                           .default_value = p.default_value(),
                           .min_value = p.min_value(),
                           .max_value = p.max_value(),
                           .help = p.help(),
                           .common = p.common()});
  }
  for (const v1::FunctionExtra& e : d.extras()) {
    info.extras.push_back({.name = e.name(),
                           .help = e.help(),
                           .when_param = e.when_param(),
                           .when_aux = e.when_aux()});
  }
  ASSIGN_OR_RETURN(info.output_kind, OutputKindFromWire(d.output_kind(), d.name()));
  ASSIGN_OR_RETURN(info.output_dtype,
                   wire::FromWireDtype(d.output_dtype(),
                                       absl::StrCat("functions[\"", d.name(), "\"].output_dtype")));
  return info;
}

}  // namespace

absl::StatusOr<std::vector<FunctionInfo>> FunctionListing::All() {
  std::lock_guard<std::mutex> lock(mu_);
  if (functions_.has_value()) return *functions_;
  v1::ListFunctionsResponse response;
  // Every front of a mesh lists the same functions: any that is there answers.
  RETURN_IF_ERROR(channel_.ToLeader([&](Stub* on) {
    return channel_.Unary("ListFunctions", &Stub::ListFunctions, v1::ListFunctionsRequest(),
                          &response, on);
  }));
  std::vector<FunctionInfo> listed;
  for (const v1::FunctionDescription& d : response.functions()) {
    ASSIGN_OR_RETURN(FunctionInfo info, FunctionFromWire(d));
    listed.push_back(std::move(info));
  }
  functions_ = listed;
  return listed;
}

absl::StatusOr<std::optional<FunctionInfo>> FunctionListing::Find(const std::string& name) {
  ASSIGN_OR_RETURN(const std::vector<FunctionInfo> listed, All());
  for (const FunctionInfo& f : listed) {
    if (f.name == name) return f;
  }
  return std::nullopt;
}

}  // namespace remotehead::client::internal
