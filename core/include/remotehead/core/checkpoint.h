// Hugging Face safetensors checkpoints inside the operator's checkpoint directory
// (checkpoint_dir.h): read a head's tensors from a single .safetensors file or a sharded
// checkpoint (its *.safetensors.index.json), and write tensors to a file atomically.
// Format: 8-byte little-endian header size, a JSON header {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian data.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// The "writer" that WriteSafetensors records in "__metadata__": only files that carry it are
// replaced by a later write.
inline constexpr char kCheckpointWriter[] = "remotehead";

// Reads tensor `name` (CPU) from `relative` in `dir`, a .safetensors file or a sharded
// checkpoint's .index.json (whose shard names are confined to `dir` too). `field` names the path
// in messages. Besides CheckpointDir's statuses: NOT_FOUND for a missing tensor, DATA_LOSS for a
// malformed file (every offset and size checked against the file), INVALID_ARGUMENT for an
// unsupported dtype or a shard name outside the directory. No message carries bytes of a file
// beyond a count of its tensors.
absl::StatusOr<torch::Tensor> ReadSafetensor(const CheckpointDir& dir, const std::string& relative,
                                             const std::string& name,
                                             const std::string& field = "path");

// Rows [offset, offset + rows) of tensor `name`'s first dimension, reading only their bytes (a
// head group's shard of lm_head.weight / lm_head.bias); the same checks and errors as
// ReadSafetensor, and INVALID_ARGUMENT for a range outside the tensor.
absl::StatusOr<torch::Tensor> ReadSafetensorRows(const CheckpointDir& dir,
                                                 const std::string& relative,
                                                 const std::string& name, int64_t offset,
                                                 int64_t rows, const std::string& field = "path");

// What ReadSafetensor would return, without reading (or allocating) the data: the dtype and
// shape of tensor `name`, with the same checks and errors. Lets a caller reserve memory first.
struct SafetensorInfo {
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> shape;
};
absl::StatusOr<SafetensorInfo> InspectSafetensor(const CheckpointDir& dir,
                                                 const std::string& relative,
                                                 const std::string& name,
                                                 const std::string& field = "path");

// Writes `tensors` (any device / layout) to `relative` in `dir` atomically, with
// "__metadata__": {"format": "pt", "writer": "remotehead"}; returns the bytes written. An existing
// file is replaced only if it is a safetensors file written by remotehead: otherwise
// FAILED_PRECONDITION naming `field`, and the file is left as it is.
absl::StatusOr<int64_t> WriteSafetensors(const CheckpointDir& dir, const std::string& relative,
                                         const std::map<std::string, torch::Tensor>& tensors,
                                         const std::string& field = "path");

}  // namespace remotehead::core
