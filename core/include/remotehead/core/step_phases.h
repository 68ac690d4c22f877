// Where a step's time goes: the engine marks the phases of every chunk (StepOptions::phases),
// and whoever asks sums them — remotehead-bench with CUDA events on a GPU and the wall clock on
// a CPU (tests/bench/bench_phases.h). Without a recorder the engine marks nothing.
#pragma once

#include <array>
#include <string_view>

namespace remotehead::core {

enum class StepPhase : int {
  kLogitsGemm = 0,  // z = X_c·Wᵀ (+ b), and a teacher's
  kFunction = 1,    // the function blocks: autograd, or the fused kernel
  kDxGemm = 2,      // dX_c = dz·W (and on a group, its sum); fp32 logits of a half-precision
                    // head: its whole backward (dX and dW run slice by slice together)
  kDwGemm = 3,      // dW += dzᵀ·X_c, db += Σ dz
  // The call's reads of device values on the host: its checks of the inputs (finite hidden
  // states, targets in range, the valid tokens), then the loss and the statistics — each a wait
  // for the device and a device-to-host copy.
  kHostSync = 4,
};
inline constexpr int kStepPhases = 5;
inline constexpr std::array<std::string_view, kStepPhases> kStepPhaseNames = {
    "logits_gemm", "function", "dx_gemm", "dw_gemm", "host_sync"};

// Told when each phase begins and ends, on the thread that runs the call, in order (phases do
// not nest). On a GPU the work is queued, not done: a recorder puts events on the stream.
class StepPhaseRecorder {
 public:
  virtual ~StepPhaseRecorder() = default;
  virtual void Begin(StepPhase phase) = 0;
  virtual void End(StepPhase phase) = 0;
};

// Marks one phase for its scope (nothing without a recorder).
class PhaseScope {
 public:
  PhaseScope(StepPhaseRecorder* recorder, StepPhase phase) : recorder_(recorder), phase_(phase) {
    if (recorder_ != nullptr) recorder_->Begin(phase_);
  }
  ~PhaseScope() {
    if (recorder_ != nullptr) recorder_->End(phase_);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  StepPhaseRecorder* recorder_;
  StepPhase phase_;
};

}  // namespace remotehead::core
