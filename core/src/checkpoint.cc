#include "remotehead/core/checkpoint.h"

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::core {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader copies it as it is");

constexpr std::pair<const char*, torch::ScalarType> kDtypes[] = {
    {"F32", torch::kFloat},  {"BF16", torch::kBFloat16}, {"F16", torch::kHalf},
    {"F64", torch::kDouble}, {"I64", torch::kLong},      {"I32", torch::kInt},
};

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // as the reference implementation

absl::StatusOr<nlohmann::json> ReadHeader(std::ifstream& in, const std::string& path,
                                          uint64_t* data_start) {
  uint64_t header_size = 0;
  if (!in.read(reinterpret_cast<char*>(&header_size), 8) || header_size > kMaxHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": expected an 8-byte header size below ",
                                            kMaxHeaderBytes, "; got a truncated or larger one"));
  }
  std::string header(header_size, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_size))) {
    return absl::DataLossError(
        absl::StrCat(path, ": expected a ", header_size, "-byte JSON header; the file is shorter"));
  }
  *data_start = 8 + header_size;
  nlohmann::json json = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": expected a JSON object header; got invalid JSON"));
  }
  return json;
}

// For an index.json, the shard file holding `name`.
absl::StatusOr<std::string> ResolveShard(const std::string& index_path, const std::string& name) {
  std::ifstream in(index_path);
  if (!in) return absl::NotFoundError(absl::StrCat("path: cannot open \"", index_path, "\""));
  nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::DataLossError(
        absl::StrCat(index_path, ": expected a JSON object with a \"weight_map\"; got none"));
  }
  const auto& map = index["weight_map"];
  if (!map.contains(name) || !map[name].is_string()) {
    std::vector<std::string> names;
    for (const auto& [key, value] : map.items()) names.push_back(key);
    return absl::NotFoundError(absl::StrCat("tensor \"", name, "\": expected one of [",
                                            absl::StrJoin(names, ", "), "] in ", index_path));
  }
  return (std::filesystem::path(index_path).parent_path() / map[name].get<std::string>()).string();
}

}  // namespace

namespace {

absl::StatusOr<torch::Tensor> ReadSafetensorImpl(const std::string& path, const std::string& name) {
  std::string file = path;
  if (absl::EndsWith(path, ".json")) {
    auto shard = ResolveShard(path, name);
    if (!shard.ok()) return shard.status();
    file = *shard;
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("path: cannot open \"", file, "\""));
  uint64_t data_start = 0;
  auto header = ReadHeader(in, file, &data_start);
  if (!header.ok()) return header.status();
  if (!header->contains(name)) {
    std::vector<std::string> names;
    for (const auto& [key, value] : header->items()) {
      if (key != "__metadata__") names.push_back(key);
    }
    return absl::NotFoundError(absl::StrCat("tensor \"", name, "\": expected one of [",
                                            absl::StrJoin(names, ", "), "] in ", file));
  }
  const nlohmann::json& entry = (*header)[name];
  const std::string dtype_name = entry.value("dtype", "");
  std::optional<torch::ScalarType> dtype;
  for (const auto& [wire, t] : kDtypes) {
    if (dtype_name == wire) dtype = t;
  }
  if (!dtype) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name,
                                                   "\".dtype: expected F32, BF16, F16, F64, I64 "
                                                   "or I32; got \"",
                                                   dtype_name, "\""));
  }
  // Sizes are non-negative integers whose byte count fits (found by fuzz_safetensors: a negative
  // size made torch::empty throw, an overflowing product wrapped around).
  std::vector<int64_t> shape;
  uint64_t bytes = c10::elementSize(*dtype);
  for (const auto& d : entry.value("shape", nlohmann::json::array())) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 62) ||
        __builtin_mul_overflow(bytes, d.get<uint64_t>(), &bytes) || bytes > (uint64_t{1} << 62)) {
      return absl::DataLossError(absl::StrCat(file, ": tensor \"", name,
                                              "\" expected a shape of sizes >= 0 whose byte count "
                                              "fits; got ",
                                              entry.value("shape", nlohmann::json()).dump()));
    }
    shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  const auto offsets = entry.value("data_offsets", std::vector<uint64_t>{});
  if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] - offsets[0] != bytes) {
    return absl::DataLossError(absl::StrCat(file, ": tensor \"", name, "\" expected ", bytes,
                                            " bytes of data for its shape; the offsets disagree"));
  }
  // The data must lie inside the file before anything is allocated for it.
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  if (offsets[1] > file_size || data_start > file_size - offsets[1]) {
    return absl::DataLossError(
        absl::StrCat(file, ": tensor \"", name, "\" data runs past the end of the file"));
  }
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(*dtype));
  in.seekg(static_cast<std::streamoff>(data_start + offsets[0]));
  if (!in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(bytes))) {
    return absl::DataLossError(
        absl::StrCat(file, ": tensor \"", name, "\" data runs past the end of the file"));
  }
  return t;
}

}  // namespace

absl::StatusOr<torch::Tensor> ReadSafetensor(const std::string& path, const std::string& name) {
  try {
    return ReadSafetensorImpl(path, name);
  } catch (const nlohmann::json::exception& e) {  // a header field of the wrong JSON type
    return absl::DataLossError(absl::StrCat(path, ": malformed safetensors header: ", e.what()));
  }
}

absl::StatusOr<int64_t> WriteSafetensors(const std::string& path,
                                         const std::map<std::string, torch::Tensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const char* dtype = nullptr;
    for (const auto& [wire, t] : kDtypes) {
      if (t == tensor.scalar_type()) dtype = wire;
    }
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": dtype ",
                                                     c10::toString(tensor.scalar_type()),
                                                     " has no safetensors representation"));
    }
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(cpu.nbytes());
    header[name] = {
        {"dtype", dtype}, {"shape", cpu.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(cpu));
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t header_size = text.size();
  out.write(reinterpret_cast<const char*>(&header_size), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const torch::Tensor& t : data) {
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("path: cannot write \"", path, "\""));
  return static_cast<int64_t>(8 + header_size + offset);
}

}  // namespace remotehead::core
