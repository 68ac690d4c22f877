// Which fused kernel computes a function's blocks (TransformFunction::fused): the one home of
// the list, read by the registry (functions.h) and by the kernel's arithmetic
// (core/src/fused/block_math.h), which nvcc compiles without LibTorch — so no includes here.
#pragma once

namespace remotehead::core {

enum class FusedKind : int {
  kNone = 0,           // the autograd block loop only
  kCrossEntropy = 1,   // cross_entropy: ignore_index, label smoothing, z-loss
  kTokenLogprobs = 2,  // token_logprobs without a sampler's truncation
  kEntropy = 3,        // entropy
};

}  // namespace remotehead::core
