#include "remotehead/core/head_state.h"

#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "remotehead/core/mac.h"
#include "remotehead/core/status_macros.h"
#include "safetensors_dtypes.h"

namespace remotehead::core {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this codec copies it as it is");

constexpr char kFormat[] = "remotehead-head-state";
constexpr char kFormatVersion[] = "1";
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// The head state keeps to the floating safetensors dtypes: F32, BF16, F16, F64.
std::optional<torch::ScalarType> StateDtype(std::string_view name) {
  const std::optional<torch::ScalarType> t = SafetensorsDtype(name);
  if (!t || !c10::isFloatingType(*t)) return std::nullopt;
  return t;
}

// The state's tensors under their names in the file (undefined ones are left out).
std::vector<std::pair<std::string, torch::Tensor>> NamedTensors(const HeadState& s) {
  std::vector<std::pair<std::string, torch::Tensor>> named = {
      {"weight", s.weight},
      {"bias", s.bias},
      {"optimizer.weight_buf1", s.optimizer.weight_buf1},
      {"optimizer.weight_buf2", s.optimizer.weight_buf2},
      {"optimizer.bias_buf1", s.optimizer.bias_buf1},
      {"optimizer.bias_buf2", s.optimizer.bias_buf2}};
  std::erase_if(named, [](const auto& p) { return !p.second.defined(); });
  return named;
}

torch::Tensor* Slot(HeadState& s, const std::string& name) {
  if (name == "weight") return &s.weight;
  if (name == "bias") return &s.bias;
  if (name == "optimizer.weight_buf1") return &s.optimizer.weight_buf1;
  if (name == "optimizer.weight_buf2") return &s.optimizer.weight_buf2;
  if (name == "optimizer.bias_buf1") return &s.optimizer.bias_buf1;
  if (name == "optimizer.bias_buf2") return &s.optimizer.bias_buf2;
  return nullptr;
}

// FNV-1a over 64-bit little-endian words (then the tail bytes): cheap, and any truncation,
// bit flip or swapped block of the data section changes it.
uint64_t Checksum(const char* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, data + i, 8);
    h = (h ^ word) * 0x100000001b3ULL;
  }
  for (; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  return h;
}

// Of the header (without the checksum; nlohmann dumps objects in key order, so the text is
// canonical) and the data: any change to either is detected.
std::string FileChecksum(const nlohmann::json& header, const char* data, size_t n) {
  const std::string text = header.dump();
  return absl::StrFormat("%016x-%016x", Checksum(text.data(), text.size()), Checksum(data, n));
}

// The seal (hex): an HMAC under `secret` of what the checksum covers — the canonical header
// without checksum and seal, then the data — after a tag of its own (no other HMAC of the project
// begins with it: a group log entry's begins with one kind byte) and the header's length (where
// the header ends is sealed too).
std::string Seal(const std::string& secret, const nlohmann::json& header, const char* data,
                 size_t n) {
  constexpr std::string_view kTag = "remotehead-head-state-seal\n";
  const std::string text = header.dump();
  char length[8];
  const uint64_t size = text.size();
  std::memcpy(length, &size, 8);  // little-endian (asserted above)
  return absl::BytesToHexString(
      HmacSha256(secret, {kTag, std::string_view(length, 8), text, std::string_view(data, n)}));
}

absl::Status Corrupt(const std::string& source, const std::string& what) {
  return absl::DataLossError(
      absl::StrCat(source, ": expected a complete remotehead head state; got ", what,
                   " — the file is truncated, corrupted or not a head state, and was not loaded"));
}

absl::StatusOr<int64_t> MetadataInt(const nlohmann::json& metadata, const std::string& key,
                                    const std::string& source) {
  int64_t value = 0;
  if (!metadata.contains(key) || !metadata[key].is_string() ||
      !absl::SimpleAtoi(metadata[key].get<std::string>(), &value)) {
    return Corrupt(source, absl::StrCat("no integer metadata \"", key, "\""));
  }
  return value;
}

absl::StatusOr<std::string> MetadataString(const nlohmann::json& metadata, const std::string& key,
                                           const std::string& source) {
  if (!metadata.contains(key) || !metadata[key].is_string()) {
    return Corrupt(source, absl::StrCat("no metadata \"", key, "\""));
  }
  return metadata[key].get<std::string>();
}

// One tensor entry of the header, checked against the data section's size.
absl::StatusOr<torch::Tensor> DecodeTensor(const nlohmann::json& entry, const char* data,
                                           uint64_t data_size, const std::string& source) {
  if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
      !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
      !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
    return Corrupt(source, "a malformed tensor entry");
  }
  const std::optional<torch::ScalarType> dtype = StateDtype(entry["dtype"].get<std::string>());
  if (!dtype) return Corrupt(source, "a tensor of an unsupported dtype");
  std::vector<int64_t> shape;
  uint64_t bytes = c10::elementSize(*dtype);
  for (const auto& d : entry["shape"]) {
    if (!d.is_number_unsigned() || shape.size() >= 2) {
      return Corrupt(source, "a tensor shape that is not 1 or 2 sizes >= 0");
    }
    const uint64_t size = d.get<uint64_t>();
    if (size > (uint64_t{1} << 40) || __builtin_mul_overflow(bytes, size, &bytes)) {
      return Corrupt(source, "a tensor shape whose byte count overflows");
    }
    shape.push_back(static_cast<int64_t>(size));
  }
  const auto& offsets = entry["data_offsets"];
  if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
    return Corrupt(source, "tensor data offsets that are not integers");
  }
  const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  if (end < begin || end > data_size || end - begin != bytes) {
    return Corrupt(source, absl::StrCat("tensor data offsets outside the ", data_size,
                                        "-byte data section or not matching its shape"));
  }
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(*dtype));
  if (bytes > 0) std::memcpy(t.data_ptr(), data + begin, bytes);
  return t;
}

// An intact state (its checksum matched) that does not verify under `secret`.
absl::Status NotSealed(const std::string& source, const StateSecret& secret,
                       const std::string& what) {
  return absl::PermissionDeniedError(
      absl::StrCat(source, ": expected a head state sealed under the state secret (", secret.origin,
                   "); got ", what, " — it was not loaded"));
}

// OK without a secret; else OK only if `metadata`'s seal is that of `unsealed_header` (the header
// without checksum and seal) and the data under `secret`.
absl::Status CheckSeal(const nlohmann::json& metadata, const nlohmann::json& unsealed_header,
                       const char* data, size_t n, const StateSecret& secret,
                       const std::string& source) {
  if (secret.secret.empty()) return absl::OkStatus();
  if (!metadata.contains("mac")) {
    return NotSealed(source, secret,
                     "one with no seal (saved by a server without a state secret, or forged)");
  }
  const std::string expected = Seal(secret.secret, unsealed_header, data, n);
  if (!metadata["mac"].is_string() || !MacEquals(metadata["mac"].get<std::string>(), expected)) {
    return NotSealed(source, secret,
                     "one whose seal does not verify under it: forged, or sealed with another "
                     "secret");
  }
  return absl::OkStatus();
}

absl::StatusOr<HeadState> DecodeChecked(const std::string& bytes, const std::string& source,
                                        const StateSecret& secret) {
  if (bytes.size() < 8) {
    return Corrupt(source, absl::StrCat(bytes.size(), " bytes, fewer than the header size's 8"));
  }
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  if (header_size > kMaxHeaderBytes || header_size > bytes.size() - 8) {
    return Corrupt(source, absl::StrCat("a header size of ", header_size, " in a file of ",
                                        bytes.size(), " bytes"));
  }
  const nlohmann::json header = nlohmann::json::parse(
      bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_size), nullptr,
      /*allow_exceptions=*/false);
  if (!header.is_object() || !header.contains("__metadata__") ||
      !header["__metadata__"].is_object()) {
    return Corrupt(source, "no JSON header with metadata");
  }
  const nlohmann::json& metadata = header["__metadata__"];
  ASSIGN_OR_RETURN(const std::string format, MetadataString(metadata, "format", source));
  ASSIGN_OR_RETURN(const std::string version, MetadataString(metadata, "format_version", source));
  if (format != kFormat || version != kFormatVersion) {
    return Corrupt(source, absl::StrCat("another format (expected ", kFormat, " version ",
                                        kFormatVersion, ")"));
  }
  const char* data = bytes.data() + 8 + header_size;
  const uint64_t data_size = bytes.size() - 8 - header_size;
  ASSIGN_OR_RETURN(const std::string checksum, MetadataString(metadata, "checksum", source));
  nlohmann::json unsigned_header = header;
  unsigned_header["__metadata__"].erase("checksum");
  if (checksum != FileChecksum(unsigned_header, data, data_size)) {
    return Corrupt(source, "contents whose checksum does not match the one recorded");
  }
  // Intact; and, with a secret, made by a holder of it.
  unsigned_header["__metadata__"].erase("mac");
  RETURN_IF_ERROR(CheckSeal(metadata, unsigned_header, data, data_size, secret, source));

  HeadState state;
  ASSIGN_OR_RETURN(state.head_id, MetadataString(metadata, "head_id", source));
  ASSIGN_OR_RETURN(state.state_id, MetadataString(metadata, "state_id", source));
  ASSIGN_OR_RETURN(state.weight_version, MetadataInt(metadata, "weight_version", source));
  for (auto [key, slot] : {std::pair{"vocab_offset", &state.vocab_offset},
                           std::pair{"vocab_size", &state.vocab_size}}) {
    if (metadata.contains(key)) {  // absent in the states of one server
      ASSIGN_OR_RETURN(*slot, MetadataInt(metadata, key, source));
    }
  }
  if (metadata.contains("frozen")) {  // absent in states saved before frozen heads existed
    ASSIGN_OR_RETURN(const int64_t frozen, MetadataInt(metadata, "frozen", source));
    state.frozen = frozen != 0;
  }
  if (metadata.contains("grad_dtype")) {  // absent: the default accumulators
    ASSIGN_OR_RETURN(const std::string name, MetadataString(metadata, "grad_dtype", source));
    const absl::StatusOr<torch::ScalarType> grad_dtype = ParseHeadDtype(name);
    if (!grad_dtype.ok()) return Corrupt(source, "a gradient dtype that is not a head's");
    state.grad_dtype = *grad_dtype;
  }
  ASSIGN_OR_RETURN(state.optimizer.kind, MetadataString(metadata, "optimizer.kind", source));
  ASSIGN_OR_RETURN(state.optimizer.steps, MetadataInt(metadata, "optimizer.steps", source));
  ASSIGN_OR_RETURN(const std::string hyper,
                   MetadataString(metadata, "optimizer.hyper_parameters", source));
  const nlohmann::json hyper_json = nlohmann::json::parse(hyper, nullptr, false);
  if (!hyper_json.is_object())
    return Corrupt(source, "optimizer hyper-parameters that are not JSON");
  for (const auto& [name, value] : hyper_json.items()) {
    if (!value.is_number()) return Corrupt(source, "a hyper-parameter that is not a number");
    state.optimizer.hyper_parameters[name] = value.get<double>();
  }
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    torch::Tensor* slot = Slot(state, name);
    if (slot == nullptr) return Corrupt(source, "a tensor this format does not have");
    ASSIGN_OR_RETURN(*slot, DecodeTensor(entry, data, data_size, source));
  }
  // The shapes must fit together: W [V, D], b [V], the moments like their parameters.
  if (!state.weight.defined() || state.weight.dim() != 2 || state.weight.size(0) < 1 ||
      state.weight.size(1) < 1) {
    return Corrupt(source, "no weight matrix");
  }
  if (state.vocab_offset < 0 || state.vocab_size < 0 ||
      (state.vocab_size > 0 && state.vocab_offset + state.weight.size(0) > state.vocab_size) ||
      (state.vocab_size == 0 && state.vocab_offset != 0)) {
    return Corrupt(source, "rows outside the head they are a shard of");
  }
  const bool bias_ok = !state.bias.defined() ||
                       (state.bias.dim() == 1 && state.bias.size(0) == state.weight.size(0));
  auto like = [](const torch::Tensor& buf, const torch::Tensor& param) {
    return !buf.defined() || (param.defined() && buf.sizes() == param.sizes());
  };
  if (!bias_ok || !like(state.optimizer.weight_buf1, state.weight) ||
      !like(state.optimizer.weight_buf2, state.weight) ||
      !like(state.optimizer.bias_buf1, state.bias) ||
      !like(state.optimizer.bias_buf2, state.bias)) {
    return Corrupt(source, "tensors whose shapes do not fit together");
  }
  if (state.optimizer.kind != "" && state.optimizer.kind != "sgd" &&
      state.optimizer.kind != "adamw") {
    return Corrupt(source, "an unknown optimizer kind");
  }
  return state;
}

}  // namespace

HeadState CaptureHeadState(const std::string& head_id, const std::string& state_id,
                           const Head& head, const OptimizerState& optimizer) {
  auto cpu = [](const torch::Tensor& t) {
    return t.defined() ? t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true) : t;
  };
  HeadState s{.head_id = head_id,
              .state_id = state_id,
              .weight_version = head.version(),
              .weight = cpu(head.weight()),
              .bias = cpu(head.bias()),
              .optimizer = optimizer};
  // Kept only when it is not the default, so that a state of default accumulators reads the
  // same as before grad_dtype was kept.
  const torch::ScalarType grad_dtype = head.grads().weight.scalar_type();
  if (grad_dtype != AccumulationDtype(head.dtype())) s.grad_dtype = grad_dtype;
  s.optimizer.weight_buf1 = cpu(optimizer.weight_buf1);
  s.optimizer.weight_buf2 = cpu(optimizer.weight_buf2);
  s.optimizer.bias_buf1 = cpu(optimizer.bias_buf1);
  s.optimizer.bias_buf2 = cpu(optimizer.bias_buf2);
  return s;
}

absl::StatusOr<std::string> EncodeHeadState(const HeadState& state, const StateSecret& secret) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : NamedTensors(state)) {
    const char* dtype = c10::isFloatingType(tensor.scalar_type())
                            ? SafetensorsDtypeName(tensor.scalar_type())
                            : nullptr;
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected float32, bfloat16, float16 or float64; got ",
                       c10::toString(tensor.scalar_type())));
    }
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = cpu.nbytes();
    header[name] = {
        {"dtype", dtype}, {"shape", cpu.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(cpu));
  }
  std::string body;
  body.reserve(offset);
  for (const torch::Tensor& t : data) {
    body.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  nlohmann::json hyper = nlohmann::json::object();
  for (const auto& [name, value] : state.optimizer.hyper_parameters) hyper[name] = value;
  header["__metadata__"] = {{"format", kFormat},
                            {"format_version", kFormatVersion},
                            {"head_id", state.head_id},
                            {"state_id", state.state_id},
                            {"weight_version", absl::StrCat(state.weight_version)},
                            {"vocab_offset", absl::StrCat(state.vocab_offset)},
                            {"vocab_size", absl::StrCat(state.vocab_size)},
                            {"frozen", state.frozen ? "1" : "0"},
                            {"optimizer.kind", state.optimizer.kind},
                            {"optimizer.steps", absl::StrCat(state.optimizer.steps)},
                            {"optimizer.hyper_parameters", hyper.dump()}};
  if (state.grad_dtype.has_value()) {
    header["__metadata__"]["grad_dtype"] = DtypeName(*state.grad_dtype);
  }
  if (!secret.secret.empty()) {
    header["__metadata__"]["mac"] = Seal(secret.secret, header, body.data(), body.size());
  }
  // Over the seal too: a damaged seal is a damaged file (DATA_LOSS), not a forged one.
  header["__metadata__"]["checksum"] = FileChecksum(header, body.data(), body.size());
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  const uint64_t header_size = text.size();
  std::string out;
  out.reserve(8 + text.size() + body.size());
  out.append(reinterpret_cast<const char*>(&header_size), 8);
  out.append(text);
  out.append(body);
  return out;
}

absl::StatusOr<HeadState> DecodeHeadState(const std::string& bytes, const std::string& source,
                                          const StateSecret& secret) {
  try {
    return DecodeChecked(bytes, source, secret);
  } catch (const nlohmann::json::exception&) {  // a field of an unexpected JSON type
    return Corrupt(source, "a malformed JSON header");
  }
}

absl::Status CheckHeadStateRows(const HeadState& state, int64_t vocab_size, int64_t offset) {
  const int64_t rows = state.weight.size(0);
  const int64_t saved_size = state.vocab_size > 0 ? state.vocab_size : rows;
  if (saved_size != vocab_size || state.vocab_offset != offset) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state_id: expected rows [", offset, ", ", offset + rows, ") of head \"", state.head_id,
        "\" of ", vocab_size, " rows (this rank's shard); got the state of rows [",
        state.vocab_offset, ", ", state.vocab_offset + rows, ") of a head of ", saved_size,
        " rows (saved by another layout of the head group)"));
  }
  return absl::OkStatus();
}

absl::Status CheckHeadStateFits(const HeadState& state, const Head& head) {
  if (state.weight.sizes() != head.weight().sizes() || state.weight.scalar_type() != head.dtype() ||
      state.bias.defined() != head.has_bias()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state_id: expected a state of head \"", state.head_id, "\"'s shape ",
        c10::str(head.weight().sizes()), " ", DtypeName(head.dtype()),
        head.has_bias() ? " with bias" : " without bias", "; got ", c10::str(state.weight.sizes()),
        " ", DtypeName(state.weight.scalar_type()), state.bias.defined() ? " with bias" : ""));
  }
  return absl::OkStatus();
}

absl::Status ApplyHeadState(const HeadState& state, Head* head, OptimizerState* optimizer) {
  torch::NoGradGuard no_grad;
  RETURN_IF_ERROR(CheckHeadStateFits(state, *head));
  head->mutable_weight().copy_(state.weight);
  if (head->has_bias()) head->mutable_bias().copy_(state.bias);
  head->RestoreVersion(state.weight_version);
  *optimizer = state.optimizer;
  for (torch::Tensor* buf : {&optimizer->weight_buf1, &optimizer->weight_buf2,
                             &optimizer->bias_buf1, &optimizer->bias_buf2}) {
    if (buf->defined()) *buf = buf->to(head->device());
  }
  return absl::OkStatus();
}

}  // namespace remotehead::core
