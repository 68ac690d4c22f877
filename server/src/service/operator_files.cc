#include "remotehead/server/service/operator_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

constexpr std::string_view kBearerPrefix = "Bearer ";

// Time depends on the expected token's length only, not on where the first difference is.
bool ConstantTimeEquals(std::string_view given, std::string_view expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= static_cast<unsigned char>(g ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> ReadSecretFile(std::string_view flag, const std::string& path) {
  constexpr int64_t kMaxBytes = 4096;
  ASSIGN_OR_RETURN(const std::string bytes, ReadOperatorFile(flag, path, kMaxBytes));
  const std::string secret(absl::StripAsciiWhitespace(bytes));
  constexpr size_t kMinBytes = 16;
  if (secret.size() < kMinBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", std::string(flag), ": expected ", kMinBytes, " to ", kMaxBytes,
                     " bytes of secret in \"", path, "\"; got ", secret.size(),
                     " (make one with: head -c 32 /dev/urandom | base64 > FILE)"));
  }
  return secret;
}

absl::StatusOr<std::string> ReadOperatorFile(std::string_view flag, const std::string& path,
                                             int64_t max_bytes) {
  const std::string where = absl::StrCat("--", std::string(flag));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(where, ": no such file: ", path));
    return absl::PermissionDeniedError(
        absl::StrCat(where, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected a file; got a directory: ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected a regular file; got a FIFO, socket or device: ", path));
  }
  if (st.st_size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected at most ", max_bytes,
                                                   " bytes; got ", st.st_size, ": ", path));
  }
  // O_NONBLOCK: should the file have been replaced by a FIFO since, the open does not wait.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int error = errno;
    const std::string message =
        absl::StrCat(where, ": cannot read ", path, ": ", std::strerror(error));
    return error == EACCES ? absl::PermissionDeniedError(message)
                           : absl::FailedPreconditionError(message);
  }
  std::string contents(static_cast<size_t>(max_bytes) + 1, '\0');
  size_t filled = 0;
  ssize_t n = 0;
  while (filled < contents.size() &&
         (n = ::read(fd, contents.data() + filled, contents.size() - filled)) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    filled += static_cast<size_t>(n);
  }
  ::close(fd);
  if (n < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": cannot read ", path, ": ", "read error"));
  }
  if (filled > static_cast<size_t>(max_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected at most ", max_bytes, " bytes; got more: ", path));
  }
  contents.resize(filled);
  return contents;
}

bool IsBearerToken(std::string_view authorization, std::string_view token) {
  return HasBearerScheme(authorization) &&
         ConstantTimeEquals(authorization.substr(kBearerPrefix.size()), token);
}

// One token: trailing whitespace (the newline editors add) trimmed; visible ASCII only, so that
// it is a valid HTTP/2 header value. The token itself never appears in a message.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path) {
  ASSIGN_OR_RETURN(std::string token, ReadOperatorFile("auth_token_file", path));
  token = std::string(absl::StripTrailingAsciiWhitespace(token));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth_token_file: expected one bearer token in ", path, "; got an empty file"));
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_token_file: expected one token of visible ASCII characters in ",
                       path, "; got whitespace or a non-printable byte at offset ", i));
    }
  }
  return token;
}

bool HasBearerScheme(std::string_view value) {
  return value.size() >= kBearerPrefix.size() &&
         absl::EqualsIgnoreCase(absl::string_view(value.data(), kBearerPrefix.size()),
                                absl::string_view(kBearerPrefix.data(), kBearerPrefix.size()));
}

}  // namespace remotehead::server
