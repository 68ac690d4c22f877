// The arithmetic of the fused function block (fused_block.h), shared by the CUDA kernel
// (fused_block.cu) and its CPU twin (fused_block_cpu.cc): the logit transforms and their
// derivative, a row's softmax partials and how two of them merge, a row's outputs from its
// merged partial, and the gradient of one logit. No LibTorch, no CUDA runtime: plain functions
// of scalars that nvcc compiles for the device and the host compiler for the CPU, so the CPU
// twin that CI tests runs the kernel's own formulas.
//
// The tiling both run. A chunk's logits [rows, V] are cut into tiles of kTileColumns columns;
// a tile's columns are read by kLanes lanes, lane l taking columns l, l + kLanes, … in order
// (Accumulate); the lanes' partials merge as a warp-shuffle reduction does (TileMergeOrder:
// within each group of kWarp lanes at offsets 16, 8, 4, 2, 1, then the groups' results at
// offsets kLanes / kWarp / 2, …, 1); a row's tiles merge in tile order. The CPU twin follows
// the same order, so the two differ only by their exp / log / tanh (a few ulps).
#pragma once

#include <math.h>

#include <cstdint>

#include "remotehead/core/fused_kind.h"

#if defined(__CUDACC__)
#define REMOTEHEAD_HD __host__ __device__ __forceinline__
#else
#define REMOTEHEAD_HD inline
#endif

namespace remotehead::core::fused {

inline constexpr int kTileColumns = 4096;
inline constexpr int kLanes = 256;
inline constexpr int kWarp = 32;

using Kind = FusedKind;

REMOTEHEAD_HD float Exp(float x) { return expf(x); }
REMOTEHEAD_HD double Exp(double x) { return exp(x); }
REMOTEHEAD_HD float Log(float x) { return logf(x); }
REMOTEHEAD_HD double Log(double x) { return log(x); }
REMOTEHEAD_HD float Tanh(float x) { return tanhf(x); }
REMOTEHEAD_HD double Tanh(double x) { return tanh(x); }

// A call's constants, in the compute type T (float for half, bfloat16 and float32 logits,
// double for float64).
template <typename T>
struct Params {
  Kind kind = Kind::kNone;
  T logit_scale = 1;      // z ← z·s
  T softcap = 0;          // z ← softcap·tanh(z / softcap) when > 0
  T temperature = 1;      // z ← z / temperature
  T label_smoothing = 0;  // cross_entropy's ε
  T z_loss = 0;           // cross_entropy's z-loss coefficient
  T vocab_size = 1;       // V of the whole head (smoothing's mean over the vocabulary)
};

// The same constants in another compute type (a call's are read once, as Params<double>).
template <typename T, typename U>
REMOTEHEAD_HD Params<T> Convert(const Params<U>& p) {
  Params<T> out;
  out.kind = p.kind;
  out.logit_scale = static_cast<T>(p.logit_scale);
  out.softcap = static_cast<T>(p.softcap);
  out.temperature = static_cast<T>(p.temperature);
  out.label_smoothing = static_cast<T>(p.label_smoothing);
  out.z_loss = static_cast<T>(p.z_loss);
  out.vocab_size = static_cast<T>(p.vocab_size);
  return out;
}

// z' of a raw logit z: the engine's TransformLogits (engine_internal.h) on one value.
template <typename T>
REMOTEHEAD_HD T Transform(T z, const Params<T>& p) {
  if (p.logit_scale != T(1)) z = z * p.logit_scale;
  if (p.softcap > T(0)) z = Tanh(z / p.softcap) * p.softcap;
  if (p.temperature != T(1)) z = z / p.temperature;
  return z;
}

// dz'/dz at the raw logit z.
template <typename T>
REMOTEHEAD_HD T TransformSlope(T z, const Params<T>& p) {
  T slope = p.logit_scale / p.temperature;
  if (p.softcap > T(0)) {
    const T th = Tanh(z * p.logit_scale / p.softcap);
    slope = slope * (T(1) - th * th);
  }
  return slope;
}

// One row's softmax partial over some of its columns, about their maximum m:
// s = Σ e^(z'−m), t = Σ e^(z'−m)·(z'−m), sum = Σ z'. lse = m + log s, E_p[z'] = m + t / s; the
// head's health is (m, s, t) (engine_health.cc). Empty: m = −inf, s = t = sum = 0.
template <typename T>
struct Partial {
  T m;
  T s;
  T t;
  T sum;
};

template <typename T>
REMOTEHEAD_HD Partial<T> EmptyPartial() {
  return {-INFINITY, T(0), T(0), T(0)};
}

// Adds one transformed logit to a lane's partial (online: rescaled when it raises the max).
template <typename T>
REMOTEHEAD_HD void Accumulate(Partial<T>& a, T z) {
  a.sum = a.sum + z;
  if (z > a.m) {
    if (a.s > T(0)) {
      const T d = a.m - z;  // < 0
      const T w = Exp(d);
      a.t = w * (a.t + d * a.s);
      a.s = w * a.s;
    }
    a.m = z;
    a.s = a.s + T(1);
  } else {
    const T d = z - a.m;
    const T e = Exp(d);
    a.s = a.s + e;
    a.t = a.t + e * d;
  }
}

// The partial of the union of two sets of columns (exact up to rounding; associative).
template <typename T>
REMOTEHEAD_HD Partial<T> Merge(const Partial<T>& a, const Partial<T>& b) {
  if (!(b.s > T(0))) return {a.m, a.s, a.t, a.sum + b.sum};
  if (!(a.s > T(0))) return {b.m, b.s, b.t, a.sum + b.sum};
  const T m = a.m > b.m ? a.m : b.m;
  const T da = a.m - m;
  const T db = b.m - m;
  const T wa = Exp(da);
  const T wb = Exp(db);
  return {m, wa * a.s + wb * b.s, wa * (a.t + da * a.s) + wb * (b.t + db * b.s), a.sum + b.sum};
}

// One row's outputs and the constants of its gradient, from its whole-vocabulary partial and
// its target's transformed logit (ignored for entropy).
template <typename T>
struct RowResult {
  T y;       // the function's per-token value
  T extra;   // cross_entropy: nll; token_logprobs: kept (1); entropy: unused
  T z_loss;  // cross_entropy: z_loss·lse²
  // dL/dz'_j = dy·(p_j·(a + b·z'_j) + c + [j = target]·d), p_j = e^(z'_j − lse).
  T lse, a, b, c, d;
};

template <typename T>
REMOTEHEAD_HD RowResult<T> Finish(const Partial<T>& row, T z_target, const Params<T>& p) {
  RowResult<T> r{};
  const T log_s = Log(row.s);
  r.lse = row.m + log_s;
  switch (p.kind) {
    case Kind::kCrossEntropy: {
      const T nll = r.lse - z_target;
      T y = nll;
      if (p.label_smoothing > T(0)) {
        y = (T(1) - p.label_smoothing) * nll - p.label_smoothing * (row.sum / p.vocab_size - r.lse);
      }
      r.z_loss = p.z_loss * r.lse * r.lse;
      r.y = p.z_loss > T(0) ? y + r.z_loss : y;
      r.extra = nll;
      r.a = T(1) + T(2) * p.z_loss * r.lse;
      r.c = -p.label_smoothing / p.vocab_size;
      r.d = -(T(1) - p.label_smoothing);
      break;
    }
    case Kind::kTokenLogprobs:
      r.y = z_target - r.lse;
      r.extra = T(1);
      r.a = T(-1);
      r.d = T(1);
      break;
    case Kind::kEntropy: {
      const T mean = row.t / row.s;  // E_p[z'] − m
      r.y = log_s - mean;
      r.a = row.m + mean;  // E_p[z']
      r.b = T(-1);
      break;
    }
    case Kind::kNone:
      break;
  }
  return r;
}

// dL/dz of one raw logit z (column j), given dL/dy of its row.
template <typename T>
REMOTEHEAD_HD T LogitGradient(T z, bool is_target, T dy, const RowResult<T>& r,
                              const Params<T>& p) {
  const T zt = Transform(z, p);
  const T prob = Exp(zt - r.lse);
  T g = prob * (r.a + r.b * zt) + r.c;
  if (is_target) g = g + r.d;
  return dy * g * TransformSlope(z, p);
}

// The lane whose partial lane `lane` takes at step `step` of a tile's reduction, or −1 when it
// takes none: steps 0–4 within each warp (offsets 16 … 1), then the warps' first lanes
// (offsets kLanes / kWarp / 2 … 1, in units of a warp). The CPU twin runs the steps in order;
// the kernel runs the same with shuffles and a shared-memory exchange.
inline constexpr int kTileMergeSteps = 5 + 3;  // log2(kWarp) + log2(kLanes / kWarp)
REMOTEHEAD_HD int TileMergePartner(int lane, int step) {
  if (step < 5) {
    const int offset = kWarp >> (step + 1);
    const int in_warp = lane % kWarp;
    return in_warp < offset ? lane + offset : -1;
  }
  if (lane % kWarp != 0) return -1;
  const int offset = (kLanes / kWarp) >> (step - 5 + 1);
  const int warp = lane / kWarp;
  return warp < offset ? lane + offset * kWarp : -1;
}

inline constexpr int64_t Tiles(int64_t vocab) { return (vocab + kTileColumns - 1) / kTileColumns; }

// The device scratch of the CUDA launches, per row: its tiles' partials and its gradient
// constants.
template <typename T>
inline constexpr int64_t ScratchBytesPerRow(int64_t vocab) {
  return Tiles(vocab) * static_cast<int64_t>(sizeof(Partial<T>)) +
         static_cast<int64_t>(sizeof(RowResult<T>));
}

}  // namespace remotehead::core::fused
