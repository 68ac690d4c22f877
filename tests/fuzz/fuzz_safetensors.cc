// libFuzzer target: the safetensors reader (core::ReadSafetensor, core/checkpoint.h) on files
// the fuzzer writes into a private checkpoint directory (core::CheckpointDir), read by relative
// path as the server reads them.
//
// Input: a .safetensors file, written to a private temporary directory and read by the names a
// head's checkpoint uses. When the input holds fuzz_input.h's separator, part 0 is a sharded
// checkpoint's index (model.safetensors.index.json) and part 1 the shard it may name
// (model-00001-of-00001.safetensors), read through the index.
//
// Checked, beyond "no crash, no exception, no sanitizer report": every refusal is NOT_FOUND,
// DATA_LOSS or INVALID_ARGUMENT (the reader's documented codes); a tensor read is a defined CPU
// tensor whose bytes lie inside the file.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/checkpoint_dir.h"

namespace remotehead::fuzz {
namespace {

const std::filesystem::path& Dir() {
  static const std::filesystem::path dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "remotehead-fuzz-XXXXXX");
    if (mkdtemp(tmpl.data()) == nullptr) Fail("mkdtemp failed");
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

const core::CheckpointDir& Checkpoints() {
  static const std::shared_ptr<const core::CheckpointDir> dir = [] {
    auto opened = core::CheckpointDir::Open(Dir().string());
    if (!opened.ok()) Fail("cannot open the checkpoint directory");
    return *std::move(opened);
  }();
  return *dir;
}

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Fail("cannot write " + path.string());
}

void Read(const std::string& relative, const std::string& name, size_t file_bytes) {
  auto t = core::ReadSafetensor(Checkpoints(), relative, name);
  if (!t.ok()) {
    const absl::StatusCode code = t.status().code();
    // PERMISSION_DENIED: an index naming a link; FAILED_PRECONDITION is never a reader's answer.
    if (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kDataLoss &&
        code != absl::StatusCode::kInvalidArgument &&
        code != absl::StatusCode::kPermissionDenied) {
      Fail("ReadSafetensor: unexpected code: " + t.status().ToString());
    }
    return;
  }
  if (!t->defined() || !t->device().is_cpu()) Fail("ReadSafetensor: not a defined CPU tensor");
  if (static_cast<size_t>(t->nbytes()) > file_bytes) Fail("a tensor larger than its file");
}

}  // namespace
}  // namespace remotehead::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  remotehead::fuzz::Checkpoints();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace remotehead::fuzz;
  const std::vector<std::string> parts = SplitParts(data, size);
  const char* const names[] = {"lm_head.weight", "lm_head.bias", "weight"};
  if (parts.size() == 1) {
    Write(Dir() / "model.safetensors", parts[0]);
    for (const char* name : names) Read("model.safetensors", name, parts[0].size());
    return 0;
  }
  // Shards the index names are confined to the directory (absolute paths, "..", links refused).
  Write(Dir() / "model.safetensors.index.json", parts[0]);
  Write(Dir() / "model-00001-of-00001.safetensors", parts[1]);
  const size_t largest = std::max(parts[0].size(), parts[1].size());  // the index may name itself
  for (const char* name : names) Read("model.safetensors.index.json", name, largest);
  return 0;
}
