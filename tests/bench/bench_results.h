// remotehead-bench's results: each variant's time, memory and accuracy at one N, the fused step's
// phases, and the ratios and JSON the report is made of.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "remotehead/core/engine.h"
#include "remotehead/core/step_phases.h"

namespace remotehead::bench {

namespace rh = remotehead::core;

struct Variant {
  bool skipped = true;
  double seconds = 0;
  int64_t peak_bytes = 0;
  double loss = 0;
  std::optional<double> d_loss, d_hidden, d_weight;  // max |Δ| vs naive; empty without naive
};

struct NResult {
  int64_t n = 0;
  rh::StepStats stats;  // from the fused step: chunk_rows, num_chunks, valid_tokens
  Variant naive, fused, two_phase, gemm;
  Variant torch_lce;  // PyTorch's linear_cross_entropy, measured by plot_bench.py
  // Where one warm fused step's time goes (bench_phases.h), measured apart from the timed steps,
  // and that step's own time.
  std::array<double, rh::kStepPhases> fused_phases{};
  double fused_phases_step = 0;
};

inline std::optional<double> Ratio(const Variant& num, const Variant& den) {
  if (num.skipped || den.skipped || den.seconds <= 0) return std::nullopt;
  return num.seconds / den.seconds;
}

inline std::optional<double> PeakRatio(const Variant& num, const Variant& den) {
  if (num.skipped || den.skipped || den.peak_bytes <= 0) return std::nullopt;
  return static_cast<double>(num.peak_bytes) / static_cast<double>(den.peak_bytes);
}

inline nlohmann::json OrNull(const std::optional<double>& x) {
  return x.has_value() ? nlohmann::json(*x) : nlohmann::json(nullptr);
}

inline nlohmann::json VariantJson(const Variant& v, const NResult& r, bool engine) {
  nlohmann::json j = {{"skipped", v.skipped}};
  j["step_seconds"] = v.skipped ? nlohmann::json(nullptr) : nlohmann::json(v.seconds);
  j["peak_bytes"] = v.skipped ? nlohmann::json(nullptr) : nlohmann::json(v.peak_bytes);
  if (!engine) return j;
  j["loss"] = v.loss;
  j["max_abs_diff"] = {{"loss", OrNull(v.d_loss)},
                       {"grad_hidden", OrNull(v.d_hidden)},
                       {"grad_weight", OrNull(v.d_weight)}};
  j["gemm_ratio"] = OrNull(Ratio(r.gemm, v));
  j["ratio_to_naive"] = OrNull(Ratio(v, r.naive));
  j["peak_ratio_to_naive"] = OrNull(PeakRatio(v, r.naive));
  return j;
}

// A baseline measured outside the engine: its time and peak against naive's.
inline nlohmann::json BaselineJson(const Variant& v, const NResult& r) {
  nlohmann::json j = VariantJson(v, r, false);
  j["ratio_to_naive"] = OrNull(Ratio(v, r.naive));
  j["peak_ratio_to_naive"] = OrNull(PeakRatio(v, r.naive));
  return j;
}

// What no phase of the marked step covers: its time minus its phases' (≥ 0).
inline double UnmarkedSeconds(const NResult& r) {
  double marked = 0;
  for (const double seconds : r.fused_phases) marked += seconds;
  return r.fused_phases_step - marked;
}

// The fused step's phases in seconds, "other": the step's time that no phase covers, and
// "step": that step's time.
inline nlohmann::json PhasesJson(const NResult& r) {
  nlohmann::json j;
  for (int i = 0; i < rh::kStepPhases; ++i) {
    j[std::string(rh::kStepPhaseNames[static_cast<size_t>(i)])] =
        r.fused_phases[static_cast<size_t>(i)];
  }
  j["other"] = r.fused.skipped ? nlohmann::json(nullptr) : nlohmann::json(UnmarkedSeconds(r));
  j["step"] = r.fused.skipped ? nlohmann::json(nullptr) : nlohmann::json(r.fused_phases_step);
  return j;
}

}  // namespace remotehead::bench
