// The bytes of a head group's command log (group_log.h): the keys, the entries' kinds and
// layouts, and their seals — what the log writes and reads, kept apart from how it waits.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace remotehead::server::log_format {

using Clock = std::chrono::steady_clock;

inline constexpr size_t kSealBytes = 32;   // HMAC-SHA256
inline constexpr size_t kNonceBytes = 16;  // per rank and run
// A command's body: its seq, then the command. A reply's: the command's seq, the replying rank,
// the command's seal, then the encoded reply. A declaration's: the declaring rank, the reason.
inline constexpr size_t kSeqBytes = 8;
inline constexpr size_t kReplyHeadBytes = 2 * kSeqBytes + kSealBytes;
inline constexpr std::chrono::milliseconds kRefusedPoll{20};
// How often a rank waiting on the log checks its own pending entry (tampering is found within
// about this), and how long it waits for a key it has just seen (gone meanwhile: deleted).
inline constexpr std::chrono::milliseconds kWatchPoll{100};
inline constexpr std::chrono::milliseconds kJustSeen{50};

// What an entry is, bound into its seal: an entry of one kind never verifies as another.
enum class Kind : char { kHello = 'H', kCommand = 'C', kReply = 'R', kDown = 'D', kTampered = 'T' };

// `value` as 8 little-endian bytes, and back.
std::string Fixed64(int64_t value);
int64_t ReadFixed64(std::string_view bytes);
std::string Sha256(const std::string& data);

// `body` followed by its seal: the HMAC of its kind, the session and the body.
std::string Seal(const std::string& secret, Kind kind, const std::string& session,
                 const std::string& body);
// The body of a sealed `value` of `kind`; PERMISSION_DENIED (refuse it) if the seal does not
// verify.
absl::StatusOr<std::string> Unseal(const std::string& secret, Kind kind, const std::string& session,
                                   const std::string& value);
// How long is left until `deadline`, at least 1 ms (a store wait of 0 would not wait at all).
std::chrono::milliseconds Remaining(Clock::time_point deadline);

}  // namespace remotehead::server::log_format
