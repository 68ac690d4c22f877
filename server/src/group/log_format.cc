#include "group/log_format.h"

#include <openssl/sha.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/mac.h"
#include "remotehead/server/group/group_log.h"

namespace remotehead::server {
namespace log_format {

std::string Fixed64(int64_t value) {
  std::string out(kSeqBytes, '\0');
  for (size_t i = 0; i < kSeqBytes; ++i) {
    out[i] = static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff);
  }
  return out;
}

int64_t ReadFixed64(std::string_view bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return static_cast<int64_t>(value);
}

std::string Sha256(const std::string& data) {
  unsigned char out[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), out);
  return std::string(reinterpret_cast<const char*>(out), sizeof(out));
}

std::string Seal(const std::string& secret, Kind kind, const std::string& session,
                 const std::string& body) {
  return body + core::HmacSha256(secret, {std::string(1, static_cast<char>(kind)), session, body});
}

std::chrono::milliseconds Remaining(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

absl::StatusOr<std::string> Unseal(const std::string& secret, Kind kind, const std::string& session,
                                   const std::string& value) {
  if (value.size() < kSealBytes) {
    return absl::PermissionDeniedError(
        absl::StrCat("an entry of ", value.size(), " bytes, shorter than a seal (garbage)"));
  }
  std::string body = value.substr(0, value.size() - kSealBytes);
  const std::string expected =
      core::HmacSha256(secret, {std::string(1, static_cast<char>(kind)), session, body});
  if (!core::MacEquals(expected, std::string_view(value).substr(body.size()))) {
    return absl::PermissionDeniedError(
        "its seal does not verify under the group's secret and session (forged, garbage, or "
        "recorded from another run of the group)");
  }
  return body;
}

}  // namespace log_format

using log_format::Kind;

std::string CommandLogPrefix(const GroupConfig& config) {
  return store_keys::CommandLog(config.prefix);
}

std::string CommandLogStoreKey(const GroupConfig& config, const std::string& key) {
  return store_keys::Named(CommandLogPrefix(config), key);
}

std::string SealEntry(const std::string& secret, char kind, const std::string& session,
                      const std::string& body) {
  return Seal(secret, static_cast<Kind>(kind), session, body);
}

absl::StatusOr<std::string> UnsealEntry(const std::string& secret, char kind,
                                        const std::string& session, const std::string& value) {
  return Unseal(secret, static_cast<Kind>(kind), session, value);
}

// "<code>:<message length>:<message><reason length>:<reason><payload>": the status whole, its
// reason (core/error_reason.h) included, so that the front answers with the rank's reason.
std::string EncodeReply(const GroupReply& reply) {
  const std::string message(reply.status.message());
  const std::string reason = core::SerializeReason(reply.status);
  return absl::StrCat(static_cast<int>(reply.status.code()), ":", message.size(), ":", message,
                      reason.size(), ":", reason, reply.payload);
}

absl::StatusOr<GroupReply> DecodeReply(const std::string& bytes) {
  const absl::Status bad = absl::DataLossError(
      absl::StrCat("head group: a reply that is not code:length:message length:reason (",
                   bytes.size(), " bytes)"));
  // "<number>:" at `at`: the number, and `at` moved past the colon.
  auto number = [&bytes](size_t& at, size_t& value) {
    const size_t colon = bytes.find(':', at);
    if (colon == std::string::npos || !absl::SimpleAtoi(bytes.substr(at, colon - at), &value)) {
      return false;
    }
    at = colon + 1;
    return true;
  };
  size_t at = 0, code = 0, message_length = 0, reason_length = 0;
  if (!number(at, code) || code > static_cast<size_t>(absl::StatusCode::kUnauthenticated) ||
      !number(at, message_length) || message_length > bytes.size() - at) {
    return bad;
  }
  const std::string message = bytes.substr(at, message_length);
  at += message_length;
  if (!number(at, reason_length) || reason_length > bytes.size() - at) return bad;
  GroupReply reply;
  reply.status = core::WithSerializedReason(
      absl::Status(static_cast<absl::StatusCode>(code), message), bytes.substr(at, reason_length));
  reply.payload = bytes.substr(at + reason_length);
  return reply;
}

}  // namespace remotehead::server
