// --plot for both benchmarks: the picture is drawn by plot_bench.py (matplotlib, in the
// project's Python environment), which also measures PyTorch's linear_cross_entropy at the
// report's shapes in the same run — a Python-only baseline, so it is measured there.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "support/child_process.h"

namespace remotehead::bench {

// Writes `report` to a temporary file and runs plot_bench.py on it with `python`, writing the
// PNG to `png`; the script's table (PyTorch linear_cross_entropy's rows and ratios) goes to
// `out`. Fails with the script's output when it does.
inline absl::Status DrawPlot(const nlohmann::json& report, const std::string& png,
                             const std::string& python, const std::string& script,
                             std::ostream& out) {
  char path[] = "/tmp/remotehead-bench-report-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("--plot: cannot create a temporary report file");
  close(fd);
  std::ofstream(path) << report.dump();
  testing::ChildProcess plotter({python, script, "--report", path, "--out", png},
                                [](const std::string&) { return false; });
  const bool started = plotter.started();
  const int code = plotter.Wait();
  std::remove(path);
  if (!started || code != 0) {
    return absl::InternalError(
        absl::StrCat("--plot: ", python, " ", script, " exited ", code, ":\n", plotter.log()));
  }
  out << plotter.log();
  return absl::OkStatus();
}

}  // namespace remotehead::bench
