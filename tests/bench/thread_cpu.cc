#include "bench/thread_cpu.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace remotehead::bench {

namespace {

std::string Family(std::string name) {
  while (!name.empty() && (std::isdigit(static_cast<unsigned char>(name.back())) ||
                           name.back() == '-' || name.back() == '_' || name.back() == '\n')) {
    name.pop_back();
  }
  return name.empty() ? "?" : name;
}

// Field `index` (1-based, as proc(5) numbers them) of a /proc stat line; the fields after the
// command (which may hold spaces) are counted from its closing parenthesis. 0 if absent.
unsigned long long StatField(const std::string& stat, int index) {
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; fields >> field; ++i) {  // field 3 is the state
    if (i == index) return std::stoull(field);
  }
  return 0;
}

// utime + stime (fields 14 and 15) of /proc/<pid>/task/<tid>/stat, in seconds.
double TaskSeconds(const std::string& stat) {
  return static_cast<double>(StatField(stat, 14) + StatField(stat, 15)) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string ProcessStat(pid_t pid) {
  std::ifstream process_file("/proc/" + std::to_string(pid) + "/stat");
  std::string process;
  std::getline(process_file, process);
  return process;
}

}  // namespace

std::map<std::string, double> ThreadCpuSeconds(pid_t pid) {
  std::map<std::string, double> out;
  double live = 0;
  std::error_code ec;
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream comm_file(task.path() / "comm"), stat_file(task.path() / "stat");
    std::string comm, stat;
    std::getline(comm_file, comm);
    std::getline(stat_file, stat);
    if (stat.empty()) continue;  // ended meanwhile
    const double seconds = TaskSeconds(stat);
    out[Family(comm)] += seconds;
    live += seconds;
  }
  // The process's own count holds its ended threads too.
  out["(ended threads)"] = std::max(0.0, TaskSeconds(ProcessStat(pid)) - live);
  return out;
}

long long MinorFaults(pid_t pid) { return static_cast<long long>(StatField(ProcessStat(pid), 10)); }

std::map<std::string, double> CpuSecondsSpent(const std::map<std::string, double>& before,
                                              const std::map<std::string, double>& after) {
  std::map<std::string, double> out;
  for (const auto& [name, seconds] : after) {
    const auto it = before.find(name);
    out[name] = seconds - (it == before.end() ? 0.0 : it->second);
  }
  return out;
}

}  // namespace remotehead::bench
