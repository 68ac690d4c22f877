// safetensors: a file built byte by byte from the format's specification is read correctly
// (so the reader is not only checked against our own writer), writer/reader round trips,
// sharded checkpoints through their index.json, and precise errors that quote no bytes of the
// file. (Confinement to the checkpoint directory: checkpoint_dir_test.)
#include "remotehead/core/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/reference.h"

namespace remotehead {
namespace {

namespace fs = std::filesystem;

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("remotehead_ckpt_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    auto root = core::CheckpointDir::Open(dir_.string());
    ASSERT_TRUE(root.ok()) << root.status();
    root_ = *root;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  // Reads / writes `name`, relative to the test's checkpoint directory.
  absl::StatusOr<torch::Tensor> Read(const std::string& name, const std::string& tensor) {
    return core::ReadSafetensor(*root_, name, tensor);
  }
  absl::StatusOr<int64_t> Write(const std::string& name,
                                const std::map<std::string, torch::Tensor>& tensors) {
    return core::WriteSafetensors(*root_, name, tensors);
  }
  // A file of an 8-byte header size, `header`, then `data`.
  void WriteRaw(const std::string& name, const std::string& header, const std::string& data) {
    const uint64_t size = header.size();
    std::ofstream out(Path(name), std::ios::binary);
    out.write(reinterpret_cast<const char*>(&size), 8);
    out << header << data;
  }
  fs::path dir_;
  std::shared_ptr<const core::CheckpointDir> root_;
};

TEST_F(Checkpoint, ReadsAFileBuiltFromTheSpecification) {
  // {"lm_head.weight": F32 [2, 3] at bytes 0..24} followed by the six floats 0.5 .. 3.0.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"lm_head.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  const uint64_t size = header.size();
  const float values[6] = {0.5f, 1.0f, 1.5f, 2.0f, 2.5f, 3.0f};
  {
    std::ofstream out(Path("spec.safetensors"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(&size), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    out.write(reinterpret_cast<const char*>(values), sizeof(values));
  }
  auto t = Read("spec.safetensors", "lm_head.weight");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(torch::equal(*t, torch::arange(1, 7, torch::kFloat).reshape({2, 3}) * 0.5));
}

TEST_F(Checkpoint, WriterAndReaderRoundTripEveryDtype) {
  std::map<std::string, torch::Tensor> tensors = {
      {"lm_head.weight", torch::randn({7, 5})},
      {"lm_head.bias", torch::randn({7}).to(torch::kBFloat16)},
      {"half", torch::randn({3, 2}).to(torch::kHalf)},
      {"ids", torch::arange(4, torch::kLong)},
  };
  auto bytes = Write("round.safetensors", tensors);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, static_cast<int64_t>(fs::file_size(Path("round.safetensors"))));
  for (const auto& [name, expected] : tensors) {
    auto t = Read("round.safetensors", name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(torch::equal(*t, expected)) << name;
  }
}

TEST_F(Checkpoint, TheWriterMarksItsFiles) {
  ASSERT_TRUE(Write("mine.safetensors", {{"w", torch::ones({2})}}).ok());
  std::ifstream in(Path("mine.safetensors"), std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find(R"("__metadata__":{"format":"pt","writer":"remotehead"})"),
            std::string::npos);
}

TEST_F(Checkpoint, ShardedCheckpointsResolveThroughTheirIndex) {
  const torch::Tensor embed = torch::randn({9, 4});
  const torch::Tensor head = torch::randn({9, 4});
  fs::create_directories(dir_ / "model");
  ASSERT_TRUE(
      Write("model/model-00001-of-00002.safetensors", {{"model.embed_tokens.weight", embed}}).ok());
  ASSERT_TRUE(Write("model/model-00002-of-00002.safetensors", {{"lm_head.weight", head}}).ok());
  std::ofstream(Path("model/model.safetensors.index.json"))
      << R"({"metadata":{},"weight_map":{"model.embed_tokens.weight":"model-00001-of-00002.safetensors","lm_head.weight":"model-00002-of-00002.safetensors","lm_head.bias":"model-00003-of-00002.safetensors"}})";
  const std::string index = "model/model.safetensors.index.json";
  EXPECT_TRUE(torch::equal(*Read(index, "lm_head.weight"), head));
  EXPECT_TRUE(torch::equal(*Read(index, "model.embed_tokens.weight"), embed));
  const auto unmapped = Read(index, "lm_head.scale");
  EXPECT_EQ(unmapped.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unmapped.status().message(),
            "path: \"model/model.safetensors.index.json\": tensor \"lm_head.scale\": not in the "
            "index's weight_map (it maps 3 tensors)");
  // A missing shard: NOT_FOUND, without spelling the shard's name (the index's content).
  const auto missing = Read(index, "lm_head.bias");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "path: the shard that \"model/model.safetensors.index.json\" maps \"lm_head.bias\" "
            "to: no such file in the checkpoint directory");
}

// A head group's shard reads only its rows: from a file and through a sharded checkpoint's
// index, in any dtype, 1-D (bias) and 2-D (weight); a range outside the tensor is refused.
TEST_F(Checkpoint, RowRangesAreTheRowsOfTheWholeTensor) {
  const torch::Tensor weight = torch::randn({11, 4}).to(torch::kBFloat16);
  const torch::Tensor bias = torch::randn({11});
  fs::create_directories(dir_ / "sharded");
  ASSERT_TRUE(Write("head.safetensors", {{"lm_head.weight", weight}, {"lm_head.bias", bias}}).ok());
  ASSERT_TRUE(Write("sharded/part-1.safetensors", {{"lm_head.weight", weight}}).ok());
  std::ofstream(Path("sharded/model.safetensors.index.json"))
      << R"({"weight_map":{"lm_head.weight":"part-1.safetensors"}})";
  for (const std::string& file :
       {std::string("head.safetensors"), std::string("sharded/model.safetensors.index.json")}) {
    for (const auto& [offset, rows] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 11}, {0, 6}, {6, 5}, {3, 4}, {10, 1}}) {
      auto t = core::ReadSafetensorRows(*root_, file, "lm_head.weight", offset, rows);
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_TRUE(torch::equal(*t, weight.narrow(0, offset, rows))) << file << " " << offset;
    }
  }
  auto b = core::ReadSafetensorRows(*root_, "head.safetensors", "lm_head.bias", 4, 7);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(torch::equal(*b, bias.narrow(0, 4, 7)));
  const auto outside = core::ReadSafetensorRows(*root_, "head.safetensors", "lm_head.weight", 8, 4);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("expected rows [8, 12) of its first dimension; it "
                                            "has 11 rows"),
            std::string::npos)
      << outside.status();
}

// Found by fuzz_safetensors (tests/fuzz/corpus/fuzz_safetensors/crash-negative-shape): sizes
// whose product matched the offsets but that were negative made torch::empty throw out of the
// reader; a shape whose byte count overflows, or data past the end of the file, must be refused
// before anything is allocated.
// The shapes fuzz_safetensors found (a negative size made torch::empty throw, an overflowing
// product wrapped around, a huge tensor was allocated before the file was checked).
TEST_F(Checkpoint, FuzzerFoundShapesAreDataLossBeforeAnyAllocation) {
  auto write = [&](const std::string& file, const std::string& entry, size_t data_bytes) {
    const std::string header = R"({"w":)" + entry + "}";
    const uint64_t size = header.size();
    std::ofstream out(Path(file), std::ios::binary);
    out.write(reinterpret_cast<const char*>(&size), 8);
    out << header << std::string(data_bytes, '\0');
  };
  write("negative.safetensors", R"({"dtype":"F32","shape":[-5,-2],"data_offsets":[0,40]})", 40);
  write("overflow.safetensors",
        R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]})", 0);
  write("huge.safetensors",
        R"({"dtype":"F32","shape":[1099511627776],"data_offsets":[0,4398046511104]})", 16);
  write("fractional.safetensors", R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})", 8);
  for (const char* file : {"negative.safetensors", "overflow.safetensors", "huge.safetensors",
                           "fractional.safetensors"}) {
    auto t = Read(file, "w");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << file << ": " << t.status();
  }
}

TEST_F(Checkpoint, BadFilesGetPreciseStatuses) {
  const auto absent = Read("absent.safetensors", "w");
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(absent.status().message(),
            "path: \"absent.safetensors\": no such file in the checkpoint directory");
  ASSERT_TRUE(Write("ok.safetensors", {{"w", torch::ones({4, 4})}}).ok());
  EXPECT_EQ(Read("ok.safetensors", "v").status().message(),
            "path: \"ok.safetensors\": tensor \"v\": not in the checkpoint (it has 1 tensors)");
  fs::resize_file(Path("ok.safetensors"), fs::file_size(Path("ok.safetensors")) - 10);
  EXPECT_EQ(Read("ok.safetensors", "w").status().code(), absl::StatusCode::kDataLoss);
  std::ofstream(Path("garbage.safetensors")) << "not a safetensors file at all";
  EXPECT_EQ(Read("garbage.safetensors", "w").status().code(), absl::StatusCode::kDataLoss);
  std::ofstream(Path("short.safetensors")) << "tiny";
  EXPECT_EQ(Read("short.safetensors", "w").status().code(), absl::StatusCode::kDataLoss);
  // A header field of the wrong JSON type is DATA_LOSS, not an exception.
  WriteRaw("typed.safetensors", R"({"w":{"dtype":"F32","shape":"wide","data_offsets":[0,4]}})",
           "abcd");
  EXPECT_EQ(Read("typed.safetensors", "w").status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(Checkpoint, EverySizeAndOffsetIsCheckedAgainstTheFile) {
  struct Case {
    const char* header;
    absl::StatusCode code;
  };
  const Case cases[] = {
      // negative dimension, dimension past int64, product overflowing
      {R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})",
       absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,16]}})",
       absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})",
       absl::StatusCode::kDataLoss},
      // offsets reversed, past the end, huge, negative, not two, not matching the shape
      {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[18446744073709551615,15]}})",
       absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[-16,0]}})", absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}})", absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", absl::StatusCode::kDataLoss},
      // the entry itself malformed; a dtype remotehead does not read
      {R"({"w":[1,2,3]})", absl::StatusCode::kDataLoss},
      {R"({"w":{"shape":[4],"data_offsets":[0,16]}})", absl::StatusCode::kDataLoss},
      {R"({"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})",
       absl::StatusCode::kInvalidArgument},
      {R"([1,2])", absl::StatusCode::kDataLoss},
  };
  for (const Case& c : cases) {
    WriteRaw("bad.safetensors", c.header, std::string(16, 'x'));
    const auto t = Read("bad.safetensors", "w");
    EXPECT_EQ(t.status().code(), c.code) << c.header << ": " << t.status();
  }
  // A header size larger than the file, and one near 2^64 (no overflow).
  for (const uint64_t size : {uint64_t{1000}, ~uint64_t{0}, ~uint64_t{0} - 7}) {
    std::ofstream out(Path("size.safetensors"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(&size), 8);
    out << "{}";
    out.close();
    EXPECT_EQ(Read("size.safetensors", "w").status().code(), absl::StatusCode::kDataLoss) << size;
  }
}

TEST_F(Checkpoint, MessagesCarryNoBytesOfTheFile) {
  const std::string secret = "SECRET-MARKER-7f3a";
  // The marker as a tensor name, a dtype, a shard name, invalid JSON, a JSON key, plain text.
  WriteRaw("names.safetensors",
           absl::StrCat(R"({")", secret, R"(":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})"),
           "abcd");
  WriteRaw("dtype.safetensors",
           absl::StrCat(R"({"w":{"dtype":")", secret, R"(","shape":[1],"data_offsets":[0,4]}})"),
           "abcd");
  WriteRaw("json.safetensors", absl::StrCat(R"({"w": )", secret, "}"), "");
  WriteRaw(
      "shape.safetensors",
      absl::StrCat(R"({"w":{"dtype":"F32","shape":[")", secret, R"("],"data_offsets":[0,4]}})"),
      "abcd");
  std::ofstream(Path("text.safetensors")) << secret << secret << secret;
  std::ofstream(Path("index.safetensors.index.json")) << absl::StrCat(
      R"({"weight_map":{"w":")", secret, R"(.safetensors","v":"../)", secret, R"(", "u": 5}})");
  std::ofstream(Path("badindex.safetensors.index.json")) << secret;
  const std::pair<const char*, const char*> reads[] = {
      {"names.safetensors", "w"},
      {"dtype.safetensors", "w"},
      {"json.safetensors", "w"},
      {"shape.safetensors", "w"},
      {"text.safetensors", "w"},
      {"index.safetensors.index.json", "w"},
      {"index.safetensors.index.json", "v"},
      {"index.safetensors.index.json", "u"},
      {"index.safetensors.index.json", "x"},
      {"badindex.safetensors.index.json", "w"},
  };
  for (const auto& [file, tensor] : reads) {
    const auto t = Read(file, tensor);
    ASSERT_FALSE(t.ok()) << file;
    EXPECT_EQ(std::string(t.status().message()).find("SECRET"), std::string::npos)
        << file << " " << tensor << ": " << t.status();
  }
}

}  // namespace
}  // namespace remotehead
