// remotehead-remote-bench's report as the table it prints (without --json): one row per shape,
// the remote step's CPU time and accuracy, a head group's line and its ranks' bytes.
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>

namespace remotehead::bench {

void PrintRemoteBenchTable(const nlohmann::json& report, std::ostream& out);

}  // namespace remotehead::bench
