// The fused block's device-independent parts (fused_block.h): which calls it covers, its
// outputs, and the choice between the CPU twin and the CUDA kernel.
#include "fused_block.h"

#include <stdexcept>

#include "block_math.h"
#include "remotehead/core/sampler_kept_set.h"

namespace remotehead::core::fused {

torch::ScalarType ComputeDtype(torch::ScalarType logits_dtype) {
  return logits_dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
}

bool Covers(const TransformFunction& function, const FunctionParams& params) {
  switch (function.fused) {
    case FusedKind::kNone:
      return false;
    case FusedKind::kTokenLogprobs:
      return !SamplerActive(params);
    case FusedKind::kCrossEntropy:
    case FusedKind::kEntropy:
      return true;
  }
  return false;
}

Params<double> ParamsOf(const BlockInputs& in) {
  const FunctionParams& fp = *in.params;
  Params<double> p;
  p.kind = in.function->fused;
  p.logit_scale = fp.at(kLogitScaleParam);
  p.softcap = fp.at(kSoftcapParam);
  p.temperature = fp.at(kTemperatureParam);
  if (p.kind == FusedKind::kCrossEntropy) {
    p.label_smoothing = fp.at("label_smoothing");
    p.z_loss = fp.at("z_loss");
  }
  p.vocab_size = static_cast<double>(in.vocab_size);
  return p;
}

double RowBytes(int64_t vocab, torch::ScalarType logits_dtype, bool cuda) {
  const bool f64 = ComputeDtype(logits_dtype) == torch::kDouble;
  constexpr double kOutputsPerRow = 6;
  double bytes = kOutputsPerRow * (f64 ? 8.0 : 4.0);
  if (cuda) {
    bytes += static_cast<double>(f64 ? ScratchBytesPerRow<double>(vocab)
                                     : ScratchBytesPerRow<float>(vocab));
  }
  return bytes;
}

BlockOutputs AllocateOutputs(const BlockInputs& in) {
  const int64_t rows = in.logits.size(0);
  const auto options = in.logits.options().dtype(ComputeDtype(in.logits.scalar_type()));
  BlockOutputs out;
  out.y = torch::empty({rows}, options);
  switch (in.function->fused) {
    case FusedKind::kCrossEntropy:
      out.extras["nll"] = torch::empty({rows}, options);
      if (in.params->at("z_loss") > 0) out.extras["z_loss"] = torch::empty({rows}, options);
      break;
    case FusedKind::kTokenLogprobs:
      out.extras["kept"] = torch::empty({rows}, options);
      break;
    case FusedKind::kEntropy:
    case FusedKind::kNone:
      break;
  }
  if (in.health) out.health = torch::empty({rows, 3}, options);
  return out;
}

BlockOutputs RunBlock(const BlockInputs& in) {
  if (in.logits.is_cpu()) return RunBlockCpu(in);
#if defined(REMOTEHEAD_FUSED_CUDA)
  if (in.logits.is_cuda()) return RunBlockCuda(in);
#endif
  throw std::runtime_error("fused block: this build has no kernel for the logits' device " +
                           in.logits.device().str());
}

}  // namespace remotehead::core::fused
