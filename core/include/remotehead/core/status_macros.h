// Small local status helpers. Debian's Abseil (20220623) ships absl::Status but none of the
// RETURN_IF_ERROR / ASSIGN_OR_RETURN macros that Google's code base uses, so we keep our own.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define REMOTEHEAD_CONCAT_INNER(a, b) a##b
#define REMOTEHEAD_CONCAT(a, b) REMOTEHEAD_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                                \
  do {                                                       \
    ::absl::Status remotehead_status_ = (expr);              \
    if (!remotehead_status_.ok()) return remotehead_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, StatusOrExpr());` declares/assigns `x` or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  REMOTEHEAD_ASSIGN_OR_RETURN_IMPL(REMOTEHEAD_CONCAT(remotehead_statusor_, __LINE__), lhs, expr)

#define REMOTEHEAD_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                     \
  if (!statusor.ok()) return std::move(statusor).status();    \
  lhs = std::move(statusor).value()
