#include "core/function_cases.h"

#include <cmath>

#include "core/reference.h"

namespace remotehead::reference {

void PrintTo(const FunctionCase& c, std::ostream* os) { *os << c.label; }

double TestValue(const std::string& function, const core::ParamSpec& spec) {
  const auto entry = ReferenceFunctions().find(function);
  if (entry != ReferenceFunctions().end()) {
    const auto it = entry->second.test_values.find(spec.name);
    if (it != entry->second.test_values.end()) return it->second;
  }
  // A quarter of the way from the default to the far end of the range (an unbounded end counts
  // as the default + 1); functions_test checks the result is in range and not the default.
  const double d = spec.default_value;
  if (d < spec.max_value) {
    const double hi = std::isfinite(spec.max_value) ? spec.max_value : d + 1.0;
    return d + 0.25 * (hi - d);
  }
  const double lo = std::isfinite(spec.min_value) ? spec.min_value : d - 1.0;
  return d - 0.25 * (d - lo);
}

std::vector<FunctionCase> DerivedCases(CaseSet set, const FunctionFilter& filter) {
  const core::FunctionParams softcap_temp = {{core::kLogitScaleParam, kTestLogitScale},
                                             {core::kSoftcapParam, kTestSoftcap},
                                             {core::kTemperatureParam, kTestTemperature}};
  std::vector<FunctionCase> cases;
  for (const core::TransformFunction* fn : core::FunctionRegistry::Builtin().Functions()) {
    if (fn->output != core::OutputKind::kPerToken) continue;
    if (filter && !filter(*fn)) continue;
    cases.push_back({fn->name, fn->name, {}});
    core::FunctionParams all = softcap_temp;
    for (const core::ParamSpec& spec : fn->params) {
      const double value = TestValue(fn->name, spec);
      all[spec.name] = value;
      if (set == CaseSet::kEveryOption) {
        cases.push_back({fn->name + "_" + spec.name, fn->name, {{spec.name, value}}});
      }
    }
    if (set == CaseSet::kEveryOption) {
      cases.push_back({fn->name + "_softcap_temp", fn->name, softcap_temp});
    }
    if (!fn->params.empty()) cases.push_back({fn->name + "_all_options", fn->name, all});
  }
  return cases;
}

std::vector<FunctionCase> SamplerMemoryCases() {
  return {
      {"token_logprobs_top_p_flat", "token_logprobs", {{"top_p", 0.99}, {"temperature", 8.0}}},
      {"token_logprobs_top_k_large", "token_logprobs", {{"top_k", 1000}}},
      {"token_logprobs_min_p_alone", "token_logprobs", {{"min_p", 0.1}}},
  };
}

}  // namespace remotehead::reference
