// fp32 logits of a half-precision head (StepOptions::logits_dtype = float32,
// CallPlan::fp32_logits_of_half_head): a chunk's three GEMMs with fp32 results from the head's
// bf16 / fp16 weights, without an fp32 copy of the whole W.
//   z = X_c·Wᵀ      CUDA: cuBLAS with an fp32 C on the half-precision operands (mm.dtype_out,
//                   tensor cores). Elsewhere (LibTorch has no CPU GEMM of half-precision
//                   operands into an fp32 output): X_c upcast once, W upcast one slice of rows
//                   at a time (CallPlan::WeightSliceRows), each slice's fp32 GEMM writing its
//                   columns of the fp32 chunk buffer in place.
//   dX_c = dz·W     on every device: the fp32 dz (never rounded to the head's dtype) times W's
//                   fp32 slices, summed in fp32 and rounded once into dX by the caller. Rounding
//                   dz to bf16 first (what a half-precision GEMM would need) would put back
//                   the rounding fp32 logits exist to avoid, and cost a [rows, V] bf16 copy.
//   dW += dzᵀ·X_c   the fp32 dz times the fp32 X_c: an fp32 accumulator gets each chunk's
//                   contribution exact to fp32, in one GEMM; a half-precision accumulator's
//                   rows are added to in fp32 a slice at a time and rounded once.
// cuBLAS has no GEMM of an fp32 and a bf16 operand, so under the CPU's plan rules the backward's
// two GEMMs run in fp32. Under CUDA's (CallPlan::split_gradient) dz is split into two terms in
// the head's dtype, hi + lo, which a GPU's half-precision GEMMs into fp32 read (four GEMMs on
// tensor cores instead of two in fp32) and a CPU sums back into dz for its fp32 GEMMs: ≈ 16 of
// fp32's 24 significant bits of dz (docs/engine.md, "fp32 logits from bf16 weights").
#include <algorithm>
#include <utility>

#include "engine_internal.h"

namespace remotehead::core::engine_internal {
namespace {

// Whether this LibTorch's CUDA mm writes an fp32 output from half-precision inputs
// (mm.dtype_out). Tried once per dtype, on a 2×2 product, before it is used (as
// CudaAddmmAccumulatesIntoFloat, engine_chunks.cc).
bool CudaMmWritesFloat(const torch::Tensor& weight) {
  auto probe = [](const torch::TensorOptions& options) {
    try {
      torch::Tensor out = torch::empty({2, 2}, options.dtype(torch::kFloat));
      const torch::Tensor a = torch::ones({2, 3}, options);
      at::mm_out(out, a, a.t(), torch::kFloat);
      return out.eq(3).all().item<bool>();
    } catch (const c10::Error&) {
      return false;
    }
  };
  if (weight.scalar_type() == torch::kBFloat16) {
    static const bool bf16 = probe(weight.options());
    return bf16;
  }
  static const bool fp16 = probe(weight.options());
  return fp16;
}

// An fp32 [min(rows, V), D] buffer for W's slices.
torch::Tensor WeightSliceBuffer(const Head& head, int64_t slice_rows) {
  return torch::empty({std::min(slice_rows, head.vocab_size()), head.hidden_size()},
                      head.weight().options().dtype(torch::kFloat));
}

// One slice of the split (CallPlan::split_gradient): hi = dz rounded to `dtype`, lo = (dz − hi)
// rounded, and the slice of dz left as hi + lo (exact in fp32), what every later use reads.
std::pair<torch::Tensor, torch::Tensor> SplitSlice(torch::Tensor dz_slice,
                                                   torch::ScalarType dtype) {
  torch::Tensor hi = dz_slice.to(dtype);
  torch::Tensor lo = dz_slice.sub_(hi).to(dtype);
  dz_slice.copy_(hi).add_(lo);
  return {std::move(hi), std::move(lo)};
}

// CallPlan::split_gradient on a GPU with half-precision GEMMs into fp32 (and an fp32 or no dW):
// per slice of dz's columns, hi = dz rounded to the head's dtype, lo = (dz − hi) rounded, then
// dX_c += hi·W_s + lo·W_s and dW_s += hiᵀ·X_c + loᵀ·X_c; dz is left as hi + lo (what db sums).
bool SplitOnTensorCores(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                        const torch::Tensor& dz, const torch::Tensor& dx, const torch::Tensor& dw) {
  const torch::Tensor& w = head.weight();
  const bool fp32_dw = !dw.defined() || dw.scalar_type() == torch::kFloat;
  if (!w.is_cuda() || !CudaMmWritesFloat(w) || !fp32_dw) return false;
  const int64_t vocab = dz.size(1);
  const int64_t columns = call.GradientSliceColumns(dz.size(0), vocab);
  torch::Tensor dx_out = dx;  // the caller's buffer (at::*_out take a mutable handle)
  for (int64_t v = 0; v < vocab; v += columns) {
    const int64_t n = std::min(columns, vocab - v);
    const auto [hi, lo] = SplitSlice(dz.narrow(1, v, n), w.scalar_type());
    const torch::Tensor w_slice = w.narrow(0, v, n);
    if (dx_out.defined()) {
      if (v == 0) {
        at::mm_out(dx_out, hi, w_slice, torch::kFloat);
      } else {
        at::addmm_out(dx_out, dx_out, hi, w_slice, torch::kFloat);
      }
      at::addmm_out(dx_out, dx_out, lo, w_slice, torch::kFloat);
    }
    if (dw.defined()) {
      torch::Tensor dw_slice = dw.narrow(0, v, n);
      at::addmm_out(dw_slice, dw_slice, hi.t(), x_chunk, torch::kFloat);
      at::addmm_out(dw_slice, dw_slice, lo.t(), x_chunk, torch::kFloat);
    }
  }
  return true;
}

// CallPlan::split_gradient elsewhere: dz replaced by hi + lo, a slice of its columns at a time,
// for the fp32 GEMMs that follow.
void SplitInPlace(const Head& head, const CallPlan& call, const torch::Tensor& dz) {
  const int64_t vocab = dz.size(1);
  const int64_t columns = call.GradientSliceColumns(dz.size(0), vocab);
  for (int64_t v = 0; v < vocab; v += columns) {
    SplitSlice(dz.narrow(1, v, std::min(columns, vocab - v)), head.dtype());
  }
}

}  // namespace

void Fp32ChunkLogits(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                     torch::Tensor& out) {
  const torch::Tensor& w = head.weight();
  if (w.is_cuda() && CudaMmWritesFloat(w)) {
    at::mm_out(out, x_chunk, w.t(), torch::kFloat);
    if (head.has_bias()) out.add_(head.bias());
    return;
  }
  const torch::Tensor x = x_chunk.to(torch::kFloat);
  const int64_t vocab = head.vocab_size();
  const int64_t slice_rows = call.WeightSliceRows(vocab, head.hidden_size());
  const torch::Tensor w_buffer = WeightSliceBuffer(head, slice_rows);
  for (int64_t v = 0; v < vocab; v += slice_rows) {
    const int64_t n = std::min(slice_rows, vocab - v);
    const torch::Tensor w_slice = w_buffer.narrow(0, 0, n).copy_(w.narrow(0, v, n));
    // A column slice of the row-major buffer is a BLAS matrix of leading dimension V: the
    // GEMM writes it in place.
    torch::Tensor out_slice = out.narrow(1, v, n);
    if (head.has_bias()) {
      torch::addmm_out(out_slice, head.bias().narrow(0, v, n).to(torch::kFloat), x, w_slice.t());
    } else {
      torch::mm_out(out_slice, x, w_slice.t());
    }
  }
}

void Fp32ChunkBackward(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                       const torch::Tensor& dz, const torch::Tensor& dx, const torch::Tensor& dw) {
  if (call.split_gradient) {
    if (SplitOnTensorCores(head, call, x_chunk, dz, dx, dw)) return;
    SplitInPlace(head, call, dz);
  }
  const torch::Tensor x = dw.defined() ? x_chunk.to(torch::kFloat) : torch::Tensor();
  const bool half_dw = dw.defined() && dw.scalar_type() != torch::kFloat;
  if (dx.defined() || half_dw) {
    const int64_t vocab = head.vocab_size();
    const int64_t slice_rows = call.WeightSliceRows(vocab, head.hidden_size());
    // One fp32 slice buffer serves both GEMMs of a slice: W's rows for dX, then the half-
    // precision accumulator's rows, added to in fp32 and rounded back once (copy_ converts in
    // place; a mixed-dtype add_ would make fp32 temporaries of both operands on a CPU).
    const torch::Tensor buffer = WeightSliceBuffer(head, slice_rows);
    for (int64_t v = 0; v < vocab; v += slice_rows) {
      const int64_t n = std::min(slice_rows, vocab - v);
      const torch::Tensor dz_slice = dz.narrow(1, v, n);
      const torch::Tensor slice = buffer.narrow(0, 0, n);
      if (dx.defined()) {
        slice.copy_(head.weight().narrow(0, v, n));
        // beta 0 on the first slice: dx's uninitialised contents are ignored, not scaled.
        dx.addmm_(dz_slice, slice, /*beta=*/v == 0 ? 0.0 : 1.0);
      }
      if (half_dw) {
        const torch::Tensor dw_slice = dw.narrow(0, v, n);
        slice.copy_(dw_slice).addmm_(dz_slice.t(), x);
        dw_slice.copy_(slice);
      }
    }
  }
  if (dw.defined() && !half_dw) dw.addmm_(dz.t(), x);
}

}  // namespace remotehead::core::engine_internal
