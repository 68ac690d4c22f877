#include "head_expectations.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::server {

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
          field, ": expected the head's current version ", head.weight_version, "; got ",
          *expected,
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

}  // namespace remotehead::server
