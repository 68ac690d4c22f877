// What the registry tells about a head at one moment (HeadDescription: DescribeHead, ListHeads,
// metrics), and the head's health over training calls that an optimizer step's window publishes
// (metrics.cc's remotehead_head_* gauges) — apart from the registry that keeps them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "remotehead/core/engine.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::server {

// The head's health over some training calls (a request's, an optimizer step's window): the
// engine's sums (core::HeadHealth) and those of the GRPO family's extras, keyed on the extras a
// call reported (a function that reports "clipped" clips ratios; "kl": it has a reference), not
// on function names. Only calls that accumulated dW count.
struct HealthWindow {
  core::HeadHealth health;
  double clipped_sum = 0.0;    // Σ "clipped" (1 where the ratio was clipped)
  int64_t clipped_tokens = 0;  // valid tokens of the calls that reported it
  double kl_sum = 0.0;         // Σ "kl"
  int64_t kl_tokens = 0;       // valid tokens of the calls that reported it

  // What one engine call adds (nothing unless it computed its health).
  static HealthWindow Of(const core::StepStats& stats);
  void Add(const HealthWindow& other);
};

// A head at one moment (DescribeHead, ListHeads, metrics).
struct HeadDescription {
  std::string id;
  int64_t vocab_size = 0;  // the whole head's (a head group's shard holds fewer rows)
  int64_t hidden_size = 0;
  torch::ScalarType dtype = torch::kFloat;
  torch::ScalarType grad_dtype = torch::kFloat;  // the dW (and db) accumulators'
  bool has_bias = false;
  std::string device;
  int64_t weight_version = 0;
  int64_t accumulated_micro_batches = 0;    // contributions since the last zeroing
  std::optional<double> last_loss;          // of the last successful ForwardBackward
  std::string state_id;                     // last saved to / restored from ("" if none)
  std::optional<int64_t> restored_version;  // restored at start by this server process
  std::vector<core::ShardRange> shards;     // a head group's rows by rank; empty: one server
  bool frozen = false;                      // no dW, no optimizer step (a teacher, a reference)
  std::vector<std::string> teacher_of;      // sorted: the students whose steps named it teacher
  // The window of the last optimizer step: the micro-batches it applied (committed since the
  // step before or the last zeroing). Unset before the first step and after a step whose window
  // held no training token.
  std::optional<HealthWindow> step_health;
  int64_t step_tokens_total = 0;  // valid tokens of every optimizer step's window so far
};

}  // namespace remotehead::server
