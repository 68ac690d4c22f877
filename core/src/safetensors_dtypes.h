// The safetensors dtype names remotehead reads and writes, with their LibTorch types: the one
// table behind checkpoint.cc (Hugging Face checkpoints) and head_state.cc (a head's saved state,
// which keeps to the floating ones). Element sizes are c10::elementSize of the type.
#pragma once

#include <optional>
#include <string_view>

#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// "F32", "BF16", "F16", "F64", "I64", "I32" → the type; nullopt for any other name.
std::optional<torch::ScalarType> SafetensorsDtype(std::string_view name);
// The type's safetensors name; nullptr for a type with none here.
const char* SafetensorsDtypeName(torch::ScalarType type);
// A safetensors dtype that remotehead does not read ("BOOL", "U8", "F8_E4M3", …), as our own
// constant, so that a message can name it without carrying the file's bytes; nullptr for a
// name safetensors does not define (or one that remotehead reads).
const char* UnreadSafetensorsDtype(std::string_view name);

}  // namespace remotehead::core
