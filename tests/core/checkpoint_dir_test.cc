// CheckpointDir: the server touches files inside the operator's checkpoint directory only.
// Absolute paths and ".." are refused before any file system access; symbolic links (as the file
// or as a directory on its path) are never followed; only regular files are opened, and a FIFO
// never blocks; writes are atomic and replace only checkpoints remotehead wrote. Messages name
// the field and the relative path, never bytes of a file.
#include "remotehead/core/checkpoint_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "remotehead/core/checkpoint.h"

namespace remotehead {
namespace {

namespace fs = std::filesystem;
using core::CheckpointDir;
using core::CheckpointFile;

constexpr char kSecret[] = "SECRET-MARKER-c41d";

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ =
        fs::temp_directory_path() /
        ("remotehead_cpdir_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
         "_" + std::to_string(getpid()) + "_" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(base_ / "root" / "sub");
    fs::create_directories(base_ / "outside");
    Text(base_ / "outside" / "secret.safetensors", std::string(kSecret) + " outside");
    auto dir = CheckpointDir::Open((base_ / "root").string());
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
  }
  void TearDown() override { fs::remove_all(base_); }

  fs::path Root() const { return base_ / "root"; }
  static void Text(const fs::path& path, const std::string& text) {
    std::ofstream(path, std::ios::binary) << text;
  }
  static std::string Contents(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  // The names in the checkpoint directory's top level.
  std::set<std::string> Listing() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(Root())) names.insert(e.path().filename());
    return names;
  }
  absl::Status Read(const std::string& relative) {
    return dir_->OpenForRead(relative, "safetensors.path").status();
  }
  absl::StatusOr<int64_t> Save(const std::string& relative) {
    return core::WriteSafetensors(*dir_, relative, {{"lm_head.weight", torch::ones({3, 2})}});
  }

  fs::path base_;
  std::shared_ptr<const CheckpointDir> dir_;
};

TEST_F(CheckpointDirTest, OpensAndReadsARegularFileInside) {
  Text(Root() / "sub" / "a.bin", "0123456789");
  auto file = dir_->OpenForRead("sub/./a.bin", "safetensors.path");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 10);
  char buffer[4] = {};
  ASSERT_TRUE(file->ReadAt(6, 4, buffer).ok());
  EXPECT_EQ(std::string(buffer, 4), "6789");
  // Past the end, and offsets that would overflow: DATA_LOSS, nothing read.
  EXPECT_EQ(file->ReadAt(7, 4, buffer).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(file->ReadAt(~uint64_t{0}, 2, buffer).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(file->ReadAt(2, ~uint64_t{0}, buffer).code(), absl::StatusCode::kDataLoss);
}

TEST_F(CheckpointDirTest, AbsolutePathsAreRefusedNamingTheField) {
  const std::string outside = (base_ / "outside" / "secret.safetensors").string();
  const absl::Status s = Read(outside);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "safetensors.path: expected a path relative to the checkpoint directory; got the "
            "absolute path \"" +
                outside + "\"");
  // Absent or present outside: the same answer (nothing is looked at).
  const absl::Status absent = Read((base_ / "outside" / "absent").string());
  EXPECT_EQ(absent.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Read("/etc/shadow").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointDirTest, DotDotEmptyAndOddPathsAreRefused) {
  for (const std::string path :
       {"../outside/secret.safetensors", "sub/../../outside/x", "..", "sub/..", "sub/../a"}) {
    const absl::Status s = Read(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_EQ(s.message(),
              "safetensors.path: expected a path inside the checkpoint directory (no \"..\"); "
              "got \"" +
                  path + "\"")
        << path;
  }
  EXPECT_EQ(Read("").message(),
            "safetensors.path: expected a file path relative to the checkpoint directory; got "
            "\"\"");
  EXPECT_EQ(Read(".").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Read("./").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Read(std::string("a\0b", 3)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Read(std::string(5000, 'a')).code(), absl::StatusCode::kInvalidArgument);
  // Names that merely contain dots are fine.
  Text(Root() / "..a..", "x");
  EXPECT_TRUE(Read("..a..").ok());
}

TEST_F(CheckpointDirTest, ASymlinkToAFileIsNotFollowed) {
  fs::create_symlink(base_ / "outside" / "secret.safetensors", Root() / "link.safetensors");
  const absl::Status s = Read("link.safetensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(),
            "safetensors.path: \"link.safetensors\": expected a regular file; got a symbolic "
            "link (links in the checkpoint directory are not followed)");
  // Even a link to a file inside.
  Text(Root() / "real.bin", "x");
  fs::create_symlink("real.bin", Root() / "alias.bin");
  EXPECT_EQ(Read("alias.bin").code(), absl::StatusCode::kPermissionDenied);
  // And a dangling one.
  fs::create_symlink(base_ / "outside" / "absent", Root() / "dangling.bin");
  EXPECT_EQ(Read("dangling.bin").code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(CheckpointDirTest, ASymlinkedDirectoryOnThePathIsNotFollowed) {
  fs::create_directory_symlink(base_ / "outside", Root() / "sub" / "out");
  const absl::Status s = Read("sub/out/secret.safetensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(),
            "safetensors.path: \"sub/out/secret.safetensors\": expected no symbolic links on the "
            "path; \"sub/out\" is one (links in the checkpoint directory are not followed)");
  EXPECT_EQ(std::string(s.message()).find(kSecret), std::string::npos);
  // Nor is one written through.
  const auto saved = Save("sub/out/new.safetensors");
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(fs::exists(base_ / "outside" / "new.safetensors"));
}

TEST_F(CheckpointDirTest, AFifoIsRefusedPromptlyWithoutBlocking) {
  ASSERT_EQ(::mkfifo((Root() / "pipe.safetensors").c_str(), 0644), 0);
  // No writer ever opens the FIFO: a blocking open would hang, so run it on another thread.
  auto read = std::async(std::launch::async, [&] { return Read("pipe.safetensors"); });
  ASSERT_EQ(read.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "opening a FIFO blocked";
  const absl::Status s = read.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "safetensors.path: \"pipe.safetensors\": expected a regular file; got a FIFO");
  auto load = std::async(std::launch::async, [&] {
    return core::ReadSafetensor(*dir_, "pipe.safetensors", "w").status();
  });
  ASSERT_EQ(load.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(load.get().code(), absl::StatusCode::kInvalidArgument);
  auto save = std::async(std::launch::async, [&] { return Save("pipe.safetensors").status(); });
  ASSERT_EQ(save.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const absl::Status saved = save.get();
  EXPECT_EQ(saved.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(saved.message(),
            "path: \"pipe.safetensors\": expected a new file or a checkpoint to replace; got a "
            "FIFO");
  struct stat st;
  ASSERT_EQ(::lstat((Root() / "pipe.safetensors").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST_F(CheckpointDirTest, DirectoriesAreNotFiles) {
  const absl::Status s = Read("sub");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "safetensors.path: \"sub\": expected a regular file; got a directory");
  EXPECT_EQ(Read("sub/").code(), absl::StatusCode::kInvalidArgument);
  Text(Root() / "file", "x");
  const absl::Status through = Read("file/x");
  EXPECT_EQ(through.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(through.message(),
            "safetensors.path: \"file/x\": expected \"file\" to be a directory; got a regular "
            "file");
  EXPECT_EQ(Save("sub").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::is_directory(Root() / "sub"));
}

TEST_F(CheckpointDirTest, AMissingFileIsNotFoundNamingTheFieldAndPath) {
  const absl::Status s = Read("sub/absent.safetensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(),
            "safetensors.path: \"sub/absent.safetensors\": no such file in the checkpoint "
            "directory");
  const absl::Status dir = Read("nodir/absent.safetensors");
  EXPECT_EQ(dir.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(dir.message(),
            "safetensors.path: \"nodir/absent.safetensors\": expected \"nodir\" to be a "
            "directory in the checkpoint directory; there is none");
  // Saving does not create directories.
  EXPECT_EQ(Save("nodir/new.safetensors").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointDirTest, LoadingAFileThatIsNotACheckpointQuotesNoneOfIt) {
  Text(Root() / "notes.safetensors", std::string(kSecret) + "\n" + kSecret + " more text");
  Text(Root() / "notes.safetensors.index.json", std::string("{\"") + kSecret + "\": 1}");
  for (const std::string path : {"notes.safetensors", "notes.safetensors.index.json"}) {
    const auto t = core::ReadSafetensor(*dir_, path, "lm_head.weight", "safetensors.path");
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << t.status();
    EXPECT_EQ(std::string(t.status().message()).find("SECRET"), std::string::npos) << t.status();
    EXPECT_TRUE(absl::StartsWith(t.status().message(), "safetensors.path: \"" + path + "\""))
        << t.status();
  }
}

TEST_F(CheckpointDirTest, SavingNeverReplacesAFileThatIsNotARemoteheadCheckpoint) {
  const std::string precious = std::string(kSecret) + ": the operator's notes";
  Text(Root() / "notes.safetensors", precious);
  const auto saved = Save("notes.safetensors");
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(saved.status().message(),
            "path: \"notes.safetensors\": expected a new file or a checkpoint written by "
            "remotehead to replace; the file there is not one, so it is left as it is");
  EXPECT_EQ(Contents(Root() / "notes.safetensors"), precious);
  // Nor a safetensors file that another writer made (Hugging Face's, say).
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const uint64_t size = header.size();
  std::string foreign(reinterpret_cast<const char*>(&size), 8);
  foreign += header + "abcd";
  Text(Root() / "hf.safetensors", foreign);
  EXPECT_EQ(Save("hf.safetensors").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Contents(Root() / "hf.safetensors"), foreign);
  EXPECT_EQ(Listing(), (std::set<std::string>{"sub", "notes.safetensors", "hf.safetensors"}));
}

TEST_F(CheckpointDirTest, SavingReplacesARemoteheadCheckpoint) {
  ASSERT_TRUE(core::WriteSafetensors(*dir_, "ckpt.safetensors", {{"old", torch::zeros({5})}}).ok());
  const auto bytes = Save("ckpt.safetensors");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, static_cast<int64_t>(fs::file_size(Root() / "ckpt.safetensors")));
  auto w = core::ReadSafetensor(*dir_, "ckpt.safetensors", "lm_head.weight");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(torch::equal(*w, torch::ones({3, 2})));
  EXPECT_EQ(core::ReadSafetensor(*dir_, "ckpt.safetensors", "old").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Listing(), (std::set<std::string>{"sub", "ckpt.safetensors"}));
  // A new file: 0644 less the umask, not group- or world-writable.
  ASSERT_TRUE(Save("sub/new.safetensors").ok());
  const fs::perms p = fs::status(Root() / "sub" / "new.safetensors").permissions();
  EXPECT_EQ(p & (fs::perms::group_write | fs::perms::others_write), fs::perms::none);
  EXPECT_NE(p & fs::perms::owner_write, fs::perms::none);
}

TEST_F(CheckpointDirTest, AFailedWriteLeavesThePreviousFileIntactAndNoTemporaryFile) {
  ASSERT_TRUE(Save("ckpt.safetensors").ok());
  const std::string before = Contents(Root() / "ckpt.safetensors");
  std::map<std::string, uintmax_t> during;  // name -> size, while the write is under way
  const auto failed = dir_->WriteAtomically(
      "ckpt.safetensors", "path", [](const CheckpointFile&) { return absl::OkStatus(); },
      [&](CheckpointFile& out) {
        const std::string partial(1000, 'z');
        EXPECT_TRUE(out.Write(partial.data(), partial.size()).ok());
        for (const std::string& name : Listing()) {
          during[name] = fs::is_regular_file(Root() / name) ? fs::file_size(Root() / name) : 0;
        }
        return absl::InternalError("injected failure before the rename");
      });
  EXPECT_EQ(failed.status().message(), "injected failure before the rename");
  // The temporary file was written beside the target...
  ASSERT_EQ(during.size(), 3u);
  for (const auto& [name, size] : during) {
    if (name != "sub" && name != "ckpt.safetensors") {
      EXPECT_TRUE(absl::StartsWith(name, ".ckpt.safetensors.tmp-")) << name;
      EXPECT_EQ(size, 1000u);
    }
  }
  // ... and is gone; the checkpoint is byte for byte what it was.
  EXPECT_EQ(Listing(), (std::set<std::string>{"sub", "ckpt.safetensors"}));
  EXPECT_EQ(Contents(Root() / "ckpt.safetensors"), before);
  // A refusal by may_replace writes nothing at all.
  const auto refused = dir_->WriteAtomically(
      "ckpt.safetensors", "path",
      [](const CheckpointFile& f) { return absl::FailedPreconditionError(f.where()); },
      [](CheckpointFile&) -> absl::Status {
        ADD_FAILURE() << "written despite the refusal";
        return absl::OkStatus();
      });
  EXPECT_EQ(refused.status().message(), "path: \"ckpt.safetensors\"");
  EXPECT_EQ(Contents(Root() / "ckpt.safetensors"), before);
}

TEST_F(CheckpointDirTest, SavingOutsideOrThroughALinkIsRefusedAndWritesNothing) {
  EXPECT_EQ(Save("../outside/x.safetensors").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Save((base_ / "outside" / "x.safetensors").string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(base_ / "outside" / "x.safetensors"));
  fs::create_symlink(base_ / "outside" / "secret.safetensors", Root() / "link.safetensors");
  const auto saved = Save("link.safetensors");
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Contents(base_ / "outside" / "secret.safetensors"), std::string(kSecret) + " outside");
  EXPECT_TRUE(fs::is_symlink(Root() / "link.safetensors"));
}

TEST_F(CheckpointDirTest, AShardedIndexCannotPointOutside) {
  fs::create_directories(base_ / "root" / "model");
  fs::copy_file(base_ / "outside" / "secret.safetensors", base_ / "root" / "copy.safetensors");
  ASSERT_TRUE(Save("model/ok.safetensors").ok());
  const std::string outside = (base_ / "outside" / "secret.safetensors").string();
  Text(Root() / "model" / "model.safetensors.index.json",
       R"({"weight_map":{"up":"../copy.safetensors","abs":")" + outside +
           R"(","deep":"x/../../copy.safetensors","empty":"","link":"link.safetensors",)"
           R"("lm_head.weight":"ok.safetensors"}})");
  fs::create_symlink(outside, Root() / "model" / "link.safetensors");
  const std::string index = "model/model.safetensors.index.json";
  for (const std::string name : {"up", "abs", "deep", "empty"}) {
    const auto t = core::ReadSafetensor(*dir_, index, name, "safetensors.path");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << name << t.status();
    EXPECT_EQ(t.status().message(),
              "safetensors.path: \"model/model.safetensors.index.json\": weight_map[\"" + name +
                  "\"]: expected a shard file name relative to the index's directory, without "
                  "\"..\"; got one that leads elsewhere");
  }
  const auto link = core::ReadSafetensor(*dir_, index, "link", "safetensors.path");
  EXPECT_EQ(link.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(std::string(link.status().message()).find("link.safetensors"), std::string::npos)
      << link.status();
  // The index's own shards still load.
  EXPECT_TRUE(core::ReadSafetensor(*dir_, index, "lm_head.weight").ok());
}

// The directory operations of the durable state store: listings see links as links (and read
// the same entries each time), a directory is never made or removed through a link, and only our
// own temporary files (what a crash mid-write leaves) are cleaned.
TEST_F(CheckpointDirTest, DirectoryOperationsNeverFollowLinks) {
  fs::create_symlink(base_ / "outside", Root() / "linked");
  fs::create_symlink(base_ / "outside" / "secret.safetensors", Root() / "sub" / "file-link");
  Text(Root() / "sub" / "real.safetensors", "real");
  for (int listing = 0; listing < 2; ++listing) {
    auto entries = dir_->List("", "f");
    ASSERT_TRUE(entries.ok()) << entries.status();
    std::map<std::string, core::DirEntry::Kind> kinds;
    for (const auto& e : *entries) kinds[e.name] = e.kind;
    EXPECT_EQ(kinds, (std::map<std::string, core::DirEntry::Kind>{
                         {"sub", core::DirEntry::Kind::kDirectory},
                         {"linked", core::DirEntry::Kind::kLink}}));
  }
  EXPECT_EQ(dir_->List("linked", "f").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(dir_->MakeDirectory("linked", "f").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(dir_->MakeDirectory("linked/new", "f").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(fs::exists(base_ / "outside" / "new"));
  EXPECT_TRUE(dir_->MakeDirectory("made", "f").ok());
  EXPECT_TRUE(dir_->MakeDirectory("made", "f").ok());  // already one
  EXPECT_TRUE(fs::is_directory(Root() / "made"));
  EXPECT_EQ(dir_->MakeDirectory("sub/real.safetensors", "f").code(),
            absl::StatusCode::kFailedPrecondition);
  // Removing a link removes the link, never what it names.
  EXPECT_TRUE(dir_->Remove("sub/file-link", "f").ok());
  EXPECT_TRUE(fs::exists(base_ / "outside" / "secret.safetensors"));
  EXPECT_EQ(dir_->RemoveDirectory("linked", "f").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(fs::exists(base_ / "outside" / "secret.safetensors"));
}

TEST_F(CheckpointDirTest, TemporaryFilesOfCrashedWritesAreCleanedAndNothingElse) {
  Text(Root() / "sub" / ".real.safetensors.tmp-4242-0", "partial");
  Text(Root() / "sub" / ".real.safetensors.tmp-77-12", "partial");
  Text(Root() / "sub" / ".hidden", "kept");
  Text(Root() / "sub" / "notes.tmp-1-2", "kept: not ours (no leading dot)");
  fs::create_symlink(base_ / "outside" / "secret.safetensors", Root() / "sub" / ".x.tmp-1-1");
  auto removed = dir_->RemoveTemporaryFiles("sub", "f");
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 2);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(Root() / "sub")) left.insert(e.path().filename());
  EXPECT_EQ(left, (std::set<std::string>{".hidden", "notes.tmp-1-2", ".x.tmp-1-1"}));
  // A write's own temporary file is one of them (one home for the naming): what a crash in
  // the middle of this write would leave is cleaned.
  int during = -1;
  const auto write = dir_->WriteAtomically(
      "sub/w.safetensors", "f", [](const CheckpointFile&) { return absl::OkStatus(); },
      [&](CheckpointFile&) {
        during = dir_->RemoveTemporaryFiles("sub", "f").value_or(-1);
        return absl::InternalError("stopped here");
      });
  EXPECT_FALSE(write.ok());
  EXPECT_EQ(during, 1);
}

TEST_F(CheckpointDirTest, OpeningTheRootChecksItIsADirectory) {
  EXPECT_EQ(CheckpointDir::Open((base_ / "absent").string()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(
      CheckpointDir::Open((base_ / "outside" / "secret.safetensors").string()).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckpointDir::Open("").status().code(), absl::StatusCode::kInvalidArgument);
  // The root itself may be reached through a link: the operator chose it.
  fs::create_directory_symlink(Root(), base_ / "root-link");
  auto linked = CheckpointDir::Open((base_ / "root-link").string());
  ASSERT_TRUE(linked.ok()) << linked.status();
  ASSERT_TRUE(Save("a.safetensors").ok());
  EXPECT_TRUE((*linked)->OpenForRead("a.safetensors", "path").ok());
}

}  // namespace
}  // namespace remotehead
