// The wire <-> torch seam: round trips for every dtype, precise errors for bad bytes, the
// row-chunk plan — and, by construction, one process that uses protobuf/gRPC messages and
// LibTorch together (the torch wheel bundles an old protobuf: a header or symbol clash between
// the two would fail to compile, link or run here first).
#include "remotehead/server/tensor_codec.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/status_mapping.h"

namespace remotehead {
namespace {

using server::DecodeTensor;
using server::EncodeTensor;

TEST(TensorCodec, RoundTripsEveryWireDtype) {
  for (torch::ScalarType dtype :
       {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble, torch::kLong, torch::kInt}) {
    SCOPED_TRACE(c10::toString(dtype));
    const torch::Tensor original = (torch::randn({5, 3}) * 100).to(dtype);
    v1::Tensor wire;
    ASSERT_TRUE(EncodeTensor(original, &wire).ok());
    EXPECT_EQ(wire.data().size(), 15u * original.element_size());
    auto decoded = DecodeTensor(wire, "t");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(*decoded, original));
  }
}

TEST(TensorCodec, EncodesNonContiguousViews) {
  const torch::Tensor base = torch::arange(12, torch::kFloat).reshape({3, 4});
  v1::Tensor wire;
  ASSERT_TRUE(EncodeTensor(base.t(), &wire).ok());
  EXPECT_TRUE(torch::equal(*DecodeTensor(wire, "t"), base.t()));
}

TEST(TensorCodec, BadWireTensorsAreRejectedWithPreciseMessages) {
  v1::Tensor wire;
  ASSERT_TRUE(EncodeTensor(torch::ones({8, 256}), &wire).ok());
  wire.mutable_data()->resize(8000);
  EXPECT_EQ(DecodeTensor(wire, "rows.hidden").status().message(),
            "rows.hidden: expected 8192 bytes for Float [8, 256]; got 8000");
  wire.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(DecodeTensor(wire, "rows.hidden").status().message(),
            "rows.hidden.dtype: expected one of FLOAT32, BFLOAT16, FLOAT16, FLOAT64, INT64, INT32; "
            "got DTYPE_UNSPECIFIED");
  wire.set_dtype(static_cast<v1::DType>(42));
  EXPECT_EQ(DecodeTensor(wire, "x").status().code(), absl::StatusCode::kInvalidArgument);
  wire.set_dtype(v1::DTYPE_FLOAT32);
  wire.clear_shape();
  wire.add_shape(-1);
  EXPECT_EQ(DecodeTensor(wire, "x").status().message(),
            "x.shape: expected non-negative sizes with fewer than 2^31 elements; got [-1]");
  wire.clear_shape();
  wire.add_shape(int64_t{1} << 40);
  wire.add_shape(int64_t{1} << 40);
  EXPECT_EQ(DecodeTensor(wire, "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorCodec, RowChunksCoverEveryRowOnceWithinTheByteLimit) {
  const auto chunks = server::PlanRowChunks(1000, 4096, server::kDefaultChunkBytes);
  int64_t next = 0;
  for (const auto& [offset, rows] : chunks) {
    EXPECT_EQ(offset, next);
    EXPECT_LE(rows * 4096, server::kDefaultChunkBytes);
    next += rows;
  }
  EXPECT_EQ(next, 1000);
  // A row larger than the limit still travels, one row per chunk.
  EXPECT_EQ(server::PlanRowChunks(3, 10 << 20, server::kDefaultChunkBytes).size(), 3u);
  EXPECT_TRUE(server::PlanRowChunks(0, 16, 1024).empty());
}

TEST(StatusMapping, KeepsCodeAndMessage) {
  const grpc::Status s =
      server::ToGrpcStatus(absl::InvalidArgumentError("targets[3]: expected ...; got 40"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "targets[3]: expected ...; got 40");
  EXPECT_EQ(server::ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(server::ToGrpcStatus(absl::FailedPreconditionError("x")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(server::ToGrpcStatus(absl::OkStatus()).ok());
}

// Serialised request bytes -> parsed message -> torch tensors -> engine -> wire dX: the whole
// protocol seam in one process, checked against the direct engine call.
TEST(ProtobufAndLibTorch, OneProcessParsesMessagesAndRunsTheEngine) {
  auto head = reference::MakeTestHead(300, 32, torch::kFloat, false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 40, "cross_entropy", core::Reduction::kMean);

  v1::StepRequest request;
  v1::StepRows* rows = request.mutable_rows();
  ASSERT_TRUE(EncodeTensor(batch.hidden, rows->mutable_hidden()).ok());
  ASSERT_TRUE(EncodeTensor(batch.targets, rows->mutable_targets()).ok());
  std::string bytes;
  ASSERT_TRUE(request.SerializeToString(&bytes));

  v1::StepRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  core::TokenBatch decoded;
  decoded.hidden = *DecodeTensor(parsed.rows().hidden(), "rows.hidden");
  decoded.targets = *DecodeTensor(parsed.rows().targets(), "rows.targets");
  auto via_wire = core::FusedForwardBackward(*head, decoded, {}, nullptr);
  auto direct = core::FusedForwardBackward(*head, batch, {}, nullptr);
  ASSERT_TRUE(via_wire.ok() && direct.ok());
  EXPECT_EQ(via_wire->loss, direct->loss);
  v1::TensorChunk dx;
  ASSERT_TRUE(EncodeTensor(via_wire->grad_hidden, dx.mutable_values()).ok());
  EXPECT_TRUE(torch::equal(*DecodeTensor(dx.values(), "dx"), direct->grad_hidden));
}

}  // namespace
}  // namespace remotehead
