// The small files an operator names by a flag (TLS files, --auth_token_file,
// --group_secret_file, --state_secret_file), read so that a bad one is refused at start naming
// the flag and the path, and the bearer token's check (the gRPC credentials' and the metrics
// endpoint's).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace remotehead::server {

// The whole of a small file the operator names by a flag (`flag` without its dashes: TLS
// files, --auth_token_file, --group_secret_file). The path may go through links (the operator
// chose it), but the file must be a regular one of at most `max_bytes`, checked before it is
// opened, so that a FIFO or a device never blocks a start. NOT_FOUND for a missing file,
// INVALID_ARGUMENT for a directory, another kind of file or one too large,
// PERMISSION_DENIED / FAILED_PRECONDITION for one that cannot be read; every message names the
// flag and the path.
absl::StatusOr<std::string> ReadOperatorFile(std::string_view flag, const std::string& path,
                                             int64_t max_bytes = int64_t{1} << 20);

// A shared secret from `path` (--group_secret_file, --state_secret_file: `flag` without its
// dashes), read by ReadOperatorFile (a regular file, never blocking, of at most 4096 bytes): at
// least 16 bytes once surrounding whitespace is trimmed. The errors name the flag.
absl::StatusOr<std::string> ReadSecretFile(std::string_view flag, const std::string& path);

// The token of --auth_token_file (trailing whitespace trimmed; visible ASCII only), with the
// errors BuildServerCredentials gives for it. The metrics endpoint checks the same token.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path);

// Whether `authorization` starts with the "Bearer " scheme (case-insensitive).
bool HasBearerScheme(std::string_view authorization);
// Whether `authorization` is "Bearer <token>" (the scheme case-insensitive), compared in constant
// time. HTTP's Authorization header, e.g. on /metrics.
bool IsBearerToken(std::string_view authorization, std::string_view token);

}  // namespace remotehead::server
