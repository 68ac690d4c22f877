// Hugging Face safetensors checkpoints: read a head's tensors from a single .safetensors file
// or a sharded checkpoint (its *.safetensors.index.json), and write tensors to a file.
// Format: 8-byte little-endian header size, a JSON header {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian data.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace remotehead::core {

// Reads tensor `name` (CPU). NOT_FOUND for a missing file or tensor (the message lists what the
// checkpoint has), DATA_LOSS for a malformed file, INVALID_ARGUMENT for an unsupported dtype.
// `path` may be a .safetensors file or a sharded checkpoint's .index.json.
absl::StatusOr<torch::Tensor> ReadSafetensor(const std::string& path, const std::string& name);

// Writes `tensors` (any device / layout) to `path`; returns the bytes written.
absl::StatusOr<int64_t> WriteSafetensors(const std::string& path,
                                         const std::map<std::string, torch::Tensor>& tensors);

}  // namespace remotehead::core
