// What a request expects of the head it names — the server process it began with, the weight
// version it computed on — checked against what the head is. Protobuf-free: the handlers pass
// the request's fields, the step session its StepCall's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/service/head_registry.h"

namespace remotehead::server {

// This server process's random id (HeadInfo / StepSummary.incarnation): a restarted server has
// a new one, so a client can tell that the dW it accumulated is gone.
const std::string& ServerIncarnation();

// A request's expected_incarnation (`field`; empty: unchecked) against this server process:
// FAILED_PRECONDITION saying that the server restarted, and at which version `head` now is.
absl::Status CheckIncarnation(const std::string& expected, const std::string& field,
                              const HeadDescription& head);

// A request's optional expected_weight_version (`field`; unset: unchecked) against the version
// `head` describes: FAILED_PRECONDITION naming both (and a restore at start, if there was one).
absl::Status CheckWeightVersion(std::optional<int64_t> expected, const std::string& field,
                                const HeadDescription& head);

// A tied embedding's token ids (`field`) for a head of `vocab_size` rows: int64 [n], each in
// [0, vocab_size); INVALID_ARGUMENT naming the field, the first id out of range and its position.
absl::Status CheckEmbeddingIds(const torch::Tensor& ids, int64_t vocab_size,
                               const std::string& field);

// A tied embedding's gradient's ids (`field`) are not empty: a gradient for no rows would add
// nothing to dW yet count a micro-batch (and take its gradient id), so it is refused —
// INVALID_ARGUMENT naming the field, expected at least 1 id, got 0 (reason INVALID_FIELD with
// field / expected / actual) — alike on one server, a head group and a mesh.
absl::Status CheckEmbeddingGradientIds(const torch::Tensor& ids, const std::string& field);

// A tied embedding's gradient rows (`field`) for `ids` rows of a head of width `hidden_size`:
// a floating-point [ids, hidden_size] tensor; INVALID_ARGUMENT naming the field otherwise.
absl::Status CheckEmbeddingRows(const torch::Tensor& rows, int64_t ids, int64_t hidden_size,
                                const std::string& field);

}  // namespace remotehead::server
