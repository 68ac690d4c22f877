// A step with half of its rows masked (targets = ignore_index, as SFT masks prompts), measured in
// three ways in one run: the unmasked step (every row contributes), the masked step with every
// row sent (StepSpec::compact_rows = false: the rows travel, the server drops them before it
// computes) and the masked step compacted (the client's default: the masked rows stay in the
// trainer). For each: the wall time, the server's compute (StepSummary.timings), and the bytes on
// the wire — what the server received and sent for the step, from its own
// remotehead_received_bytes_total / remotehead_sent_bytes_total. remotehead-remote-bench reports it
// per shape ("masked rows").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/client/client.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::bench {

struct MaskedRowsStep {
  std::string name;                   // "unmasked", "masked_full", "masked_compacted"
  double seconds = 0;                 // median wall time of one ForwardBackward
  double server_compute_seconds = 0;  // median of the server's engine time
  double bytes_up = 0;                // per step: what the server received
  double bytes_down = 0;              // per step: what the server sent
};

struct MaskedRows {
  std::vector<MaskedRowsStep> steps;
  int64_t masked_rows = 0;
  // The masked step sent whole and compacted: loss and dX equal bit for bit (they are when the
  // server batches the rows alike; across row messages its batches follow their arrival).
  bool equal_bits = false;
  double loss_abs_diff = 0;
  double dx_max_abs_diff = 0;
  double dx_max_abs = 0;  // of the masked step's dX
  double loss = 0;        // of the masked step
};

// On `client`'s server (whose /metrics answer on `metrics_port`), a head `head` of `hidden`'s D
// with V = vocab: the three steps on `hidden` [N, D] with random targets (the first half masked
// for the masked ones), `warmup` + `repeats` times each (medians reported).
absl::StatusOr<MaskedRows> MeasureMaskedRows(client::Client& client, int metrics_port,
                                             const torch::Tensor& hidden, int64_t vocab, int warmup,
                                             int repeats);

// The report's "masked_rows" object: per step its seconds, server compute and bytes, and the
// compacted step against the other two (bytes up, server compute); the equality of the results.
nlohmann::json MaskedRowsJson(const MaskedRows& m);
// --check: the compacted step equals the masked step sent whole (loss within 1e-6 of its
// magnitude, dX within 1e-5 of its), and sends fewer bytes up than it by at least a third of
// the masked rows' share.
bool MaskedRowsCheck(const nlohmann::json& masked_rows);

}  // namespace remotehead::bench
