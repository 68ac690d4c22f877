// The project's one keyed MAC, HMAC-SHA256 (OpenSSL's libcrypto): it seals a head group's log
// entries under the group's secret (server/group/group_log.h) and the durable head states under
// the state secret (head_state.h), so both are checked by the same code.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>

namespace remotehead::core {

inline constexpr size_t kMacBytes = 32;  // HMAC-SHA256

// HMAC-SHA256 under `key` (any length, empty included) of the concatenation of `parts`, fed one
// after the other so that large data (a head's weights) is never copied into one string; the
// kMacBytes raw bytes.
std::string HmacSha256(std::string_view key, std::initializer_list<std::string_view> parts);

// Whether `a` and `b` are equal, in a time that depends on their lengths only (never on where
// they first differ): how a MAC is checked.
bool MacEquals(std::string_view a, std::string_view b);

}  // namespace remotehead::core
