// PyTorch's linear_cross_entropy and --plot for both benchmarks: plot_bench.py (in the project's
// Python environment: torch, matplotlib) measures the Python-only op at a report's shapes in the
// same run, and draws the picture.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_measure.h"
#include "support/child_process.h"

namespace remotehead::bench {

// Writes `report` to a temporary file and runs `python script --report FILE args…`; returns its
// output (stdout and stderr), or an error with that output when it fails.
inline absl::StatusOr<std::string> RunReportScript(const nlohmann::json& report,
                                                   const std::string& python,
                                                   const std::string& script,
                                                   const std::vector<std::string>& args) {
  char path[] = "/tmp/remotehead-bench-report-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("cannot create a temporary report file");
  close(fd);
  std::ofstream(path) << report.dump();
  std::vector<std::string> argv = {python, script, "--report", path};
  argv.insert(argv.end(), args.begin(), args.end());
  testing::ChildProcess child(argv, [](const std::string&) { return false; });
  const bool started = child.started();
  const int code = child.Wait();
  std::remove(path);
  if (!started || code != 0) {
    return absl::InternalError(
        absl::StrCat(python, " ", script, " exited ", code, ":\n", child.log()));
  }
  return child.log();
}

// PyTorch's chunked linear_cross_entropy at each of the report's shapes, in their order
// (plot_bench.py --measure: its "TORCH_LCE {json}" line).
inline absl::StatusOr<std::vector<Measurement>> MeasureTorchLce(const nlohmann::json& report,
                                                                const std::string& python,
                                                                const std::string& script) {
  ASSIGN_OR_RETURN(const std::string output,
                   RunReportScript(report, python, script, {"--measure"}));
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("TORCH_LCE ", 0) != 0) continue;
    const nlohmann::json measured = nlohmann::json::parse(line.substr(10), nullptr, false);
    if (measured.is_discarded()) break;
    std::vector<Measurement> out;
    for (size_t i = 0; i < measured["seconds"].size(); ++i) {
      out.push_back({.seconds = measured["seconds"][i].get<double>(),
                     .peak_bytes = measured["peak_bytes"][i].get<int64_t>()});
    }
    return out;
  }
  return absl::InternalError(
      absl::StrCat(script, " --measure printed no TORCH_LCE line:\n", output));
}

// Draws the report into `png`; what the script prints (PyTorch's rows when the report does not
// hold them already, the picture's path) goes to `out`.
inline absl::Status DrawPlot(const nlohmann::json& report, const std::string& png,
                             const std::string& python, const std::string& script,
                             std::ostream& out) {
  absl::StatusOr<std::string> output = RunReportScript(report, python, script, {"--out", png});
  if (!output.ok()) return absl::InternalError(absl::StrCat("--plot: ", output.status().message()));
  out << *output;
  return absl::OkStatus();
}

}  // namespace remotehead::bench
