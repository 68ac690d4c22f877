#include "bench/remote_bench_table.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"

namespace remotehead::bench {

void PrintRemoteBenchTable(const nlohmann::json& report, std::ostream& out) {
  out << absl::StrFormat("# server: %s\n", report["server_log"].get<std::string>());
  if (report.contains("loopback_tcp_gb_per_s")) {
    out << absl::StrFormat("# loopback TCP limit (one connection): %.2f GB/s\n",
                           report["loopback_tcp_gb_per_s"].get<double>());
  }
  out << absl::StrFormat("%-18s %9s %9s %7s %8s %8s %9s %7s %9s %9s %9s %9s\n", "N:D:V",
                         "in_proc_s", "remote_s", "ratio", "up_s", "down_s", "serial_s", "overlap",
                         "wire_GB/s", "srv_comp", "srv_recvw", "srv_sendw");
  for (const auto& r : report["shapes"]) {
    out << absl::StrFormat(
        "%-18s %9.3f %9.3f %7.3f %8.3f %8.3f %9.3f %7.3f %9.2f %9.3f %9.3f %9.3f\n",
        absl::StrFormat("%d:%d:%d", r["n"].get<int64_t>(), r["d"].get<int64_t>(),
                        r["v"].get<int64_t>()),
        r["in_process_seconds"].get<double>(), r["remote_seconds"].get<double>(),
        r["remote_vs_in_process"].get<double>(), r["up_seconds"].get<double>(),
        r["down_seconds"].get<double>(), r["serial_seconds"].get<double>(),
        r["overlap_ratio"].get<double>(), r["wire_goodput_gb_per_s"].get<double>(),
        r["server_compute_seconds"].get<double>(), r["server_receive_wait_seconds"].get<double>(),
        r["server_send_wait_seconds"].get<double>());
    out << absl::StrFormat(
        "%-18s remote step: %.3f CPU-s in both processes = %.0f%% of %d cores; |loss diff| "
        "%.2e, max |dX diff| %.2e, echo exact: %s\n",
        "", r["remote_cpu_seconds"].get<double>(), 100 * r["remote_cpu_utilisation"].get<double>(),
        report["cores"].get<int>(), r["loss_abs_diff"].get<double>(),
        r["dx_max_abs_diff"].get<double>(), r["echo_exact"].get<bool>() ? "yes" : "NO");
    if (r.contains("masked_rows")) {
      // Half of the rows masked: the unmasked step, the masked one sent whole, and compacted.
      const auto& m = r["masked_rows"];
      std::string line;
      for (const char* name : {"unmasked", "masked_full", "masked_compacted"}) {
        const auto& st = m["steps"][name];
        line += absl::StrFormat(
            " %s %.3f s, srv_comp %.3f s, up %.2f MiB, down %.2f MiB;", name,
            st["seconds"].get<double>(), st["server_compute_seconds"].get<double>(),
            st["bytes_up"].get<double>() / (1 << 20), st["bytes_down"].get<double>() / (1 << 20));
      }
      out << absl::StrFormat("%-18s masked rows (%d of %d):%s\n", "", m["masked_rows"].get<int>(),
                             r["n"].get<int>(), line);
      const auto& vs_full = m["compacted_vs_unmasked"];
      out << absl::StrFormat(
          "%-18s   compacted vs unmasked: bytes up %.2f×, down %.2f×, server compute %.2f×, step "
          "%.2f×; vs masked sent whole: bytes up %.2f×, server compute %.2f×; equal bits: %s\n",
          "", vs_full["bytes_up"].get<double>(), vs_full["bytes_down"].get<double>(),
          vs_full["server_compute"].get<double>(), vs_full["seconds"].get<double>(),
          m["compacted_vs_masked_full"]["bytes_up"].get<double>(),
          m["compacted_vs_masked_full"]["server_compute"].get<double>(),
          m["equal_bits"].get<bool>() ? "yes" : "no");
    }
    if (r.contains("striped_wire")) {
      // X up and dX down through the step's path, next to no compute, by stream count.
      std::string line;
      for (const auto& w : r["striped_wire"]) {
        line +=
            absl::StrFormat(" %d stream%s %.2f GB/s", w["streams"].get<int>(),
                            w["streams"].get<int>() == 1 ? "" : "s", w["gb_per_s"].get<double>());
        if (w.contains("vs_loopback")) {
          line += absl::StrFormat(" (%.2f of loopback)", w["vs_loopback"].get<double>());
        }
        line += absl::StrFormat(", dX vs 1 stream %.1e;", w["dx_max_rel_diff"].get<double>());
      }
      out << absl::StrFormat("%-18s striped step wire:%s\n", "", line);
    }
    if (!r.contains("group")) continue;
    const auto& g = r["group"];
    out << absl::StrFormat(
        "%-18s head group of %d: %.3f s = %.2f× the single server (ranks share this machine's "
        "cores); |loss diff| %.2e, max |dX diff| %.2e, max |dW diff| %.2e\n",
        "", g["size"].get<int>(), g["seconds"].get<double>(), g["vs_single_server"].get<double>(),
        g["loss_abs_diff"].get<double>(), g["dx_max_abs_diff"].get<double>(),
        g["dw_max_abs_diff"].get<double>());
    for (const auto& rank : g["ranks"]) {
      out << absl::StrFormat(
          "%-18s   rank %d bytes/token: sent %.1f received %.1f (model %.1f / %.1f, measured / "
          "model %.3f); statistics %.1f (model %.1f)\n",
          "", rank["rank"].get<int>(), rank["sent_bytes_per_token"].get<double>(),
          rank["received_bytes_per_token"].get<double>(),
          rank["model_sent_bytes_per_token"].get<double>(),
          rank["model_received_bytes_per_token"].get<double>(),
          rank["measured_vs_model"].get<double>(), rank["statistics_bytes_per_token"].get<double>(),
          rank["model_statistics_bytes_per_token"].get<double>());
    }
  }
}

}  // namespace remotehead::bench
