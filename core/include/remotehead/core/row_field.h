// The field of an error that names one row of an input — "targets[12]", "aux[\"x\"][3]" — and
// its renaming: the engine names a row by its place in the batch it was given, the server's
// caller by its place in the request, a client's caller by its place in the caller's own input;
// each layer that knows the map renames the field (ErrorInfo metadata "field" and the message's
// leading field) through these. The one home of that parsing and rewriting.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::core {

struct RowField {
  std::string input;  // "targets", "aux[\"x\"]"
  int64_t row = 0;
};

// The input and row a field names ("name[<non-negative integer>]"); nullopt for any other
// field.
std::optional<RowField> ParseRowField(std::string_view field);

// `status` naming `field` instead of the field `reason` (its reason) names: the metadata "field"
// and the first "<old>: " of the message both; code, reason, other metadata and payloads kept.
absl::Status RenameField(const absl::Status& status, ErrorReason reason, const std::string& field);

}  // namespace remotehead::core
