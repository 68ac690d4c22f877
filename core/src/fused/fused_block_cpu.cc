// The fused block's CPU twin (fused_block.h): the kernel's tiling and merge order
// (block_math.h) run lane by lane on the host, one row at a time, rows in parallel.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>

#include "block_math.h"
#include "fused_block.h"

namespace remotehead::core::fused {
namespace {

// One tile's partial: kLanes lanes over their strided columns, then the lanes' merge.
template <typename T, typename Elem>
Partial<T> TilePartial(const Elem* row, int64_t begin, int64_t end, const Params<T>& p) {
  std::array<Partial<T>, kLanes> lanes;
  for (int lane = 0; lane < kLanes; ++lane) {
    Partial<T> a = EmptyPartial<T>();
    for (int64_t j = begin + lane; j < end; j += kLanes) {
      Accumulate(a, Transform(static_cast<T>(row[j]), p));
    }
    lanes[static_cast<size_t>(lane)] = a;
  }
  for (int step = 0; step < kTileMergeSteps; ++step) {
    for (int lane = 0; lane < kLanes; ++lane) {
      const int partner = TileMergePartner(lane, step);
      if (partner >= 0) {
        lanes[static_cast<size_t>(lane)] =
            Merge(lanes[static_cast<size_t>(lane)], lanes[static_cast<size_t>(partner)]);
      }
    }
  }
  return lanes[0];
}

// A row's partial over the whole vocabulary: its tiles merged in tile order.
template <typename T, typename Elem>
Partial<T> RowPartial(const Elem* row, int64_t vocab, const Params<T>& p) {
  Partial<T> acc = EmptyPartial<T>();
  for (int64_t begin = 0; begin < vocab; begin += kTileColumns) {
    const int64_t end = std::min<int64_t>(begin + kTileColumns, vocab);
    acc = begin == 0 ? TilePartial<T>(row, begin, end, p)
                     : Merge(acc, TilePartial<T>(row, begin, end, p));
  }
  return acc;
}

template <typename T, typename Elem>
void RunRows(const BlockInputs& in, BlockOutputs& out) {
  const Params<T> p = Convert<T>(ParamsOf(in));
  const int64_t rows = in.logits.size(0);
  const int64_t vocab = in.logits.size(1);
  Elem* logits = in.logits.data_ptr<Elem>();
  const int64_t* targets = in.targets.defined() ? in.targets.data_ptr<int64_t>() : nullptr;
  const T* dy = in.dy.defined() ? in.dy.data_ptr<T>() : nullptr;
  T* y = out.y.data_ptr<T>();
  T* extra = nullptr;
  T* z_loss = nullptr;
  if (p.kind == Kind::kCrossEntropy) {
    extra = out.extras.at("nll").data_ptr<T>();
    if (p.z_loss > T(0)) z_loss = out.extras.at("z_loss").data_ptr<T>();
  } else if (p.kind == Kind::kTokenLogprobs) {
    extra = out.extras.at("kept").data_ptr<T>();
  }
  T* health = in.health ? out.health.data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      Elem* row = logits + i * vocab;
      const Partial<T> whole = RowPartial<T>(row, vocab, p);
      const int64_t target = targets != nullptr ? targets[i] : -1;
      const T z_target = target >= 0 ? Transform(static_cast<T>(row[target]), p) : T(0);
      const RowResult<T> r = Finish(whole, z_target, p);
      y[i] = r.y;
      if (extra != nullptr) extra[i] = r.extra;
      if (z_loss != nullptr) z_loss[i] = r.z_loss;
      if (health != nullptr) {
        health[3 * i] = whole.m;
        health[3 * i + 1] = whole.s;
        health[3 * i + 2] = whole.t;
      }
      if (dy == nullptr) continue;
      for (int64_t j = 0; j < vocab; ++j) {
        row[j] = static_cast<Elem>(LogitGradient(static_cast<T>(row[j]), j == target, dy[i], r, p));
      }
    }
  });
}

}  // namespace

BlockOutputs RunBlockCpu(const BlockInputs& in) {
  BlockOutputs out = AllocateOutputs(in);
  switch (in.logits.scalar_type()) {
    case torch::kBFloat16:
      RunRows<float, c10::BFloat16>(in, out);
      break;
    case torch::kHalf:
      RunRows<float, c10::Half>(in, out);
      break;
    case torch::kFloat:
      RunRows<float, float>(in, out);
      break;
    case torch::kDouble:
      RunRows<double, double>(in, out);
      break;
    default:
      TORCH_CHECK(false, "fused block: logits dtype ", in.logits.scalar_type(), " not supported");
  }
  return out;
}

}  // namespace remotehead::core::fused
