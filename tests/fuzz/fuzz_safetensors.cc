// libFuzzer target: the safetensors reader (core::ReadSafetensor, core/checkpoint.h) on files
// the fuzzer writes. Kept to this one small file: the reader's interface (a path) is the part
// most likely to change.
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

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Fail("cannot write " + path.string());
}

void Read(const std::filesystem::path& path, const std::string& name, size_t file_bytes) {
  auto t = core::ReadSafetensor(path.string(), name);
  if (!t.ok()) {
    const absl::StatusCode code = t.status().code();
    if (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kDataLoss &&
        code != absl::StatusCode::kInvalidArgument) {
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
  remotehead::fuzz::Dir();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace remotehead::fuzz;
  const std::vector<std::string> parts = SplitParts(data, size);
  const char* const names[] = {"lm_head.weight", "lm_head.bias", "weight"};
  if (parts.size() == 1) {
    const auto file = Dir() / "model.safetensors";
    Write(file, parts[0]);
    for (const char* name : names) Read(file, name, parts[0].size());
    return 0;
  }
  // Today's reader follows whatever path the index names; one naming a device or /proc file
  // (/dev/stdin would block) is not a checkpoint a test can judge, so it is skipped.
  if (parts[0].find("dev/") != std::string::npos || parts[0].find("proc/") != std::string::npos) {
    return 0;
  }
  const auto index = Dir() / "model.safetensors.index.json";
  Write(index, parts[0]);
  Write(Dir() / "model-00001-of-00001.safetensors", parts[1]);
  const size_t largest = std::max(parts[0].size(), parts[1].size());  // the index may name itself
  for (const char* name : names) Read(index, name, largest);
  return 0;
}
