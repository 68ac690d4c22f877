// The cases the engine's tests run every function with, derived from the registry
// (core::FunctionRegistry::Builtin()) and the reference table (reference.h): a registered
// function with a reference is tested by every suite that takes these cases, with no list to
// edit. Generation outputs (logits, sample) are not among them: generation_test covers those.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "remotehead/core/functions.h"

namespace remotehead::reference {

// The common options of the softcap + temperature cases (and of the all-options cases).
inline constexpr double kTestSoftcap = 2.5;
inline constexpr double kTestTemperature = 0.7;
inline constexpr double kTestLogitScale = 1.3;

struct FunctionCase {
  // A gtest name: "<function>" (defaults), "<function>_<param>" (one own param not at its
  // default), "<function>_softcap_temp" (with the logit scale too), "<function>_all_options"
  // (every own param not at its default, with logit scale, softcap and temperature).
  std::string label;
  std::string function;
  core::FunctionParams params;
};

void PrintTo(const FunctionCase& c, std::ostream* os);

enum class CaseSet {
  // Per function: defaults; each own param alone; softcap + temperature; and, for a function
  // with own params, all of them together with softcap + temperature.
  kEveryOption,
  // Per function: defaults; and all options together for a function with own params (every
  // code path at once, for the memory tests, whose cases are expensive).
  kDefaultsAndAllOptions,
};

// Which registered functions to take (e.g. only the vocabulary-decomposable ones).
using FunctionFilter = std::function<bool(const core::TransformFunction&)>;

// The cases of every registered per-token function (OutputKind::kPerToken), in the registry's
// order (by name), optionally filtered.
std::vector<FunctionCase> DerivedCases(CaseSet set = CaseSet::kEveryOption,
                                       const FunctionFilter& filter = nullptr);

// token_logprobs with the sampler's costliest settings (core/sampler_kept_set.h), for the memory
// tests: top-p alone on flat rows (a high temperature: the largest values asked for grow to
// whole rows), a top_k of most of the vocabulary, min-p alone. The derived cases' small top_k
// never sorts more than a few values.
std::vector<FunctionCase> SamplerMemoryCases();

// The value the derived cases give one of `function`'s own params: the reference table's
// test_values entry if it has one, else a value in the param's range that is not its default.
double TestValue(const std::string& function, const core::ParamSpec& spec);

}  // namespace remotehead::reference
