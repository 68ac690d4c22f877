// The benches' command lines: Abseil's flag names are identifiers (--chunk_rows), the
// documentation writes them kebab-case (--chunk-rows); both are accepted. And their way out
// when a step of the measurement fails.
#pragma once

#include <errno.h>  // program_invocation_short_name

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace remotehead::bench {

// Abseil flag names are identifiers; accept --chunk-rows as --chunk_rows.
inline std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    const size_t dashes = a.starts_with("--") ? 2 : a.starts_with("-") ? 1 : 0;
    if (dashes == 0 || a.size() <= dashes || !std::isalpha(static_cast<unsigned char>(a[dashes]))) {
      continue;  // a positional argument or a negative number
    }
    const size_t end = std::min(a.find('='), a.size());
    std::replace(a.begin() + static_cast<std::ptrdiff_t>(dashes),
                 a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
  }
  return args;
}

// The value, or the program exits 1 naming itself, `what` failed and why.
template <typename T>
T OrDie(absl::StatusOr<T> v, const std::string& what) {
  if (!v.ok()) {
    std::cerr << program_invocation_short_name << ": " << what << ": " << v.status() << std::endl;
    std::exit(1);
  }
  return *std::move(v);
}

}  // namespace remotehead::bench
