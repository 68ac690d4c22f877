#ifndef REMOTEHEAD_SERVER_SRC_HEAP_POLICY_H_
#define REMOTEHEAD_SERVER_SRC_HEAP_POLICY_H_

namespace remotehead::server {

// Makes glibc's malloc keep the memory a call frees for the next call (heap_policy.cc says why),
// unless the operator tuned malloc through its environment (MALLOC_TRIM_THRESHOLD_,
// MALLOC_TOP_PAD_, MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES' glibc.malloc.*): then their settings
// stand. Call once, first thing in main.
void KeepFreedHeapForReuseUnlessTuned();

}  // namespace remotehead::server

#endif  // REMOTEHEAD_SERVER_SRC_HEAP_POLICY_H_
