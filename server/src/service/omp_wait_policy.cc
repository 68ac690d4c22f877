// Why a CPU head's OpenMP threads wait passively by default.
//
// A CPU head shares its cores between LibTorch's OpenMP team (the engine) and gRPC's threads,
// which stage each stream's rows and write dX while the engine computes. libgomp's default wait
// spins a team's idle threads after every parallel region, on exactly the cores the gRPC threads
// need: measured with `remotehead-wire-bench --v 2` on 2 cores, a call took 0.17–0.20 s spinning
// and 0.12–0.13 s waiting passively, and the seed shape's step did not change
// (docs/operators.md). An operator's own OMP_WAIT_POLICY (ACTIVE included) is kept.
//
// libgomp reads the variable once, in its initialiser, before main(). Setting it from the
// executable's .preinit_array does not reach it either: glibc's own initialiser, which runs
// after the pre-initialisers, resets `environ` to the process's original block. So the process
// sets it and executes itself again; children inherit it.
#include "service/omp_wait_policy.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>

namespace remotehead::server {

void RestartWithPassiveOmpWaitUnlessSet(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/1) != 0) return;
  execv("/proc/self/exe", argv);
  std::cerr << "remotehead-server: could not restart with OMP_WAIT_POLICY=PASSIVE ("
            << std::strerror(errno) << "); OpenMP threads keep libgomp's spinning wait"
            << std::endl;
}

}  // namespace remotehead::server
