#include "bench/striped_wire.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "remotehead/client/client.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::bench {

absl::StatusOr<std::vector<StripedWire>> MeasureStripedWire(const std::string& target,
                                                            const torch::Tensor& hidden,
                                                            const std::vector<int>& streams,
                                                            int64_t chunk_bytes, int warmup,
                                                            int repeats) {
  const int64_t n = hidden.size(0);
  const int64_t d = hidden.size(1);
  const client::StepInputs inputs{.hidden = hidden, .targets = torch::zeros({n}, torch::kLong)};
  const double bytes = 2.0 * static_cast<double>(hidden.nbytes());
  std::vector<StripedWire> out;
  torch::Tensor first_dx;
  for (const int count : streams) {
    ASSIGN_OR_RETURN(const std::shared_ptr<client::Client> c,
                     client::Client::Create({.target = target,
                                             .chunk_bytes = chunk_bytes,
                                             .max_receive_message_bytes = 64 << 20,
                                             .streams = count}));
    const std::string head = absl::StrCat("probe_wire_", count);
    RETURN_IF_ERROR(
        c->CreateHead(head, client::InitSpec{.vocab_size = 2, .hidden_size = d, .seed = 3})
            .status());
    std::vector<double> times;
    torch::Tensor dx;
    for (int i = 0; i < warmup + std::max(1, repeats); ++i) {
      const auto start = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(
          client::ForwardBackwardResult r,
          c->ForwardBackward({.head_id = head, .accumulate_weight_grad = false}, inputs));
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (i >= warmup) times.push_back(took.count());
      dx = std::move(r.grad_hidden);
    }
    (void)c->DropHead(head);
    std::sort(times.begin(), times.end());
    StripedWire w{.streams = count, .seconds = times[times.size() / 2]};
    w.gb_per_s = bytes / w.seconds / 1e9;
    if (!first_dx.defined()) first_dx = dx;
    w.dx_max_rel_diff = (dx - first_dx).abs().max().item<double>() /
                        std::max(first_dx.abs().max().item<double>(), 1e-30);
    out.push_back(w);
  }
  return out;
}

}  // namespace remotehead::bench
