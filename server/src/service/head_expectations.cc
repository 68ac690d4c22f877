#include "service/head_expectations.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::server {

const std::string& ServerIncarnation() {
  static const std::string incarnation = [] {
    std::mt19937_64 rng{std::random_device{}()};
    return absl::StrFormat("%016x", rng());
  }();
  return incarnation;
}

absl::Status CheckIncarnation(const std::string& expected, const std::string& field,
                              const HeadDescription& head) {
  if (expected.empty() || expected == ServerIncarnation()) return absl::OkStatus();
  const absl::Status status = absl::FailedPreconditionError(absl::StrCat(
      field, ": expected the server process \"", expected, "\"; got \"", ServerIncarnation(),
      "\": the server restarted, and the dW and gradient ids accumulated before are gone. Head \"",
      head.id, "\" is at version ", head.weight_version,
      head.restored_version.has_value()
          ? absl::StrCat(" (restored from its saved state \"", head.state_id, "\" at version ",
                         *head.restored_version, ")")
          : std::string(" (not restored: the server has no saved state of it)"),
      ". Resume from the trainer checkpoint of that version"));
  return core::WithReason(status, core::reason::kServerRestarted,
                          {{"head", head.id},
                           {"field", field},
                           {"expected_incarnation", expected},
                           {"incarnation", ServerIncarnation()},
                           {"weight_version", absl::StrCat(head.weight_version)}});
}

absl::Status CheckWeightVersion(std::optional<int64_t> expected, const std::string& field,
                                const HeadDescription& head) {
  if (!expected.has_value() || *expected == head.weight_version) return absl::OkStatus();
  return core::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          field, ": expected the head's current version ", head.weight_version, "; got ", *expected,
          head.restored_version.has_value()
              ? absl::StrCat(" (the server restarted and restored head \"", head.id,
                             "\" from its saved state at version ", *head.restored_version, ")")
              : std::string())),
      core::reason::kWeightVersionMismatch,
      {{"head", head.id},
       {"field", field},
       {"expected", absl::StrCat(*expected)},
       {"actual", absl::StrCat(head.weight_version)}});
}

absl::Status CheckEmbeddingIds(const torch::Tensor& ids, int64_t vocab_size,
                               const std::string& field) {
  if (ids.dim() != 1 || ids.scalar_type() != torch::kLong) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected int64 token ids [n]; got ",
                                                   ids.dim(), " dimensions of ",
                                                   std::string(c10::toString(ids.scalar_type()))));
  }
  if (ids.numel() == 0) return absl::OkStatus();
  const torch::Tensor outside = ((ids < 0) | (ids >= vocab_size)).nonzero();
  if (outside.numel() > 0) {
    const int64_t at = outside[0][0].item<int64_t>();
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected token ids in [0, ",
                                                   vocab_size, ") (the head's vocab_size); got ",
                                                   ids[at].item<int64_t>(), " at position ", at,
                                                   " (", outside.size(0), " out of range in all)"));
  }
  return absl::OkStatus();
}

absl::Status CheckEmbeddingGradientIds(const torch::Tensor& ids, const std::string& field) {
  if (ids.numel() > 0) return absl::OkStatus();
  return core::WithReason(
      absl::InvalidArgumentError(absl::StrCat(
          field,
          ": expected at least 1 token id (a gradient for no rows adds nothing and would "
          "count a micro-batch); got 0")),
      core::reason::kInvalidField, {{"field", field}, {"expected", ">= 1"}, {"actual", "0"}});
}

absl::Status CheckEmbeddingRows(const torch::Tensor& rows, int64_t ids, int64_t hidden_size,
                                const std::string& field) {
  if (rows.dim() != 2 || rows.size(0) != ids || rows.size(1) != hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected [", ids, ", ", hidden_size,
                     "] (one row per id, the head's hidden_size); got [",
                     absl::StrJoin(rows.sizes().vec(), ", "), "]"));
  }
  if (!torch::isFloatingType(rows.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected a floating-point dtype; got ",
                                                   std::string(c10::toString(rows.scalar_type()))));
  }
  return absl::OkStatus();
}

}  // namespace remotehead::server
