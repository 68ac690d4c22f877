// The server's function listing (ListFunctions), read once per Client and kept: what
// Client::ListFunctions returns, and what a step looks up in it — whether a function's ignored
// rows may be left out, how a Forward with reduction NONE shapes and types its outputs — so the
// client matches no function by name.
#pragma once

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "channel.h"
#include "remotehead/client/step_types.h"

namespace remotehead::client::internal {

class FunctionListing {
 public:
  explicit FunctionListing(Channel& channel) : channel_(channel) {}

  // Every function the server lists, read by the first call that needs them and kept.
  absl::StatusOr<std::vector<FunctionInfo>> All();
  // The function named `name`; nullopt when the server lists none of that name.
  absl::StatusOr<std::optional<FunctionInfo>> Find(const std::string& name);

 private:
  Channel& channel_;
  std::mutex mu_;
  std::optional<std::vector<FunctionInfo>> functions_;
};

}  // namespace remotehead::client::internal
