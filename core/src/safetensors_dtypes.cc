#include "safetensors_dtypes.h"

#include <utility>

namespace remotehead::core {
namespace {

constexpr std::pair<const char*, torch::ScalarType> kDtypes[] = {
    {"F32", torch::kFloat},  {"BF16", torch::kBFloat16}, {"F16", torch::kHalf},
    {"F64", torch::kDouble}, {"I64", torch::kLong},      {"I32", torch::kInt},
};
constexpr const char* kOtherDtypes[] = {"BOOL", "U8",  "I8",      "I16",     "U16",
                                        "U32",  "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0"};

}  // namespace

std::optional<torch::ScalarType> SafetensorsDtype(std::string_view name) {
  for (const auto& [wire, t] : kDtypes) {
    if (name == wire) return t;
  }
  return std::nullopt;
}

const char* SafetensorsDtypeName(torch::ScalarType type) {
  for (const auto& [wire, t] : kDtypes) {
    if (t == type) return wire;
  }
  return nullptr;
}

const char* UnreadSafetensorsDtype(std::string_view name) {
  for (const char* other : kOtherDtypes) {
    if (name == other) return other;
  }
  return nullptr;
}

}  // namespace remotehead::core
