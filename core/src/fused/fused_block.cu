// The fused block's CUDA kernels (fused_block_cuda.h). The arithmetic is block_math.h's, which
// the CPU twin (fused_block_cpu.cc) runs in the same tiling and merge order; CI compiles this
// file for sm_80 and sm_90a with ptxas's warnings (spills among them) as errors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "block_math.h"
#include "fused_block_cuda.h"

namespace remotehead::core::fused {
namespace {

template <typename Elem>
__device__ __forceinline__ float LoadAsFloat(const Elem* p);
template <>
__device__ __forceinline__ float LoadAsFloat(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
template <>
__device__ __forceinline__ float LoadAsFloat(const __half* p) {
  return __half2float(*p);
}
template <>
__device__ __forceinline__ float LoadAsFloat(const float* p) {
  return *p;
}

template <typename T, typename Elem>
__device__ __forceinline__ T Load(const Elem* p) {
  if constexpr (sizeof(T) == 8) {
    return *reinterpret_cast<const double*>(p);
  } else {
    return LoadAsFloat(p);
  }
}

template <typename T, typename Elem>
__device__ __forceinline__ void Store(Elem* p, T v) {
  if constexpr (sizeof(T) == 8) {
    *reinterpret_cast<double*>(p) = v;
  } else if constexpr (sizeof(Elem) == 4) {
    *reinterpret_cast<float*>(p) = v;
  } else if constexpr (std::is_same_v<Elem, __half>) {
    *p = __float2half_rn(v);
  } else {
    *p = __float2bfloat16_rn(v);
  }
}

template <typename T>
__device__ __forceinline__ Partial<T> ShuffleDown(const Partial<T>& a, int offset) {
  return {__shfl_down_sync(0xffffffffu, a.m, offset), __shfl_down_sync(0xffffffffu, a.s, offset),
          __shfl_down_sync(0xffffffffu, a.t, offset), __shfl_down_sync(0xffffffffu, a.sum, offset)};
}

// Grid (rows, tiles), kLanes threads: one tile's partial of one row into partials[row, tile].
template <typename T, typename Elem>
__global__ void __launch_bounds__(kLanes)
    TilePartialsKernel(const Elem* __restrict__ logits, int64_t vocab, int tiles, Params<T> p,
                       Partial<T>* __restrict__ partials) {
  const int64_t row = blockIdx.x;
  const int tile = static_cast<int>(blockIdx.y);
  const int lane = static_cast<int>(threadIdx.x);
  const Elem* z = logits + row * vocab;
  const int64_t begin = static_cast<int64_t>(tile) * kTileColumns;
  const int64_t end = begin + kTileColumns < vocab ? begin + kTileColumns : vocab;
  Partial<T> a = EmptyPartial<T>();
  for (int64_t j = begin + lane; j < end; j += kLanes) Accumulate(a, Transform(Load<T>(z + j), p));
  // TileMergePartner's order: within the warp at offsets 16 … 1, then across the warps.
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const Partial<T> other = ShuffleDown(a, offset);
    if (lane % kWarp < offset) a = Merge(a, other);
  }
  __shared__ Partial<T> warps[kLanes / kWarp];
  if (lane % kWarp == 0) warps[lane / kWarp] = a;
  __syncthreads();
  if (lane < kWarp) {
    a = lane < kLanes / kWarp ? warps[lane] : EmptyPartial<T>();
    for (int offset = kLanes / kWarp / 2; offset > 0; offset /= 2) {
      const Partial<T> other = ShuffleDown(a, offset);
      if (lane < offset) a = Merge(a, other);
    }
    if (lane == 0) partials[row * tiles + tile] = a;
  }
}

// One thread per row: the tiles merged in order, the row's outputs and gradient constants.
template <typename T, typename Elem>
__global__ void RowFinishKernel(const Elem* __restrict__ logits, int64_t rows, int64_t vocab,
                                int tiles, Params<T> p, const Partial<T>* __restrict__ partials,
                                const int64_t* __restrict__ targets, T* __restrict__ y,
                                T* __restrict__ extra, T* __restrict__ z_loss,
                                T* __restrict__ health, RowResult<T>* __restrict__ results) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  Partial<T> whole = partials[row * tiles];
  for (int tile = 1; tile < tiles; ++tile) whole = Merge(whole, partials[row * tiles + tile]);
  const int64_t target = targets != nullptr ? targets[row] : -1;
  const T z_target = target >= 0 ? Transform(Load<T>(logits + row * vocab + target), p) : T(0);
  const RowResult<T> r = Finish(whole, z_target, p);
  y[row] = r.y;
  if (extra != nullptr) extra[row] = r.extra;
  if (z_loss != nullptr) z_loss[row] = r.z_loss;
  if (health != nullptr) {
    health[3 * row] = whole.m;
    health[3 * row + 1] = whole.s;
    health[3 * row + 2] = whole.t;
  }
  results[row] = r;
}

// Grid (rows, tiles): every logit of the tile replaced by its gradient.
template <typename T, typename Elem>
__global__ void __launch_bounds__(kLanes)
    GradientKernel(Elem* __restrict__ logits, int64_t vocab, Params<T> p,
                   const int64_t* __restrict__ targets, const T* __restrict__ dy,
                   const RowResult<T>* __restrict__ results) {
  const int64_t row = blockIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * kTileColumns;
  const int64_t end = begin + kTileColumns < vocab ? begin + kTileColumns : vocab;
  const int64_t target = targets != nullptr ? targets[row] : -1;
  const RowResult<T> r = results[row];
  const T g = dy[row];
  Elem* z = logits + row * vocab;
  for (int64_t j = begin + threadIdx.x; j < end; j += kLanes) {
    Store(z + j, LogitGradient(Load<T>(z + j), j == target, g, r, p));
  }
}

template <typename T, typename Elem>
const char* Launch(const CudaBlockArgs& a) {
  const Params<T> p = Convert<T>(a.params);
  const int tiles = static_cast<int>(Tiles(a.vocab));
  auto* partials = static_cast<Partial<T>*>(a.scratch);
  auto* results = reinterpret_cast<RowResult<T>*>(partials + a.rows * tiles);
  auto* logits = static_cast<Elem*>(a.logits);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  // Rows on x (up to 2³¹ − 1), tiles on y (up to 65,535: V up to 268M).
  const dim3 grid(static_cast<unsigned>(a.rows), static_cast<unsigned>(tiles));
  TilePartialsKernel<T, Elem><<<grid, kLanes, 0, stream>>>(logits, a.vocab, tiles, p, partials);
  constexpr int kRowThreads = 128;
  RowFinishKernel<T, Elem>
      <<<static_cast<unsigned>((a.rows + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(
          logits, a.rows, a.vocab, tiles, p, partials, a.targets, static_cast<T*>(a.y),
          static_cast<T*>(a.extra), static_cast<T*>(a.z_loss_out), static_cast<T*>(a.health),
          results);
  if (a.dy != nullptr) {
    GradientKernel<T, Elem><<<grid, kLanes, 0, stream>>>(logits, a.vocab, p, a.targets,
                                                         static_cast<const T*>(a.dy), results);
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? "" : cudaGetErrorString(error);
}

}  // namespace

const char* LaunchFusedBlock(const CudaBlockArgs& args) {
  if (args.rows == 0) return "";
  switch (args.elem) {
    case ElemType::kBFloat16:
      return Launch<float, __nv_bfloat16>(args);
    case ElemType::kHalf:
      return Launch<float, __half>(args);
    case ElemType::kFloat:
      return Launch<float, float>(args);
    case ElemType::kDouble:
      return Launch<double, double>(args);
  }
  return "fused block: unknown element type";
}

}  // namespace remotehead::core::fused
