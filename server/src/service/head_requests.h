// The arguments and results of head operations that cross a boundary: the RPC handlers build
// them from protobuf (translate/protocol.h), the head operations run them (head_operations.h),
// and a head group's commands carry them to the other ranks (translate/head_commands.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>

#include "remotehead/core/optimizer.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/service/head_registry.h"

namespace remotehead::server {

// What a head's creation fixes besides its values, for the head's life (a replace keeps it).
struct HeadTraits {
  bool frozen = false;  // no dW, no optimizer step (HeadEntry::frozen): a teacher, a reference
  // The dW (and db) accumulators' dtype (core::HeadOptions::grad_dtype). Unset: float32
  // (float64 for a float64 head); a half-precision head's own dtype halves its gradient memory —
  // the memory mode (docs/engine.md): each chunk's dW GEMM still computes in fp32 and rounds
  // once as it adds.
  std::optional<torch::ScalarType> grad_dtype;
};

// A head's tensors in a safetensors checkpoint on the server (a file or a sharded checkpoint's
// *.safetensors.index.json).
struct SafetensorsSource {
  std::string path;  // relative to the checkpoint directory
  std::string weight_name = "lm_head.weight";
  std::string bias_name;                   // empty: no bias
  std::optional<torch::ScalarType> dtype;  // unset: the file's
};

// A copy of a head's [V, D] matrix and optional [V] vector (weights or gradients) on the CPU,
// taken under the head's lock, with the head's state at that moment.
struct HeadSnapshot {
  torch::Tensor matrix;
  torch::Tensor vector;  // undefined without bias
  HeadDescription description;
};

// What a tied embedding's gradient did (HeadOperations::AddEmbeddingGradient).
struct EmbeddingGradientOutcome {
  bool replayed = false;  // its gradient id had been applied already: nothing was added
  HeadDescription description;
};

struct OptimizerStepSpec {
  std::variant<core::SgdOptions, core::AdamWOptions> optimizer;
  double grad_scale = 1.0;      // multiplies the accumulated gradient
  bool zero_gradients = false;  // zero dW and the ledger after the step
  // Set: the version the caller holds; another is FAILED_PRECONDITION, checked under the
  // head's lock together with the step (nothing applied).
  std::optional<int64_t> expected_weight_version;
};

}  // namespace remotehead::server
