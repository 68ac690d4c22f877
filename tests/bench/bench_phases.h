// Where an engine step's time goes (core/step_phases.h), for remotehead-bench: CUDA events on
// the current stream on a GPU (the work is queued, so the host's clock would time the queueing),
// the wall clock on a CPU. What no phase covers — host gaps between launches, the per-token
// bookkeeping, copies — is the same step's time minus their sum.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <array>
#include <chrono>
#include <optional>
#include <vector>

#include "remotehead/core/step_phases.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::bench {

class PhaseClock final : public core::StepPhaseRecorder {
 public:
  explicit PhaseClock(const torch::Device& device) : device_(device) {}

  void Begin(core::StepPhase) override { open_ = Now(); }
  void End(core::StepPhase phase) override { spans_.push_back({phase, std::move(open_), Now()}); }
  // Around the whole step whose phases are marked: what no phase covers is this step's own time
  // minus theirs (never another step's, whose time varies from this one's).
  void StepBegins() { step_begin_ = Now(); }
  void StepEnds() { step_end_ = Now(); }

  // The seconds of each phase marked since the last call; the device must have finished them
  // (the caller synchronises first).
  std::array<double, core::kStepPhases> TakeSeconds() {
    std::array<double, core::kStepPhases> seconds{};
    for (const Span& s : spans_) seconds[static_cast<size_t>(s.phase)] += Seconds(s.begin, s.end);
    spans_.clear();
    return seconds;
  }
  // The step's seconds, StepBegins to StepEnds (after the device has finished them).
  double StepSeconds() const { return Seconds(step_begin_, step_end_); }

 private:
  struct Mark {
    std::optional<c10::Event> event;  // on a GPU
    std::chrono::steady_clock::time_point at;
  };
  struct Span {
    core::StepPhase phase;
    Mark begin, end;
  };

  static double Seconds(const Mark& begin, const Mark& end) {
    return begin.event.has_value() ? begin.event->elapsedTime(*end.event) / 1000.0
                                   : std::chrono::duration<double>(end.at - begin.at).count();
  }

  Mark Now() const {
    Mark m;
    if (device_.is_cuda()) {
      m.event.emplace(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
      m.event->record(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device_));
    } else {
      m.at = std::chrono::steady_clock::now();
    }
    return m;
  }

  torch::Device device_;
  Mark open_, step_begin_, step_end_;
  std::vector<Span> spans_;
};

}  // namespace remotehead::bench
