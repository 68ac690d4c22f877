// Direct access to a served head from a test, for engine calls and checks while no RPC is
// running: the reference outlives the entry's lock, which is why the server never does this.
#pragma once

#include "remotehead/core/head.h"
#include "remotehead/server/service/head_registry.h"

namespace remotehead::testing {

inline core::Head& HeadOf(server::HeadEntry& entry) {
  return entry.Write([](core::Head& head) -> core::Head& { return head; });
}

}  // namespace remotehead::testing
