// A head group: one head split by vocabulary rows over K processes (one per GPU), rank r holding
// rows [offset_r, offset_r + rows_r) of W. This header is the group as the engine sees it: the
// few collectives a step needs, behind an interface of our own so that core/ never includes
// c10d (server/src/c10d_group.cc implements it on torch.distributed's ProcessGroupGloo /
// ProcessGroupNCCL; tests use an in-process one), and the shard's place in the vocabulary.
//
// The engine's step on a shard (engine.h): every rank computes its own logits z_r = X·W_rᵀ, the
// function's per-token vocabulary statistics (VocabOps in functions.h) are gathered across the
// group a few floats per token at a time, autograd gives each rank the exact dz_r of its
// columns, dX partials dz_r·W_r are summed to rank 0, and dW_r accumulates locally. Every rank
// must make the same engine calls with the same options in the same order: the collectives
// pair up by order, as in torch.distributed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// The collectives of one group. Every call blocks until all ranks have made the matching call
// (or the group's timeout passes); a failure (a rank died, hung or left) is UNAVAILABLE or
// DEADLINE_EXCEEDED naming the rank where the transport knows it, and leaves the group unusable.
class GroupCollectives {
 public:
  virtual ~GroupCollectives() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank's `t` (same shape and dtype on all ranks), stacked by rank: [size, t.shape…],
  // identical on every rank.
  virtual absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& t) = 0;
  // Σ over ranks of `t`, written into `t` on rank `root`; other ranks' `t` are left unspecified.
  virtual absl::Status ReduceSum(torch::Tensor& t, int root) = 0;
  // Rank `root`'s `t` written into every rank's `t` (same shape and dtype on all ranks).
  virtual absl::Status Broadcast(torch::Tensor& t, int root) = 0;
};

// Rows [offset, offset + rows) of the vocabulary.
struct ShardRange {
  int64_t offset = 0;
  int64_t rows = 0;
  bool operator==(const ShardRange&) const = default;
};

// K contiguous ranges covering [0, vocab_size), sizes differing by at most one (the first
// vocab_size mod K ranges get the extra row). INVALID_ARGUMENT unless 1 <= K <= vocab_size.
absl::StatusOr<std::vector<ShardRange>> SplitVocabulary(int64_t vocab_size, int group_size);

// What a step needs to know about the group it runs in: the collectives and every rank's rows.
struct VocabShard {
  GroupCollectives* group = nullptr;
  std::vector<ShardRange> ranges;  // by rank; contiguous from 0, each at least one row

  int64_t vocab_size() const {
    return ranges.empty() ? 0 : ranges.back().offset + ranges.back().rows;
  }
  const ShardRange& mine() const { return ranges.at(static_cast<size_t>(group->rank())); }
  // The largest shard's rows. Every rank sizes its chunks and function blocks for it, so that
  // all ranks run the same chunks and blocks and their collectives pair up.
  int64_t largest_rows() const;
};

// Checks that `shard` describes a group this head can step in: collectives present, one range
// per rank, contiguous from 0, none empty, and this rank's rows equal to the head's
// `head_rows`. INVALID_ARGUMENT naming what is wrong.
absl::Status CheckVocabShard(const VocabShard& shard, int64_t head_rows);

}  // namespace remotehead::core
