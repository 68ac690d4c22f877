// The generation outputs' loop (RunGenerationChunks, engine_internal.h): the rows' logits
// (function "logits") or a drawn token and its log-probability ("sample", sampling.h).
//
// On a head group each rank forms its shard's columns of a chunk's logits, and an all-gather
// puts the whole rows together on every rank (GatherColumns): every rank then applies the same
// transforms and draws the same tokens from the same bits (seeded by row), so the group's ranks
// agree on every result and every error, and the front's equal one server's.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine_internal.h"
#include "remotehead/core/sampling.h"
#include "remotehead/core/status_macros.h"
#include "vocab_ops.h"

namespace remotehead::core::engine_internal {
namespace {

// A drawn token needs finite logits: softmax of an inf or a nan has no probabilities. The cause
// is named: the head's weights (X is checked finite) or the temperature dividing them.
absl::Status CheckSampledLogitsFinite(const torch::Tensor& z, const torch::Tensor& transformed,
                                      const Plan& plan, int64_t first_row) {
  const int64_t bad = FirstNonFiniteRow(transformed);
  if (bad < 0) return absl::OkStatus();
  const int64_t row = plan.first_row + first_row + bad;
  if (FirstNonFiniteRow(z.narrow(0, bad, 1)) >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sample: expected finite logits to draw from; got inf or nan in row ", row, ": hidden[",
        row, "] times the head's weights overflows ", DtypeName(z.scalar_type()),
        " (the head's weights are too large or not finite); no token is drawn"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "sample: expected finite logits to draw from; got inf or nan in row ", row,
      " once divided by params[\"", kTemperatureParam, "\"] = ",
      plan.params().at(kTemperatureParam), ", which overflows float32; no token is drawn"));
}

// A chunk's logits rows over the whole vocabulary from every rank's columns `z` [rows, V_r]:
// each rank's shard padded to the largest, all-gathered, and cut back in vocabulary order.
// Throws GroupFailure when the collective fails.
torch::Tensor GatherColumns(const torch::Tensor& z, const VocabShard& shard) {
  const int64_t largest = shard.largest_rows();
  torch::Tensor padded = z;
  if (z.size(1) < largest) {
    padded = torch::zeros({z.size(0), largest}, z.options());
    padded.narrow(1, 0, z.size(1)).copy_(z);
  }
  absl::StatusOr<torch::Tensor> all = shard.group->AllGather(padded.contiguous());
  if (!all.ok()) throw GroupFailure(std::move(all).status());
  std::vector<torch::Tensor> columns;
  for (size_t r = 0; r < shard.ranges.size(); ++r) {
    columns.push_back((*all)[static_cast<int64_t>(r)].narrow(1, 0, shard.ranges[r].rows));
  }
  return torch::cat(columns, 1);
}

}  // namespace

absl::StatusOr<ForwardResult> RunGenerationChunks(const Head& head, const TokenBatch& batch,
                                                  const Plan& plan,
                                                  torch::ScalarType output_dtype) {
  torch::NoGradGuard no_grad;
  const bool logits = plan.fn().output == OutputKind::kLogits;
  const torch::TensorOptions opts = head.weight().options();
  ForwardResult result;
  const torch::ScalarType out = OutputDtype(plan.fn().output, head.dtype(), output_dtype);
  if (logits) {
    result.output = torch::empty({plan.rows, plan.vocab_size}, opts.dtype(out));
  } else {
    result.output = torch::empty({plan.rows}, opts.dtype(out));
    result.token_ids = torch::empty({plan.rows}, opts.dtype(torch::kLong));
  }
  ChunkOutputs counts;
  if (plan.rows > 0) {
    const ChunkBuffers buffers = AllocateChunkBuffers(head, plan, /*gradients=*/false);
    for (int64_t start = 0; start < plan.rows; start += plan.chunk_rows) {
      const int64_t rows = std::min(plan.chunk_rows, plan.rows - start);
      if (StopBeforeChunk(plan)) throw StopRequested();
      ++counts.num_chunks;
      torch::Tensor z = buffers.logits.narrow(0, 0, rows);
      ChunkLogits(head, plan.call, batch.hidden.narrow(0, start, rows), z);
      if (plan.shard != nullptr) z = GatherColumns(z, *plan.shard);
      for (int64_t b = 0; b < rows; b += plan.block_rows) {
        const int64_t block = std::min(plan.block_rows, rows - b);
        const int64_t row = start + b;
        const torch::Tensor zb =
            TransformLogits(z.narrow(0, b, block).to(LogitsDtype(head)), plan.params());
        if (logits) {
          result.output.narrow(0, row, block).copy_(zb);
          continue;
        }
        RETURN_IF_ERROR(CheckSampledLogitsFinite(z.narrow(0, b, block), zb, plan, row));
        const SampledTokens drawn = SampleTokens(zb, plan.params(), plan.first_row + row);
        result.output.narrow(0, row, block).copy_(drawn.logprobs);
        result.token_ids.narrow(0, row, block).copy_(drawn.token_ids);
      }
    }
  }
  result.stats = MakeStats(plan, counts);
  return result;
}

}  // namespace remotehead::core::engine_internal
