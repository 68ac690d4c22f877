// RowStaging (server/src/rpc/row_staging.h): each message's hidden rows copied once, from the
// bytes as they arrived, into the buffer of the batch they belong to — rows split where a
// message straddles two batches, messages in any order (striped streams), nothing staged where
// the message is not one it can stage — and a batch made of several messages' rows is one view
// of its buffer (TokenBatch::Concat), not a copy.
#include "rpc/row_staging.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "framed_rows.h"
#include "remotehead/core/token_batch.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::server {
namespace {

// Rows [offset, offset + count) of `hidden` and `targets` as a client frames them (frames.h),
// cut into two pieces as gRPC's slices might be.
struct Framed {
  std::string bytes;
  std::vector<wire::BytePiece> pieces() const {
    const size_t half = bytes.size() / 3;
    return {{bytes.data(), half}, {bytes.data() + half, bytes.size() - half}};
  }
};
Framed FrameRows(const torch::Tensor& hidden, const torch::Tensor& targets, int64_t offset,
                 int64_t count) {
  return {testing::MakeRowsMessage(hidden, targets, offset, count).framed.Flatten()};
}

TEST(RowStaging, StagesEachMessagesRowsInItsBatchesBufferAtTheirOffsetInAnyOrder) {
  const torch::Tensor hidden = torch::randn({23, 6});
  const torch::Tensor targets = torch::randint(0, 9, {23}, torch::kLong);
  RowStaging staging;
  staging.Configure({.call_rows = 23, .batch_rows = 8, .width = 6, .dtype = torch::kFloat});
  // Messages of 5 rows (the last 3), decoded out of order as two streams might deliver them.
  std::vector<std::vector<StagedHidden>> staged(5);
  for (int m : {1, 0, 3, 2, 4}) {
    const int64_t offset = m * 5, count = std::min<int64_t>(5, 23 - offset);
    v1::StepRequest message;
    ASSERT_TRUE(
        staging.Decode(FrameRows(hidden, targets, offset, count).pieces(), &message, &staged[m]));
    EXPECT_EQ(message.rows().row_offset(), offset);
    EXPECT_TRUE(message.rows().hidden().data().empty());
    EXPECT_EQ(message.rows().hidden().shape(0), count);
    EXPECT_EQ(message.rows().targets().shape(0), count);  // the rest parsed as sent
  }
  // Each message's pieces: its rows, split at the batch boundaries 8 and 16.
  std::vector<torch::Tensor> by_batch[3];
  for (int m = 0; m < 5; ++m) {
    int64_t row = m * 5;
    for (const StagedHidden& piece : staged[m]) {
      EXPECT_EQ(piece.first_row, row);
      const int64_t n = piece.hidden.size(0);
      EXPECT_EQ(piece.first_row / 8, (piece.first_row + n - 1) / 8) << "a piece straddles";
      EXPECT_TRUE(torch::equal(piece.hidden, hidden.narrow(0, row, n)));
      by_batch[piece.first_row / 8].push_back(piece.hidden);
      row += n;
    }
    EXPECT_EQ(row, std::min<int64_t>(m * 5 + 5, 23));
  }
  EXPECT_EQ(staged[1].size(), 2u);  // rows 5..9: 5..7 in batch 0, 8..9 in batch 1
  // A batch of several messages' rows is one view of its buffer.
  for (int b = 0; b < 3; ++b) {
    std::vector<core::TokenBatch> parts;
    for (const torch::Tensor& h : by_batch[b]) parts.push_back(core::TokenBatch{.hidden = h});
    const core::TokenBatch joined = core::TokenBatch::Concat(parts);
    EXPECT_TRUE(
        torch::equal(joined.hidden, hidden.narrow(0, b * 8, std::min<int64_t>(8, 23 - b * 8))));
    EXPECT_EQ(joined.hidden.data_ptr(), by_batch[b].front().data_ptr())
        << "batch " << b << " copied";
  }
  // Rows that do not lie one after another in one buffer are copied.
  const core::TokenBatch apart =
      core::TokenBatch::Concat({core::TokenBatch{.hidden = by_batch[1].back()},
                                core::TokenBatch{.hidden = by_batch[0].front()}});
  EXPECT_TRUE(torch::equal(apart.hidden, torch::cat({by_batch[1].back(), by_batch[0].front()})));
  EXPECT_NE(apart.hidden.data_ptr(), by_batch[1].back().data_ptr());
}

TEST(RowStaging, LeavesToTheWholeParseWhatItCannotStage) {
  const torch::Tensor hidden = torch::randn({10, 4});
  const torch::Tensor targets = torch::randint(0, 9, {10}, torch::kLong);
  RowStaging staging;
  std::vector<StagedHidden> staged;
  v1::StepRequest message;
  // Not configured yet (before admission).
  EXPECT_FALSE(staging.Decode(FrameRows(hidden, targets, 0, 2).pieces(), &message, &staged));
  staging.Configure({.call_rows = 10, .batch_rows = 4, .width = 4, .dtype = torch::kFloat});
  // Rows past the call's.
  const torch::Tensor long_call = torch::randn({12, 4});
  EXPECT_FALSE(
      staging.Decode(FrameRows(long_call, targets.repeat({2}), 9, 3).pieces(), &message, &staged));
  EXPECT_TRUE(staged.empty());
  // Another width or dtype than the head's.
  ASSERT_TRUE(staging.Decode(FrameRows(hidden, targets, 0, 2).pieces(), &message, &staged));
  EXPECT_FALSE(
      staging.Decode(FrameRows(torch::randn({10, 5}), targets, 2, 2).pieces(), &message, &staged));
  EXPECT_FALSE(staging.Decode(FrameRows(hidden.to(torch::kDouble), targets, 2, 2).pieces(),
                              &message, &staged));
  // A header; grad_output only (a Backward by handle).
  v1::StepRequest header;
  header.mutable_header()->set_head_id("h");
  const std::string header_bytes = header.SerializeAsString();
  EXPECT_FALSE(staging.Decode({{header_bytes.data(), header_bytes.size()}}, &message, &staged));
  v1::StepRequest grads;
  wire::EncodeRows(torch::ones({2}), 0, 2, grads.mutable_rows()->mutable_grad_output());
  const std::string grad_bytes = grads.SerializeAsString();
  EXPECT_FALSE(staging.Decode({{grad_bytes.data(), grad_bytes.size()}}, &message, &staged));
}

}  // namespace
}  // namespace remotehead::server
