// The wire codec (remotehead::wire, shared by the server and the C++ client): round trips for
// every dtype, the shared test vectors (tests/data/wire_vectors.json, which the Python client's
// codec is tested against too), precise errors for bad bytes, the row-chunk plans, the assembly
// of streamed rows, messages framed around their rows' bytes, row buffers — and, by
// construction, one process that uses protobuf/gRPC messages and LibTorch together (the torch
// wheel bundles an old protobuf: a header or symbol clash between the two would fail to
// compile, link or run here first).
#include "remotehead/wire/tensor_codec.h"

#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/reference.h"
#include "framed_rows.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/row_buffer.h"

namespace remotehead {
namespace {

using wire::DecodeTensor;
using wire::EncodeTensor;

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

// Found by fuzz_tensor_codec and fuzz_step_session (tests/fuzz/corpus/*/crash-empty-stride-
// overflow): an empty tensor whose other sizes multiply past int64 made torch::empty throw
// "Stride calculation overflowed" out of the codec. Now INVALID_ARGUMENT, like a large one;
// empty tensors of sane shapes still decode.
TEST(TensorCodec, EmptyTensorsWithHugeSizesAreRefusedNotThrown) {
  v1::Tensor wire;
  wire.set_dtype(v1::DTYPE_FLOAT32);
  for (const int64_t size : {int64_t{1} << 40, int64_t{1} << 31}) {
    wire.clear_shape();
    wire.add_shape(0);
    wire.add_shape(size);
    wire.add_shape(size);
    auto decoded = wire::DecodeTensorView(wire, "x");
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument) << size;
    EXPECT_EQ(DecodeTensor(wire, "x").status().code(), absl::StatusCode::kInvalidArgument);
  }
  wire.clear_shape();
  wire.add_shape(0);
  wire.add_shape(4096);
  auto empty = DecodeTensor(wire, "x");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->sizes().vec(), (std::vector<int64_t>{0, 4096}));
}

TEST(TensorCodec, RowChunksCoverEveryRowOnceWithinTheByteLimit) {
  const auto chunks = wire::PlanRowChunks(1000, 4096, wire::kDefaultChunkBytes);
  int64_t next = 0;
  for (const auto& [offset, rows] : chunks) {
    EXPECT_EQ(offset, next);
    EXPECT_LE(rows * 4096, wire::kDefaultChunkBytes);
    next += rows;
  }
  EXPECT_EQ(next, 1000);
  // A row larger than the limit still travels, one row per chunk.
  EXPECT_EQ(wire::PlanRowChunks(3, 10 << 20, wire::kDefaultChunkBytes).size(), 3u);
  EXPECT_TRUE(wire::PlanRowChunks(0, 16, 1024).empty());
}

// A request's messages fit their limit with their framing, or the plan is refused.
TEST(TensorCodec, RequestChunksLeaveRoomForFraming) {
  const int64_t framing = wire::FramingBytes(2, 0);
  auto chunks = wire::PlanRequestChunks(100, 1000, framing, 4096);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  for (const auto& r : *chunks) EXPECT_LE(r.count * 1000 + framing, 4096);
  EXPECT_EQ(chunks->back().offset + chunks->back().count, 100);
  EXPECT_EQ(wire::PlanRequestChunks(1, 4000, framing, 4096).status().message(),
            "chunk_bytes: expected room for at least one row (4000 bytes + 192 bytes of "
            "framing); got 4096");
}

// Streamed rows arrive in order, with the destination's trailing shape, within its rows.
TEST(TensorCodec, RowAssemblerTakesRowsInOrderAndRefusesTheRest) {
  const torch::Tensor source = torch::arange(20, torch::kFloat).reshape({5, 4});
  wire::RowAssembler rows(torch::empty({5, 4}), "weight_rows", /*convert_dtype=*/false);
  v1::TensorChunk chunk;
  chunk.set_row_offset(0);
  ASSERT_TRUE(EncodeTensor(source.narrow(0, 0, 2), chunk.mutable_values()).ok());
  ASSERT_TRUE(rows.Add(chunk).ok());
  EXPECT_EQ(rows.CheckComplete().message(), "weight_rows: expected 5 rows; got 2");
  chunk.set_row_offset(3);
  EXPECT_EQ(rows.Add(chunk).message(),
            "weight_rows.row_offset: expected 2 (rows arrive in order); got 3");
  chunk.set_row_offset(2);
  ASSERT_TRUE(EncodeTensor(source.narrow(0, 2, 3).to(torch::kDouble), chunk.mutable_values()).ok());
  EXPECT_EQ(rows.Add(chunk).message(),
            "weight_rows.values: expected Float [rows, 4] within the 3 rows left of 5; got "
            "Double [3, 4] at row 2");
  ASSERT_TRUE(EncodeTensor(torch::zeros({4, 4}), chunk.mutable_values()).ok());
  EXPECT_EQ(rows.Add(chunk).code(), absl::StatusCode::kInvalidArgument) << "past the last row";
  ASSERT_TRUE(EncodeTensor(source.narrow(0, 2, 3), chunk.mutable_values()).ok());
  ASSERT_TRUE(rows.Add(chunk).ok());
  EXPECT_TRUE(rows.CheckComplete().ok());
  EXPECT_TRUE(torch::equal(rows.tensor(), source));

  // The client's side converts what the server sends to the caller's dtype.
  wire::RowAssembler converting(torch::empty({3}, torch::kDouble), "outputs", true);
  v1::TensorChunk values;
  ASSERT_TRUE(EncodeTensor(torch::tensor({1.5f, -2.0f, 3.25f}), values.mutable_values()).ok());
  ASSERT_TRUE(converting.Add(values).ok());
  EXPECT_TRUE(torch::equal(converting.tensor(), torch::tensor({1.5, -2.0, 3.25}, torch::kDouble)));
}

// A striped step's results come back on any of its streams: in any order, each row once.
TEST(TensorCodec, RowAssemblerInAnyOrderTakesEachRowOnceAndRefusesOverlaps) {
  const torch::Tensor source = torch::arange(24, torch::kFloat).reshape({6, 4});
  wire::RowAssembler rows(torch::empty({6, 4}), "grad_hidden", /*convert_dtype=*/false,
                          wire::RowAssembler::Order::kAnyOrder);
  auto chunk = [&](int64_t offset, int64_t n) {
    v1::TensorChunk c;
    c.set_row_offset(offset);
    EXPECT_TRUE(EncodeTensor(source.narrow(0, offset, n), c.mutable_values()).ok());
    return c;
  };
  ASSERT_TRUE(rows.Add(chunk(4, 2)).ok()) << rows.Add(chunk(4, 2));
  ASSERT_TRUE(rows.Add(chunk(0, 1)).ok());
  EXPECT_EQ(rows.CheckComplete().message(), "grad_hidden: expected 6 rows; got 3");
  // Rows 3..4 overlap the chunk at 4; rows 0.. were taken already.
  EXPECT_EQ(rows.Add(chunk(3, 2)).message(),
            "grad_hidden.values: expected Float [rows, 4] within the 1 rows not yet received of "
            "6; got Float [2, 4] at row 3");
  EXPECT_EQ(rows.Add(chunk(0, 1)).code(), absl::StatusCode::kInvalidArgument);
  v1::TensorChunk outside = chunk(0, 1);
  outside.set_row_offset(7);
  EXPECT_EQ(rows.Add(outside).message(), "grad_hidden.row_offset: expected 0 to 6; got 7");
  ASSERT_TRUE(rows.Add(chunk(1, 3)).ok());
  EXPECT_TRUE(rows.CheckComplete().ok());
  EXPECT_EQ(rows.rows_received(), 6);
  EXPECT_TRUE(torch::equal(rows.tensor(), source));
}

std::string FromHex(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

// Frames: a rows message with its tensors' bytes referenced where they lie parses as the same
// message built and serialized whole — singular tensor fields, a map of tensors, large rows
// (varint lengths of several bytes) and empty ones — and its pieces point into the tensors.
TEST(Frames, ParseAsTheMessageBuiltWholeWithoutCopyingTheRows) {
  const torch::Tensor hidden = torch::randn({300, 700});  // 840,000 bytes of a row range
  const torch::Tensor targets = torch::randint(0, 50, {300}, torch::kLong);
  const torch::Tensor advantages = torch::randn({300});
  const torch::Tensor topk = torch::randn({300, 4});
  for (const auto& [offset, count] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 300}, {17, 5}, {300, 0}}) {
    SCOPED_TRACE(absl::StrCat("rows ", offset, "+", count));
    const testing::RowsMessage m =
        testing::MakeRowsMessage(hidden, targets, offset, count,
                                 {{"advantages", advantages}, {"teacher_topk_logprobs", topk}});
    const v1::StepRequest& whole = m.whole;
    const wire::Frames& frames = m.framed;
    v1::StepRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(frames.Flatten()));
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, whole))
        << parsed.ShortDebugString().substr(0, 400);
    EXPECT_EQ(frames.size(), frames.Flatten().size());
    // The rows' bytes are the tensor's own, not a copy.
    const char* base = static_cast<const char*>(hidden.data_ptr());
    bool referenced = count == 0;
    for (const wire::Frames::Piece& p : frames.pieces()) {
      referenced |=
          p.data == base + offset * 700 * 4 && p.size == static_cast<size_t>(count) * 2800;
    }
    EXPECT_TRUE(referenced);
  }
}

// Row buffers: from 2 MiB up a mapping of their own, 2 MiB-aligned, that holds what is written;
// below that an ordinary tensor.
TEST(RowBuffer, LargeBuffersAreAlignedForHugePagesAndHoldTheirRows) {
  const torch::Tensor large = wire::EmptyRows({4096, 1024}, torch::kFloat);  // 16 MiB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large.data_ptr()) % (uintptr_t{2} << 20), 0u);
  EXPECT_EQ(large.sizes(), torch::IntArrayRef({4096, 1024}));
  const torch::Tensor rows = torch::randn({4096, 1024});
  large.copy_(rows);
  EXPECT_TRUE(torch::equal(large, rows));
  const torch::Tensor small = wire::EmptyRows({3, 5}, torch::kBFloat16);
  EXPECT_EQ(small.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(small.numel(), 15);
}

// A freed large buffer's mapping is recycled for the next buffer of its size (memory already
// faulted in), not for one of another size, and two live buffers never share one.
TEST(RowBuffer, AFreedBufferIsRecycledForTheNextOfItsSize) {
  void* first = nullptr;
  {
    const torch::Tensor a = wire::EmptyRows({2048, 1024}, torch::kFloat);  // 8 MiB
    first = a.data_ptr();
  }
  const torch::Tensor other = wire::EmptyRows({4096, 1024}, torch::kFloat);
  EXPECT_NE(other.data_ptr(), first);
  const torch::Tensor again = wire::EmptyRows({2048, 1024}, torch::kFloat);
  EXPECT_EQ(again.data_ptr(), first);
  const torch::Tensor both = wire::EmptyRows({2048, 1024}, torch::kFloat);
  EXPECT_NE(both.data_ptr(), again.data_ptr());
  both.fill_(1);
  again.fill_(2);
  EXPECT_EQ(both.sum().item<double>(), 2048.0 * 1024);
}

// The vectors the Python client's codec is tested against as well (tests/data/, made by
// make_wire_vectors.py with struct and the generated message class, not with either codec):
// encoding the values gives exactly the stored message bytes, and decoding the message gives
// the values bit for bit.
TEST(WireVectors, EncodeAndDecodeMatchTheSharedVectors) {
  std::ifstream file(std::string(REMOTEHEAD_SOURCE_DIR) + "/tests/data/wire_vectors.json");
  ASSERT_TRUE(file.good()) << "tests/data/wire_vectors.json is missing";
  const nlohmann::json doc = nlohmann::json::parse(file);
  std::set<std::string> dtypes;
  for (const auto& v : doc.at("vectors")) {
    const std::string name = v.at("name");
    SCOPED_TRACE(name);
    v1::DType wire_dtype = v1::DTYPE_UNSPECIFIED;
    ASSERT_TRUE(v1::DType_Parse(v.at("dtype").get<std::string>(), &wire_dtype));
    const torch::ScalarType dtype = *wire::FromWireDtype(wire_dtype, name);
    dtypes.insert(v.at("dtype").get<std::string>());
    const std::vector<int64_t> shape = v.at("shape").get<std::vector<int64_t>>();
    torch::Tensor expected;
    if (dtype == torch::kLong || dtype == torch::kInt) {
      expected = torch::tensor(v.at("values").get<std::vector<int64_t>>(), torch::kLong);
    } else {
      expected = torch::tensor(v.at("values").get<std::vector<double>>(), torch::kDouble);
    }
    expected = expected.to(dtype).reshape(shape);

    v1::Tensor encoded;
    ASSERT_TRUE(EncodeTensor(expected, &encoded).ok());
    EXPECT_EQ(encoded.data(), FromHex(v.at("data_hex")));
    EXPECT_EQ(encoded.SerializeAsString(), FromHex(v.at("message_hex")));

    v1::Tensor parsed;
    ASSERT_TRUE(parsed.ParseFromString(FromHex(v.at("message_hex"))));
    auto decoded = DecodeTensor(parsed, name);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->scalar_type(), dtype);
    EXPECT_EQ(decoded->sizes().vec(), shape);
    EXPECT_TRUE(torch::equal(*decoded, expected));
  }
  EXPECT_EQ(dtypes.size(), 6u) << "a vector for every wire dtype";
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
