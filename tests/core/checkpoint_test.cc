// safetensors: a file built byte by byte from the format's specification is read correctly
// (so the reader is not only checked against our own writer), writer/reader round trips,
// sharded checkpoints through their index.json, and precise errors.
#include "remotehead/core/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

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
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
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
  auto t = core::ReadSafetensor(Path("spec.safetensors"), "lm_head.weight");
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
  auto bytes = core::WriteSafetensors(Path("round.safetensors"), tensors);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, static_cast<int64_t>(fs::file_size(Path("round.safetensors"))));
  for (const auto& [name, expected] : tensors) {
    auto t = core::ReadSafetensor(Path("round.safetensors"), name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(torch::equal(*t, expected)) << name;
  }
}

TEST_F(Checkpoint, ShardedCheckpointsResolveThroughTheirIndex) {
  const torch::Tensor embed = torch::randn({9, 4});
  const torch::Tensor head = torch::randn({9, 4});
  ASSERT_TRUE(core::WriteSafetensors(Path("model-00001-of-00002.safetensors"),
                                     {{"model.embed_tokens.weight", embed}})
                  .ok());
  ASSERT_TRUE(
      core::WriteSafetensors(Path("model-00002-of-00002.safetensors"), {{"lm_head.weight", head}})
          .ok());
  std::ofstream(Path("model.safetensors.index.json"))
      << R"({"metadata":{},"weight_map":{"model.embed_tokens.weight":"model-00001-of-00002.safetensors","lm_head.weight":"model-00002-of-00002.safetensors"}})";
  const std::string index = Path("model.safetensors.index.json");
  EXPECT_TRUE(torch::equal(*core::ReadSafetensor(index, "lm_head.weight"), head));
  EXPECT_TRUE(torch::equal(*core::ReadSafetensor(index, "model.embed_tokens.weight"), embed));
  const auto missing = core::ReadSafetensor(index, "lm_head.bias");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "tensor \"lm_head.bias\": expected one of [lm_head.weight, model.embed_tokens.weight] "
            "in " +
                index);
}

// Found by fuzz_safetensors (tests/fuzz/corpus/fuzz_safetensors/crash-negative-shape): sizes
// whose product matched the offsets but that were negative made torch::empty throw out of the
// reader; a shape whose byte count overflows, or data past the end of the file, must be refused
// before anything is allocated.
TEST_F(Checkpoint, BadShapesAndOffsetsAreDataLossNotExceptions) {
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
    auto t = core::ReadSafetensor(Path(file), "w");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << file << ": " << t.status();
  }
  EXPECT_EQ(core::ReadSafetensor(Path("negative.safetensors"), "w").status().message(),
            Path("negative.safetensors") +
                ": tensor \"w\" expected a shape of sizes >= 0 whose byte count fits; got [-5,-2]");
  EXPECT_EQ(core::ReadSafetensor(Path("huge.safetensors"), "w").status().message(),
            Path("huge.safetensors") + ": tensor \"w\" data runs past the end of the file");
}

TEST_F(Checkpoint, BadFilesGetPreciseStatuses) {
  EXPECT_EQ(core::ReadSafetensor(Path("absent.safetensors"), "w").status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(core::WriteSafetensors(Path("ok.safetensors"), {{"w", torch::ones({4, 4})}}).ok());
  EXPECT_EQ(core::ReadSafetensor(Path("ok.safetensors"), "v").status().message(),
            "tensor \"v\": expected one of [w] in " + Path("ok.safetensors"));
  fs::resize_file(Path("ok.safetensors"), fs::file_size(Path("ok.safetensors")) - 10);
  EXPECT_EQ(core::ReadSafetensor(Path("ok.safetensors"), "w").status().code(),
            absl::StatusCode::kDataLoss);
  std::ofstream(Path("garbage.safetensors")) << "not a safetensors file at all";
  EXPECT_EQ(core::ReadSafetensor(Path("garbage.safetensors"), "w").status().code(),
            absl::StatusCode::kDataLoss);
  // A header field of the wrong JSON type is DATA_LOSS, not an exception.
  const std::string header = R"({"w":{"dtype":"F32","shape":"wide","data_offsets":[0,4]}})";
  const uint64_t size = header.size();
  {
    std::ofstream out(Path("typed.safetensors"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(&size), 8);
    out << header << "abcd";
  }
  EXPECT_EQ(core::ReadSafetensor(Path("typed.safetensors"), "w").status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace remotehead
