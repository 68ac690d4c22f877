#ifndef REMOTEHEAD_SERVER_SRC_OMP_WAIT_POLICY_H_
#define REMOTEHEAD_SERVER_SRC_OMP_WAIT_POLICY_H_

namespace remotehead::server {

// Makes the process's OpenMP threads wait passively unless OMP_WAIT_POLICY is set: when it is
// unset, sets it to PASSIVE and executes this binary again with `argv` (libgomp reads the
// variable only while the process loads). Returns when the variable was already set, or when
// the new image could not be started (the process then goes on spinning, as before).
void RestartWithPassiveOmpWaitUnlessSet(char** argv);

}  // namespace remotehead::server

#endif  // REMOTEHEAD_SERVER_SRC_OMP_WAIT_POLICY_H_
