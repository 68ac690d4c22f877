#include "remotehead/core/row_field.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace remotehead::core {

std::optional<RowField> ParseRowField(std::string_view field) {
  const size_t open = field.rfind('[');
  int64_t row = 0;
  if (field.empty() || field.back() != ']' || open == std::string_view::npos ||
      !absl::SimpleAtoi(absl::string_view(field.data() + open + 1, field.size() - open - 2),
                        &row) ||
      row < 0) {
    return std::nullopt;
  }
  return RowField{.input = std::string(field.substr(0, open)), .row = row};
}

absl::Status RenameField(const absl::Status& status, ErrorReason reason, const std::string& field) {
  std::string& named = reason.metadata["field"];
  std::string message(status.message());
  if (const size_t at = message.find(absl::StrCat(named, ": ")); at != std::string::npos) {
    message.replace(at, named.size(), field);
  }
  named = field;
  absl::Status renamed(status.code(), message);
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { renamed.SetPayload(url, payload); });
  return WithReason(std::move(renamed), reason.reason, std::move(reason.metadata));
}

}  // namespace remotehead::core
