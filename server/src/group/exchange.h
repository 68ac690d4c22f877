// Byte strings, statuses and hashes exchanged among the ranks of a group over its collectives (the
// data plane): what a mesh's fronts say of a step (HeadMesh::ExchangeVerdicts), what every rank of
// a head group or mesh holds in its state directory at start (state_restore.h), and the hashes by
// which replicas compare their bytes (HeadMesh::CompareAcrossReplicas, the heal).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

// Every rank's `mine`, by rank, identical on every rank (lengths first, then the bytes padded to
// the longest). A failed collective's status otherwise.
absl::StatusOr<std::vector<std::string>> AllGatherStrings(ProcessGroup& group,
                                                          const std::string& mine);

// Strings packed into one (each with its length first), and back; Unpack is INTERNAL for bytes
// Pack did not make.
std::string PackStrings(const std::vector<std::string>& strings);
absl::StatusOr<std::vector<std::string>> UnpackStrings(const std::string& packed);

// A status as bytes: its code, its reason (core::SerializeReason) and its message, and back.
std::string EncodeStatus(const absl::Status& status);
absl::Status DecodeStatus(const std::string& bytes);

// An order-sensitive 64-bit hash of `tensors`' bytes (as stored, on the CPU; undefined ones
// skipped).
uint64_t HashTensors(const std::vector<torch::Tensor>& tensors);

}  // namespace remotehead::server
