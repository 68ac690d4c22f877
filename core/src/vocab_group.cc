#include "remotehead/core/vocab_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace remotehead::core {

absl::StatusOr<std::vector<ShardRange>> SplitVocabulary(int64_t vocab_size, int group_size) {
  if (group_size < 1 || group_size > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("group_size: expected 1 to vocab_size (",
                                                   vocab_size, ") ranks; got ", group_size));
  }
  std::vector<ShardRange> ranges;
  const int64_t base = vocab_size / group_size;
  const int64_t extra = vocab_size % group_size;
  int64_t offset = 0;
  for (int r = 0; r < group_size; ++r) {
    const int64_t rows = base + (r < extra ? 1 : 0);
    ranges.push_back({offset, rows});
    offset += rows;
  }
  return ranges;
}

int64_t VocabShard::largest_rows() const {
  int64_t largest = 0;
  for (const ShardRange& r : ranges) largest = std::max(largest, r.rows);
  return largest;
}

absl::Status CheckVocabShard(const VocabShard& shard, int64_t head_rows) {
  if (shard.group == nullptr) {
    return absl::InvalidArgumentError("shard.group: expected the group's collectives; got none");
  }
  if (static_cast<int64_t>(shard.ranges.size()) != shard.group->size()) {
    return absl::InvalidArgumentError(absl::StrCat("shard.ranges: expected one per rank (",
                                                   shard.group->size(), "); got ",
                                                   shard.ranges.size()));
  }
  int64_t next = 0;
  for (size_t r = 0; r < shard.ranges.size(); ++r) {
    const ShardRange& range = shard.ranges[r];
    if (range.offset != next || range.rows < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard.ranges[", r, "]: expected at least one row from offset ", next,
                       "; got rows [", range.offset, ", ", range.offset + range.rows, ")"));
    }
    next += range.rows;
  }
  if (shard.mine().rows != head_rows) {
    return absl::InvalidArgumentError(absl::StrCat("shard.ranges[", shard.group->rank(),
                                                   "]: expected the head's ", head_rows,
                                                   " rows; got ", shard.mine().rows));
  }
  return absl::OkStatus();
}

}  // namespace remotehead::core
