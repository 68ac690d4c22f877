// How a binary that links LibTorch resolves the C++ runtime: every symbol of the standard
// library that LibTorch also exports must come from libstdc++, not from libtorch. torch 2.11's
// libtorch.so exports a partial std::filesystem whose remove_all jumps to a null pointer, and
// a binary that listed libtorch.so before libstdc++.so crashed in the first remove_all (the C++
// client's suite did; the server's state store calls it too). cmake/RemoteheadTorch.cmake puts
// libstdc++ first; this checks the result with the loader's own answer (dladdr).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

std::string LibraryOf(const void* address) {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

void ExpectFromTheCxxRuntime(const char* name, const void* address) {
  const std::string library = LibraryOf(address);
  EXPECT_NE(library.find("libstdc++"), std::string::npos)
      << "std::filesystem::" << name << " resolves to \"" << library << "\" (torch "
      << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "): expected libstdc++";
}

// Functions the library defines (not inline in the header), each one torch 2.11 exports too.
TEST(TorchLinkage, StdFilesystemComesFromTheCxxRuntime) {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  using Status = std::filesystem::file_status (*)(const std::filesystem::path&);
  using CreateDirectories = bool (*)(const std::filesystem::path&);
  const RemoveAll remove_all = &std::filesystem::remove_all;
  const Status status = &std::filesystem::status;
  const CreateDirectories create_directories = &std::filesystem::create_directories;
  ExpectFromTheCxxRuntime("remove_all", reinterpret_cast<const void*>(remove_all));
  ExpectFromTheCxxRuntime("status", reinterpret_cast<const void*>(status));
  ExpectFromTheCxxRuntime("create_directories", reinterpret_cast<const void*>(create_directories));
}

TEST(TorchLinkage, RemoveAllWorksInAProcessWithLibTorch) {
  // LibTorch loaded and used, then the call that crashed.
  EXPECT_EQ(torch::ones({2}).sum().item<float>(), 2.0f);
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("remotehead-linkage-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a");
  std::ofstream(dir / "a" / "f") << "x";
  EXPECT_EQ(std::filesystem::remove_all(dir), 3u);
  EXPECT_FALSE(std::filesystem::exists(dir));
}

}  // namespace
