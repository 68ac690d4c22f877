#include "remotehead/core/error_reason.h"

#include <cctype>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace remotehead::core {
namespace {

// The payload's type URL: a core-internal encoding (the reason, then key and value of each
// metadata entry, each as "<length>:<bytes>", so any byte may appear in them), turned into a
// google.rpc.ErrorInfo by the server's status seam only.
constexpr char kPayloadUrl[] = "type.remotehead.dev/remotehead.core.ErrorReason";

void Put(absl::string_view part, std::string* out) {
  absl::StrAppend(out, part.size(), ":", part);
}

// The parts of an encoding; nullopt if it is not one.
std::optional<std::vector<std::string>> Parts(absl::string_view encoded) {
  std::vector<std::string> parts;
  while (!encoded.empty()) {
    const size_t colon = encoded.find(':');
    size_t length = 0;
    if (colon == absl::string_view::npos ||
        !absl::SimpleAtoi(encoded.substr(0, colon), &length) ||
        length > encoded.size() - colon - 1) {
      return std::nullopt;
    }
    parts.emplace_back(encoded.substr(colon + 1, length));
    encoded.remove_prefix(colon + 1 + length);
  }
  if (parts.empty() || parts.size() % 2 == 0) return std::nullopt;
  return parts;
}

// The field a message names first ("inputs.hidden: expected …", "params[\"beta\"]: …"), the
// convention of every INVALID_ARGUMENT this project makes; empty when it names none.
std::string LeadingField(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return "";
  const absl::string_view field = message.substr(0, colon);
  if (!std::isalpha(static_cast<unsigned char>(field[0])) && field[0] != '-') return "";
  for (const char c : field) {
    const bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' ||
                    c == '[' || c == ']' || c == '"' || c == '-';
    if (!ok) return "";
  }
  return std::string(field);
}

}  // namespace

absl::Status WithReason(absl::Status status, absl::string_view reason,
                        std::map<std::string, std::string> metadata) {
  if (status.ok()) return status;
  std::string encoded;
  Put(reason, &encoded);
  for (const auto& [key, value] : metadata) {
    Put(key, &encoded);
    Put(value, &encoded);
  }
  status.SetPayload(kPayloadUrl, absl::Cord(encoded));
  return status;
}

std::optional<ErrorReason> GetReason(const absl::Status& status) {
  const auto payload = status.GetPayload(kPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  const std::optional<std::vector<std::string>> parts = Parts(std::string(*payload));
  if (!parts.has_value()) return std::nullopt;
  ErrorReason result{.reason = parts->front(), .metadata = {}};
  for (size_t i = 1; i + 1 < parts->size(); i += 2) result.metadata[(*parts)[i]] = (*parts)[i + 1];
  return result;
}

std::string SerializeReason(const absl::Status& status) {
  const auto payload = status.GetPayload(kPayloadUrl);
  return payload.has_value() ? std::string(*payload) : std::string();
}

absl::Status WithSerializedReason(absl::Status status, absl::string_view serialized) {
  if (status.ok() || !Parts(serialized).has_value()) return status;
  status.SetPayload(kPayloadUrl, absl::Cord(serialized));
  return status;
}

ErrorReason ReasonOf(const absl::Status& status) {
  if (std::optional<ErrorReason> attached = GetReason(status)) return *std::move(attached);
  if (status.code() == absl::StatusCode::kInvalidArgument) {
    ErrorReason result{.reason = reason::kInvalidField, .metadata = {}};
    if (std::string field = LeadingField(status.message()); !field.empty()) {
      result.metadata["field"] = std::move(field);
    }
    return result;
  }
  std::string name = absl::StatusCodeToString(status.code());
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (char& c : name) {
    if (c == ' ') c = '_';
  }
  return {.reason = name, .metadata = {}};
}

}  // namespace remotehead::core
