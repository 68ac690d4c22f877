// The CPU time of a process's threads, and its page faults, read from /proc: which thread carried
// a call's bytes, and how much fresh memory it took (remotehead-wire-bench reports the server's
// threads, and its own, for each measured call).
#pragma once

#include <sys/types.h>

#include <map>
#include <string>

namespace remotehead::bench {

// CPU seconds (user + system) so far of every live thread of `pid`, summed by thread name with
// trailing digits and separators dropped ("rh-compute-0" and "rh-compute-1" → "rh-compute").
// Under "(ended threads)": what the process's threads that have ended spent.
std::map<std::string, double> ThreadCpuSeconds(pid_t pid);

// The minor page faults of `pid` so far, its ended threads' included (/proc/<pid>/stat's
// minflt): each one a fresh page the kernel zeroes and charges — freed buffers given back to the
// kernel and taken again show here.
long long MinorFaults(pid_t pid);

// after − before per name (names only in `after` counted from 0).
std::map<std::string, double> CpuSecondsSpent(const std::map<std::string, double>& before,
                                              const std::map<std::string, double>& after);

}  // namespace remotehead::bench
