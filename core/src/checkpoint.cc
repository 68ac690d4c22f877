#include "remotehead/core/checkpoint.h"

#include <bit>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "safetensors_dtypes.h"

namespace remotehead::core {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader copies it as it is");

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // as the reference implementation
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

struct Header {
  nlohmann::json json;
  uint64_t data_start = 0;  // 8 + the header's size
};

// The JSON header of the safetensors file `file`, every size checked against the file's.
absl::StatusOr<Header> ReadHeader(const CheckpointFile& file) {
  const uint64_t size = static_cast<uint64_t>(file.size());
  if (size < 8) {
    return absl::DataLossError(absl::StrCat(
        file.where(), ": expected a safetensors file (an 8-byte header size first); got ", size,
        " bytes"));
  }
  uint64_t header_size = 0;
  RETURN_IF_ERROR(file.ReadAt(0, 8, &header_size));
  if (header_size > kMaxHeaderBytes || header_size > size - 8) {
    return absl::DataLossError(absl::StrCat(
        file.where(), ": expected a header size of at most ", std::min(kMaxHeaderBytes, size - 8),
        " bytes (the file's rest, at most 100 MiB); got a larger one"));
  }
  std::string text(header_size, '\0');
  RETURN_IF_ERROR(file.ReadAt(8, header_size, text.data()));
  Header header{.json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false),
                .data_start = 8 + header_size};
  if (!header.json.is_object()) {
    return absl::DataLossError(
        absl::StrCat(file.where(), ": expected a JSON object header; got something else"));
  }
  return header;
}

// Reads the whole (small) file `file` as JSON; DATA_LOSS unless it is an object.
absl::StatusOr<nlohmann::json> ReadJsonObject(const CheckpointFile& file) {
  const uint64_t size = static_cast<uint64_t>(file.size());
  if (size > kMaxIndexBytes) {
    return absl::DataLossError(absl::StrCat(file.where(), ": expected an index of at most ",
                                            kMaxIndexBytes, " bytes; got ", size));
  }
  std::string text(size, '\0');
  RETURN_IF_ERROR(file.ReadAt(0, size, text.data()));
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) {
    return absl::DataLossError(
        absl::StrCat(file.where(), ": expected a JSON object; got something else"));
  }
  return json;
}

// A non-negative integer of a header (JSON integers may be signed or unsigned).
std::optional<uint64_t> NonNegative(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// Where tensor `name` lies in `file`: every field of its header entry checked against the file.
struct TensorLocation {
  SafetensorInfo info;
  uint64_t offset = 0;  // from the file's start
  uint64_t bytes = 0;
};

absl::StatusOr<TensorLocation> LocateTensor(const CheckpointFile& file, const std::string& name) {
  ASSIGN_OR_RETURN(const Header header, ReadHeader(file));
  const std::string where = absl::StrCat(file.where(), ": tensor \"", name, "\"");
  const auto it = header.json.find(name);
  if (name == "__metadata__" || it == header.json.end()) {
    const size_t count = header.json.size() - (header.json.contains("__metadata__") ? 1 : 0);
    return absl::NotFoundError(
        absl::StrCat(where, ": not in the checkpoint (it has ", count, " tensors)"));
  }
  const nlohmann::json& entry = *it;
  if (!entry.is_object()) {
    return absl::DataLossError(absl::StrCat(
        where, ": expected an object with dtype, shape and data_offsets; got another JSON value"));
  }
  // dtype
  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return absl::DataLossError(absl::StrCat(where, ".dtype: expected a string; got none"));
  }
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  const std::optional<torch::ScalarType> dtype = SafetensorsDtype(dtype_name);
  if (!dtype) {
    const char* other = UnreadSafetensorsDtype(dtype_name);
    const std::string got = other != nullptr ? other : "an unknown one";
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".dtype: expected F32, BF16, F16, F64, I64 or I32; got ", got));
  }
  // shape: non-negative dimensions whose product, in bytes, does not overflow.
  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return absl::DataLossError(absl::StrCat(where, ".shape: expected an array; got none"));
  }
  std::vector<int64_t> shape;
  uint64_t bytes = c10::elementSize(*dtype);
  for (const nlohmann::json& d : *shape_it) {
    const std::optional<uint64_t> dim = NonNegative(d);
    if (!dim || *dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::DataLossError(
          absl::StrCat(where, ".shape: expected non-negative integer dimensions; got another"));
    }
    if (__builtin_mul_overflow(bytes, *dim, &bytes) ||
        bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::DataLossError(
          absl::StrCat(where, ".shape: expected a size that fits in 2^63 bytes; got a larger one"));
    }
    shape.push_back(static_cast<int64_t>(*dim));
  }
  // data_offsets: [begin, end] within the data, as many bytes as the shape needs.
  const auto offsets_it = entry.find("data_offsets");
  std::optional<uint64_t> begin, end;
  if (offsets_it != entry.end() && offsets_it->is_array() && offsets_it->size() == 2) {
    begin = NonNegative((*offsets_it)[0]);
    end = NonNegative((*offsets_it)[1]);
  }
  if (!begin || !end) {
    return absl::DataLossError(absl::StrCat(
        where, ".data_offsets: expected two non-negative integers; got something else"));
  }
  const uint64_t data_bytes = static_cast<uint64_t>(file.size()) - header.data_start;
  if (*begin > *end || *end > data_bytes) {
    return absl::DataLossError(absl::StrCat(where,
                                            ".data_offsets: expected a range within the file's ",
                                            data_bytes, " bytes of data; got one outside it"));
  }
  if (*end - *begin != bytes) {
    return absl::DataLossError(absl::StrCat(
        where, ".data_offsets: expected a range as long as its dtype and shape need; got another"));
  }
  return TensorLocation{.info = {.dtype = *dtype, .shape = std::move(shape)},
                        .offset = header.data_start + *begin,
                        .bytes = bytes};
}

absl::StatusOr<torch::Tensor> ReadTensor(const CheckpointFile& file, const std::string& name) {
  ASSIGN_OR_RETURN(const TensorLocation at, LocateTensor(file, name));
  torch::Tensor t = torch::empty(at.info.shape, torch::TensorOptions().dtype(at.info.dtype));
  RETURN_IF_ERROR(file.ReadAt(at.offset, at.bytes, t.data_ptr()));
  return t;
}

// Rows [offset, offset + rows) of tensor `name` along its first dimension, reading only their
// bytes (the data is row-major).
absl::StatusOr<torch::Tensor> ReadTensorRows(const CheckpointFile& file, const std::string& name,
                                             int64_t offset, int64_t rows) {
  ASSIGN_OR_RETURN(const TensorLocation at, LocateTensor(file, name));
  std::vector<int64_t> shape = at.info.shape;
  if (shape.empty() || offset < 0 || rows < 0 || offset + rows > shape[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\": expected rows [", offset, ", ", offset + rows,
                     ") of its first dimension; it has ", shape.empty() ? 0 : shape[0], " rows"));
  }
  const int64_t row_bytes = shape[0] == 0 ? 0 : static_cast<int64_t>(at.bytes) / shape[0];
  shape[0] = rows;
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(at.info.dtype));
  RETURN_IF_ERROR(file.ReadAt(at.offset + static_cast<uint64_t>(offset * row_bytes),
                              static_cast<uint64_t>(rows * row_bytes), t.data_ptr()));
  return t;
}

// For an index.json, the shard holding `name`, opened.
absl::StatusOr<CheckpointFile> OpenShard(const CheckpointDir& dir, const std::string& relative,
                                         const std::string& name, const std::string& field) {
  ASSIGN_OR_RETURN(const CheckpointFile index_file, dir.OpenForRead(relative, field));
  ASSIGN_OR_RETURN(const nlohmann::json index, ReadJsonObject(index_file));
  const auto map = index.find("weight_map");
  if (map == index.end() || !map->is_object()) {
    return absl::DataLossError(absl::StrCat(
        index_file.where(), ": expected a JSON object with a \"weight_map\" object; got none"));
  }
  const std::string entry = absl::StrCat(index_file.where(), ": weight_map[\"", name, "\"]");
  const auto shard = map->find(name);
  if (shard == map->end()) {
    return absl::NotFoundError(absl::StrCat(index_file.where(), ": tensor \"", name,
                                            "\": not in the index's weight_map (it maps ",
                                            map->size(), " tensors)"));
  }
  if (!shard->is_string()) {
    return absl::DataLossError(absl::StrCat(entry,
                                            ": expected a shard file name; got another "
                                            "JSON value"));
  }
  // The shard's name is the file's content: checked, never echoed.
  const std::string& shard_name = shard->get_ref<const std::string&>();
  if (!CheckpointDir::CheckRelative(shard_name, "shard").ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(entry,
                     ": expected a shard file name relative to the index's directory, "
                     "without \"..\"; got one that leads elsewhere"));
  }
  const size_t slash = relative.rfind('/');
  const std::string shard_path =
      slash == std::string::npos ? shard_name : relative.substr(0, slash + 1) + shard_name;
  return dir.OpenForRead(shard_path, field,
                         absl::StrCat("the shard that \"", relative, "\" maps \"", name, "\" to"));
}

// The file that holds tensor `name`: `relative` itself, or for an index.json its shard.
absl::StatusOr<CheckpointFile> OpenTensorFile(const CheckpointDir& dir, const std::string& relative,
                                              const std::string& name, const std::string& field) {
  if (absl::EndsWith(relative, ".json")) return OpenShard(dir, relative, name, field);
  return dir.OpenForRead(relative, field);
}

// Runs `read` on the file holding `name`, turning what the JSON parser or LibTorch may throw
// into statuses whose messages quote nothing of the file.
template <typename Read>
auto ReadFromCheckpoint(const CheckpointDir& dir, const std::string& relative,
                        const std::string& name, const std::string& field, Read&& read)
    -> decltype(read(std::declval<const CheckpointFile&>())) {
  try {
    ASSIGN_OR_RETURN(const CheckpointFile file, OpenTensorFile(dir, relative, name, field));
    return read(file);
  } catch (const nlohmann::json::exception&) {  // not expected: every field's type is checked
    return absl::DataLossError(absl::StrCat(field, ": \"", relative, "\": tensor \"", name,
                                            "\": malformed safetensors header"));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ": \"", relative, "\": tensor \"", name, "\": no memory to hold it"));
  } catch (const c10::Error&) {  // the messages of LibTorch are not passed on (they could quote)
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ": \"", relative, "\": tensor \"", name, "\": cannot allocate it"));
  }
}

// OK if `existing` is a safetensors file that remotehead wrote: only such a file is replaced.
absl::Status CheckReplaceable(const CheckpointFile& existing) {
  const absl::StatusOr<Header> header = ReadHeader(existing);
  bool ours = false;
  if (header.ok()) {
    const auto metadata = header->json.find("__metadata__");
    if (metadata != header->json.end() && metadata->is_object()) {
      const auto writer = metadata->find("writer");
      ours = writer != metadata->end() && writer->is_string() &&
             writer->get_ref<const std::string&>() == kCheckpointWriter;
    }
  }
  if (ours) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      existing.where(),
      ": expected a new file or a checkpoint written by remotehead to replace; the file there is "
      "not one, so it is left as it is"));
}

}  // namespace

absl::StatusOr<SafetensorInfo> InspectSafetensor(const CheckpointDir& dir,
                                                 const std::string& relative,
                                                 const std::string& name,
                                                 const std::string& field) {
  return ReadFromCheckpoint(dir, relative, name, field,
                            [&](const CheckpointFile& file) -> absl::StatusOr<SafetensorInfo> {
                              ASSIGN_OR_RETURN(TensorLocation at, LocateTensor(file, name));
                              return std::move(at.info);
                            });
}

absl::StatusOr<torch::Tensor> ReadSafetensor(const CheckpointDir& dir, const std::string& relative,
                                             const std::string& name, const std::string& field) {
  return ReadFromCheckpoint(dir, relative, name, field,
                            [&](const CheckpointFile& file) { return ReadTensor(file, name); });
}

absl::StatusOr<torch::Tensor> ReadSafetensorRows(const CheckpointDir& dir,
                                                 const std::string& relative,
                                                 const std::string& name, int64_t offset,
                                                 int64_t rows, const std::string& field) {
  return ReadFromCheckpoint(dir, relative, name, field, [&](const CheckpointFile& file) {
    return ReadTensorRows(file, name, offset, rows);
  });
}

absl::StatusOr<int64_t> WriteSafetensors(const CheckpointDir& dir, const std::string& relative,
                                         const std::map<std::string, torch::Tensor>& tensors,
                                         const std::string& field) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const char* dtype = SafetensorsDtypeName(tensor.scalar_type());
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": dtype ",
                                                     c10::toString(tensor.scalar_type()),
                                                     " has no safetensors representation"));
    }
    if (name == "__metadata__") {
      return absl::InvalidArgumentError(
          "tensor \"__metadata__\": expected a tensor name; got the header's metadata key");
    }
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(cpu.nbytes());
    header[name] = {
        {"dtype", dtype}, {"shape", cpu.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(cpu));
  }
  header["__metadata__"] = {{"format", "pt"}, {"writer", kCheckpointWriter}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  return dir.WriteAtomically(relative, field, CheckReplaceable, [&](CheckpointFile& out) {
    const uint64_t header_size = text.size();
    RETURN_IF_ERROR(out.Write(&header_size, 8));
    RETURN_IF_ERROR(out.Write(text.data(), text.size()));
    for (const torch::Tensor& t : data) RETURN_IF_ERROR(out.Write(t.data_ptr(), t.nbytes()));
    return absl::OkStatus();
  });
}

}  // namespace remotehead::core
