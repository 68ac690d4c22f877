// The heads a server holds, by id, and what each needs beyond core::Head to serve many
// trainers: a lock, and the ledger of gradient contributions already applied (exactly-once).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"

namespace remotehead::server {

// Identity of one gradient contribution (remotehead.v1.GradientId).
struct GradientKey {
  std::string trainer;
  int64_t step = 0;
  int64_t micro_batch = 0;
  auto operator<=>(const GradientKey&) const = default;
};

struct HeadEntry {
  const std::string id;
  std::mutex mu;  // guards everything below
  std::unique_ptr<core::Head> head;
  // Contributions already added since the last ZeroGradients. A replay recomputes its answer
  // (the trainer needs dX again) and adds nothing, so only the identity is kept.
  std::set<GradientKey> applied;
  core::OptimizerState optimizer;  // created by the first OptimizerStep
  std::optional<double> last_loss;  // of the last successful ForwardBackward (metrics)
};

class HeadRegistry {
 public:
  // ALREADY_EXISTS if the id is taken; INVALID_ARGUMENT for an empty id.
  absl::StatusOr<std::shared_ptr<HeadEntry>> Add(const std::string& id,
                                                 std::unique_ptr<core::Head> head);
  // Add, or new weights for the existing head `id` (remotehead.v1.UploadHeader.replace):
  // INVALID_ARGUMENT unless `head` has its shape, dtype and bias; FAILED_PRECONDITION while it
  // has accumulated gradients (computed with the old weights). Its optimizer state is reset
  // and its version goes up by one.
  absl::StatusOr<std::shared_ptr<HeadEntry>> AddOrReplace(const std::string& id,
                                                          std::unique_ptr<core::Head> head);
  // NOT_FOUND naming the id and the heads that exist.
  absl::StatusOr<std::shared_ptr<HeadEntry>> Get(const std::string& id) const;
  absl::Status Drop(const std::string& id);
  std::vector<std::shared_ptr<HeadEntry>> List() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<HeadEntry>> heads_;
};

}  // namespace remotehead::server
