// The fused block on a CUDA tensor (fused_block.h): the outputs and the kernels' scratch
// allocated through LibTorch, the kernels (fused_block.cu) launched on its current stream.
#include "fused_block_cuda.h"

#include <c10/cuda/CUDAStream.h>

#include <stdexcept>
#include <string>

#include "block_math.h"
#include "fused_block.h"

namespace remotehead::core::fused {
namespace {

ElemType ElemOf(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kBFloat16:
      return ElemType::kBFloat16;
    case torch::kHalf:
      return ElemType::kHalf;
    case torch::kFloat:
      return ElemType::kFloat;
    case torch::kDouble:
      return ElemType::kDouble;
    default:
      throw std::invalid_argument(std::string("fused block: logits dtype ") + c10::toString(dtype) +
                                  " not supported");
  }
}

void* PointerOr(const torch::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

}  // namespace

BlockOutputs RunBlockCuda(const BlockInputs& in) {
  BlockOutputs out = AllocateOutputs(in);
  CudaBlockArgs a;
  a.params = ParamsOf(in);
  a.rows = in.logits.size(0);
  a.vocab = in.logits.size(1);
  a.elem = ElemOf(in.logits.scalar_type());
  a.logits = in.logits.data_ptr();
  a.targets = in.targets.defined() ? in.targets.data_ptr<int64_t>() : nullptr;
  a.dy = in.dy.defined() ? in.dy.data_ptr() : nullptr;
  a.y = out.y.data_ptr();
  if (a.params.kind == FusedKind::kCrossEntropy) {
    a.extra = out.extras.at("nll").data_ptr();
    if (out.extras.contains("z_loss")) a.z_loss_out = out.extras.at("z_loss").data_ptr();
  } else if (a.params.kind == FusedKind::kTokenLogprobs) {
    a.extra = out.extras.at("kept").data_ptr();
  }
  a.health = PointerOr(out.health);
  const int64_t per_row = a.elem == ElemType::kDouble ? ScratchBytesPerRow<double>(a.vocab)
                                                      : ScratchBytesPerRow<float>(a.vocab);
  const torch::Tensor scratch =
      torch::empty({a.rows * per_row}, in.logits.options().dtype(torch::kByte));
  a.scratch = scratch.data_ptr();
  a.stream = c10::cuda::getCurrentCUDAStream(in.logits.device().index()).stream();
  const std::string error = LaunchFusedBlock(a);
  if (!error.empty()) throw std::runtime_error("fused block: CUDA launch failed: " + error);
  return out;
}

}  // namespace remotehead::core::fused
