// The input format the fuzz targets share: parts separated by kSeparator. libFuzzer's byte
// mutations (insertions, erasures, crossover) keep most parts intact, which a length-prefixed
// format would not: one inserted byte there shifts every later message. The separator is in
// each target's dictionary (tests/fuzz/fuzz.dict) so the fuzzer also adds and removes parts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace remotehead::fuzz {

inline constexpr std::string_view kSeparator = "\xfe\xedRH|";

// Splits `data` at every kSeparator; keeps empty parts (an empty part is a valid empty message).
inline std::vector<std::string> SplitParts(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t begin = 0;
  while (true) {
    const size_t at = all.find(kSeparator, begin);
    if (at == std::string_view::npos) {
      parts.emplace_back(all.substr(begin));
      return parts;
    }
    parts.emplace_back(all.substr(begin, at - begin));
    begin = at + kSeparator.size();
  }
}

// The inverse, for the seed generator.
inline std::string JoinParts(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out.append(kSeparator);
    out.append(parts[i]);
  }
  return out;
}

// An invariant the target checks beyond "no crash": prints and aborts, which libFuzzer reports
// as a crash with the input that caused it.
[[noreturn]] inline void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what.c_str());
  std::abort();
}

}  // namespace remotehead::fuzz
