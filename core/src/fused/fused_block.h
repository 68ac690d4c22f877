// The fused function block: for the functions whose registry entry names a fused kind
// (TransformFunction::fused — cross_entropy, token_logprobs without a sampler, entropy), one
// pass over a chunk's logits gives each row's value, extras and health partials, and a second
// writes dL/dz over the logits in place (in the chunk buffer's dtype), instead of the autograd
// block loop (engine_chunks.cc) with its upcast copy, temporaries and separate gradient buffer.
// Private to the engine. The arithmetic is block_math.h's; the CPU twin (fused_block_cpu.cc) is
// what runs on a CPU head and what CI checks against the autograd path; on a CUDA head the
// kernel (fused_block.cu) runs when the build has it.
#pragma once

#include <map>
#include <string>

#include "block_math.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core::fused {

// What one fused chunk computes from.
struct BlockInputs {
  const TransformFunction* function = nullptr;  // its `fused` kind, which must not be kNone
  const FunctionParams* params = nullptr;       // resolved (label_smoothing, z_loss, transforms)
  int64_t vocab_size = 0;                       // V of the whole head
  torch::Tensor logits;   // [rows, V] contiguous, the chunk buffer (bf16, fp16, fp32 or fp64)
  torch::Tensor targets;  // [rows] int64 in [0, V) (ignored rows hold 0); undefined: entropy
  // [rows] dL/dy in the compute dtype; defined: `logits` is overwritten with dL/dz.
  torch::Tensor dy;
  bool health = false;  // fill BlockOutputs::health
};

struct BlockOutputs {
  torch::Tensor y;                              // [rows], compute dtype
  std::map<std::string, torch::Tensor> extras;  // [rows] each: the function's reported extras
  torch::Tensor health;                         // [rows, 3] (m, s, t) when asked
};

// The dtype a fused block computes in: float64 for float64 logits, else float32 (the same as
// the autograd path's LogitsDtype).
torch::ScalarType ComputeDtype(torch::ScalarType logits_dtype);

// Whether the fused block can run this call: the function has a fused kind and the params
// it does not cover are off (token_logprobs' sampler).
bool Covers(const TransformFunction& function, const FunctionParams& params);

// Runs the fused block on the logits' device: the CPU twin on a CPU tensor, the CUDA kernel on
// a CUDA tensor (throws std::runtime_error when this build has none).
BlockOutputs RunBlock(const BlockInputs& in);

// The CPU twin (CPU tensors): the same tiling and merge order as the kernel (block_math.h).
// Exposed for the parity suites.
BlockOutputs RunBlockCpu(const BlockInputs& in);

// The CUDA kernels (CUDA tensors; fused_block_cuda.cc), in a build that has them.
#if defined(REMOTEHEAD_FUSED_CUDA)
BlockOutputs RunBlockCuda(const BlockInputs& in);
#endif

// For the implementations: the call's constants (its function's kind and params, the head's V),
// read once for the CPU twin and the kernels alike.
Params<double> ParamsOf(const BlockInputs& in);

// For the implementations: the outputs' tensors, uninitialised, on the logits' device.
BlockOutputs AllocateOutputs(const BlockInputs& in);

// The bytes a fused chunk takes per row besides its logits (for the memory model, call_plan.cc):
// its outputs (the value, two extras, three health partials) in the compute dtype and, on a
// CUDA head, the kernels' scratch.
double RowBytes(int64_t vocab, torch::ScalarType logits_dtype, bool cuda);

}  // namespace remotehead::core::fused
