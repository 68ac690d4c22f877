// The file RPCs (CreateHead from safetensors, SaveWeights) over a real gRPC channel: refused
// without --checkpoint_dir (ServiceOptions::checkpoint_dir), confined to it with it — relative
// paths, statuses that name the field, checkpoints saved and read back end to end.
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_join.h"
#include "remotehead/core/checkpoint_dir.h"
#include "server/service_fixture.h"

namespace remotehead {
namespace {

namespace fs = std::filesystem;

class FileRpcsTest : public ServiceFixture {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() /
            ("remotehead_files_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(base_ / "ckpt" / "model");
    fs::create_directories(base_ / "outside");
  }
  void TearDown() override {
    server_.reset();
    fs::remove_all(base_);
  }
  void StartWithCheckpointDir(int64_t memory_budget_bytes = 0) {
    auto dir = core::CheckpointDir::Open((base_ / "ckpt").string());
    ASSERT_TRUE(dir.ok()) << dir.status();
    StartService({.response_chunk_bytes = 1024,
                  .admission = {.memory_budget_bytes = memory_budget_bytes},
                  .checkpoint_dir = *dir});
  }
  // A safetensors file whose one float32 tensor `name` has `shape`, its data a hole (sparse: no
  // disk used, zeros when read).
  void WriteSparseSafetensors(const fs::path& path, const std::string& name,
                              const std::vector<int64_t>& shape) {
    int64_t bytes = 4;
    for (const int64_t d : shape) bytes *= d;
    const std::string header = absl::StrCat("{\"", name, "\": {\"dtype\": \"F32\", \"shape\": [",
                                            absl::StrJoin(shape, ", "), "], \"data_offsets\": [0, ",
                                            bytes, "]}}");
    {
      std::ofstream out(path, std::ios::binary);
      const uint64_t size = header.size();
      out.write(reinterpret_cast<const char*>(&size), 8);
      out << header;
    }
    fs::resize_file(path, 8 + header.size() + bytes);
  }
  static int64_t PeakResidentBytes() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return int64_t{usage.ru_maxrss} * 1024;
  }

  grpc::Status Save(const std::string& path, const std::string& weight_name = "",
                    v1::SaveWeightsResponse* saved = nullptr) {
    grpc::ClientContext context;
    v1::SaveWeightsRequest save;
    save.set_head_id("lm");
    save.set_path(path);
    save.set_weight_name(weight_name);
    v1::SaveWeightsResponse ignored;
    return stub_->SaveWeights(&context, save, saved != nullptr ? saved : &ignored);
  }
  grpc::Status Create(const std::string& id, const std::string& path,
                      const std::string& weight_name = "lm_head.weight",
                      const std::string& bias_name = "", v1::HeadInfo* info = nullptr) {
    grpc::ClientContext context;
    v1::CreateHeadRequest create;
    create.set_head_id(id);
    create.mutable_safetensors()->set_path(path);
    create.mutable_safetensors()->set_weight_name(weight_name);
    create.mutable_safetensors()->set_bias_name(bias_name);
    v1::HeadInfo ignored;
    return stub_->CreateHead(&context, create, info != nullptr ? info : &ignored);
  }
  static std::string Contents(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path base_;
};

TEST_F(FileRpcsTest, WithoutACheckpointDirEveryFileRpcIsFailedPrecondition) {
  StartService({.response_chunk_bytes = 1024});
  const grpc::Status saved = Save("lm.safetensors");
  EXPECT_EQ(saved.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(saved.error_message(),
            "path: expected a server started with --checkpoint_dir (the only directory it reads "
            "and writes checkpoints in); this one was started without, so it touches no files");
  EXPECT_FALSE(fs::exists("lm.safetensors"));
  const grpc::Status created = Create("copy", (base_ / "ckpt" / "lm.safetensors").string());
  EXPECT_EQ(created.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StartsWith(created.error_message(),
                               "safetensors.path: expected a server started with --checkpoint_dir"))
      << created.error_message();
  EXPECT_FALSE(registry().Get("copy").ok());
}

TEST_F(FileRpcsTest, SaveWeightsThenCreateHeadFromTheSafetensorsFile) {
  StartWithCheckpointDir();
  v1::SaveWeightsResponse saved;
  // As a tied model stores it.
  ASSERT_TRUE(Save("model/lm.safetensors", "model.embed_tokens.weight", &saved).ok());
  EXPECT_GT(saved.bytes_written(), kVocab * kHidden * 4);
  EXPECT_EQ(saved.bytes_written(),
            static_cast<int64_t>(fs::file_size(base_ / "ckpt" / "model" / "lm.safetensors")));

  grpc::ClientContext create_context;
  v1::CreateHeadRequest create;
  create.set_head_id("copy");
  create.mutable_safetensors()->set_path("model/lm.safetensors");
  create.mutable_safetensors()->set_weight_name("model.embed_tokens.weight");
  create.mutable_safetensors()->set_bias_name("lm_head.bias");
  create.set_dtype(v1::DTYPE_BFLOAT16);
  v1::HeadInfo info;
  ASSERT_TRUE(stub_->CreateHead(&create_context, create, &info).ok());
  EXPECT_EQ(info.dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_TRUE(info.has_bias());
  auto copy = *registry().Get("copy");
  EXPECT_TRUE(torch::equal(testing::HeadOf(*copy).weight(),
                           testing::HeadOf(*entry_).weight().to(torch::kBFloat16)));

  const grpc::Status missing = Create("other", "model/lm.safetensors");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(missing.error_message(),
            "safetensors.path: \"model/lm.safetensors\": tensor \"lm_head.weight\": not in the "
            "checkpoint (it has 2 tensors)");

  // A sharded checkpoint: its index names shards beside it.
  ASSERT_TRUE(Save("model/shard-1.safetensors").ok());
  std::ofstream(base_ / "ckpt" / "model" / "model.safetensors.index.json")
      << R"({"weight_map":{"lm_head.weight":"shard-1.safetensors","lm_head.bias":"shard-1.safetensors"}})";
  ASSERT_TRUE(
      Create("sharded", "model/model.safetensors.index.json", "lm_head.weight", "lm_head.bias")
          .ok());
  EXPECT_TRUE(torch::equal(testing::HeadOf(**registry().Get("sharded")).weight(),
                           testing::HeadOf(*entry_).weight()));
}

TEST_F(FileRpcsTest, PathsOutsideTheDirectoryAreRefusedNamingTheField) {
  StartWithCheckpointDir();
  std::ofstream(base_ / "outside" / "lm.safetensors") << "outside";
  const std::string absolute = (base_ / "outside" / "lm.safetensors").string();

  const grpc::Status abs_read = Create("a", absolute);
  EXPECT_EQ(abs_read.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(abs_read.error_message(),
            "safetensors.path: expected a path relative to the checkpoint directory; got the "
            "absolute path \"" +
                absolute + "\"");
  const grpc::Status up_read = Create("a", "../outside/lm.safetensors");
  EXPECT_EQ(up_read.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(up_read.error_message(),
            "safetensors.path: expected a path inside the checkpoint directory (no \"..\"); got "
            "\"../outside/lm.safetensors\"");
  EXPECT_EQ(Create("a", "").error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  const grpc::Status abs_save = Save(absolute);
  EXPECT_EQ(abs_save.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(abs_save.error_message(), "path: expected a path relative"));
  const grpc::Status up_save = Save("../outside/new.safetensors");
  EXPECT_EQ(up_save.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Contents(absolute), "outside");
  EXPECT_FALSE(fs::exists(base_ / "outside" / "new.safetensors"));

  fs::create_symlink(absolute, base_ / "ckpt" / "link.safetensors");
  const grpc::Status link = Create("a", "link.safetensors");
  EXPECT_EQ(link.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StartsWith(link.error_message(), "safetensors.path: \"link.safetensors\""));
  EXPECT_EQ(Save("link.safetensors").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Contents(absolute), "outside");

  const grpc::Status absent = Create("a", "model/absent.safetensors");
  EXPECT_EQ(absent.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(absent.error_message(),
            "safetensors.path: \"model/absent.safetensors\": no such file in the checkpoint "
            "directory");
  EXPECT_FALSE(registry().Get("a").ok());
}

TEST_F(FileRpcsTest, SaveWeightsReplacesOnlyItsOwnCheckpoints) {
  StartWithCheckpointDir();
  std::ofstream(base_ / "ckpt" / "notes.txt") << "the operator's notes";
  const grpc::Status refused = Save("notes.txt");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(refused.error_message(),
            "path: \"notes.txt\": expected a new file or a checkpoint written by remotehead to "
            "replace; the file there is not one, so it is left as it is");
  EXPECT_EQ(Contents(base_ / "ckpt" / "notes.txt"), "the operator's notes");

  ASSERT_TRUE(Save("lm.safetensors").ok());
  ASSERT_TRUE(Save("lm.safetensors", "model.embed_tokens.weight").ok());  // its own: replaced
  EXPECT_TRUE(Create("tied", "lm.safetensors", "model.embed_tokens.weight").ok());
  EXPECT_EQ(Create("old", "lm.safetensors").error_code(), grpc::StatusCode::NOT_FOUND);
  // No temporary files are left behind.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(base_ / "ckpt")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"lm.safetensors", "model", "notes.txt"}));
}

TEST_F(FileRpcsTest, AHeadBeyondTheBudgetIsRefusedBeforeItsDataIsRead) {
  StartWithCheckpointDir(/*memory_budget_bytes=*/64 << 20);
  // 2 GiB of float32 weights (a hole on disk): the reservation, made from the file's header,
  // refuses it before a byte of data is read into memory.
  WriteSparseSafetensors(base_ / "ckpt" / "big.safetensors", "w", {524288, 1024});
  const int64_t peak_before = PeakResidentBytes();
  const grpc::Status status = Create("big", "big.safetensors", "w");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find(
                "safetensors.vocab_size 524288 × safetensors.hidden_size 1024 float32"),
            std::string::npos)
      << status.error_message();
  EXPECT_LT(PeakResidentBytes() - peak_before, int64_t{512} << 20)
      << "the server read the tensor before refusing it";
  EXPECT_FALSE(registry().Get("big").ok());
  EXPECT_EQ(service().admission().Stats().head_bytes, kHeadBytes);
}

TEST_F(FileRpcsTest, AWeightThatIsNotTwoDimensionalIsRefusedNamingItsShape) {
  StartWithCheckpointDir();
  WriteSparseSafetensors(base_ / "ckpt" / "flat.safetensors", "w", {4, 8, 2});
  const grpc::Status status = Create("flat", "flat.safetensors", "w");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "safetensors.weight_name: expected a 2-D tensor [vocab_size, hidden_size]; \"w\" has "
            "shape [4, 8, 2]");
  EXPECT_FALSE(registry().Get("flat").ok());
}

}  // namespace
}  // namespace remotehead
