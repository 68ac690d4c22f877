// How a binary that links LibTorch resolves the C++ runtime: every symbol of the standard
// library that LibTorch also exports must come from libstdc++, not from libtorch. torch 2.11's
// libtorch.so exports a partial std::filesystem whose remove_all jumps to a null pointer, and
// a binary that listed libtorch.so before libstdc++.so crashed in the first remove_all (the C++
// client's suite did; the server's state store calls it too). cmake/RemoteheadTorch.cmake puts
// libstdc++ first; this checks the result with the loader's own answer: the definition that the
// lookup of each symbol finds after the executable (dlsym(RTLD_NEXT), the order the executable's
// PLT binds in), named by dladdr. Not the address `&std::filesystem::remove_all` evaluates to:
// where the executable's code takes that address directly (Ubuntu's GCC 13 on the GPU machine),
// it is the executable's own PLT entry, and dladdr names the executable.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <link.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "remotehead/core/torch_api.h"

namespace {

std::string LibraryOf(const void* address) {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

// The loaded objects in load order (the initial ones in the order the lookups search them), for
// the failure message: where a machine's loader orders libtorch first, this shows it.
std::string LoadOrder() {
  std::string order;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        auto* text = static_cast<std::string*>(out);
        const std::string name = info->dlpi_name != nullptr ? info->dlpi_name : "";
        if (!name.empty()) *text += "\n  " + name;
        return 0;
      },
      &order);
  return order;
}

// The mangled names of the functions below, in the C++ ABI this binary is built with.
#if _GLIBCXX_USE_CXX11_ABI
#define REMOTEHEAD_FS_PATH "NS_7__cxx114pathE"
#else
#define REMOTEHEAD_FS_PATH "NS_4pathE"
#endif

void ExpectFromTheCxxRuntime(const char* name, const char* mangled) {
  const void* address = dlsym(RTLD_NEXT, mangled);
  ASSERT_NE(address, nullptr) << mangled << ": " << dlerror();
  const std::string library = LibraryOf(address);
  EXPECT_NE(library.find("libstdc++"), std::string::npos)
      << "std::filesystem::" << name << " resolves to \"" << library << "\" (torch "
      << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
      << "): expected libstdc++; the objects in load order:" << LoadOrder();
}

// Functions the library defines (not inline in the header), each one torch 2.11 exports too.
TEST(TorchLinkage, StdFilesystemComesFromTheCxxRuntime) {
  // Used here, so that the executable links them as it links the server's calls.
  EXPECT_FALSE(std::filesystem::status("/nonexistent-remotehead").type() ==
               std::filesystem::file_type::directory);
  ExpectFromTheCxxRuntime("remove_all", "_ZNSt10filesystem10remove_allERK" REMOTEHEAD_FS_PATH);
  ExpectFromTheCxxRuntime("status", "_ZNSt10filesystem6statusERK" REMOTEHEAD_FS_PATH);
  ExpectFromTheCxxRuntime("create_directories",
                          "_ZNSt10filesystem18create_directoriesERK" REMOTEHEAD_FS_PATH);
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
