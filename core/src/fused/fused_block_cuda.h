// The fused block's CUDA kernels (fused_block.cu), behind a plain-C++ seam: nvcc compiles the
// kernels without LibTorch, and fused_block_cuda.cc hands them the tensors' pointers and
// LibTorch's current stream. Three launches per chunk, over a grid of vocabulary tiles × rows
// (so that a few rows still fill the GPU): the tiles' softmax partials; each row's merge, value,
// extras and health; each logit's gradient written over it.
#pragma once

#include <cstdint>

#include "block_math.h"

namespace remotehead::core::fused {

enum class ElemType : int { kBFloat16 = 0, kHalf = 1, kFloat = 2, kDouble = 3 };

struct CudaBlockArgs {
  Params<double> params;  // the call's constants (ParamsOf), converted to the compute type
  int64_t rows = 0;
  int64_t vocab = 0;
  ElemType elem = ElemType::kFloat;
  void* logits = nullptr;            // [rows, vocab] contiguous; dz written here when dy is set
  const int64_t* targets = nullptr;  // [rows] or null (entropy)
  const void* dy = nullptr;          // [rows] compute type, or null (no gradient)
  void* y = nullptr;                 // [rows] compute type
  void* extra = nullptr;             // [rows] nll or kept, or null
  void* z_loss_out = nullptr;        // [rows] or null
  void* health = nullptr;            // [rows, 3] or null
  void* scratch = nullptr;           // rows × ScratchBytesPerRow (block_math.h)
  void* stream = nullptr;            // cudaStream_t
};

// Launches the three kernels on args.stream; returns the CUDA error of the launches as text,
// empty when they were accepted.
const char* LaunchFusedBlock(const CudaBlockArgs& args);

}  // namespace remotehead::core::fused
