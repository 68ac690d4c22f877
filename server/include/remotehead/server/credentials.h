// Transport security and authentication of remotehead-server: insecure, TLS, mTLS, and bearer
// tokens on top of TLS. Built from the server's flags; every bad option or file is refused at
// start with a message that names the flag and the path.
#pragma once

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace remotehead::server {

struct TlsOptions {
  std::string cert_file;       // --tls_cert: PEM certificate chain of the server
  std::string key_file;        // --tls_key: PEM private key of that certificate
  std::string client_ca_file;  // --tls_client_ca: PEM CA(s) that sign client certificates (mTLS)
  bool require_client_cert = true;  // --tls_require_client_cert (only with client_ca_file)
  std::string token_file;           // --auth_token_file: one bearer token (needs TLS)
};

// Insecure without cert/key; TLS with them; mTLS with client_ca_file as well (clients must
// present a certificate signed by it when require_client_cert, else one is verified if given).
// With token_file, every call must carry `authorization: Bearer <token>`, except the
// grpc.health.v1.Health methods (probes rarely have the token; they reveal nothing). Errors:
// INVALID_ARGUMENT (inconsistent options, empty token, bad PEM), NOT_FOUND (missing file),
// PERMISSION_DENIED / FAILED_PRECONDITION (unreadable file).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsOptions& options);

// One line for the log, e.g. "mTLS (client certificate required), bearer-token auth on".
// Never contains the token.
std::string DescribeSecurityMode(const TlsOptions& options);

// The whole of a small file the operator names by a flag (`flag` without its dashes: TLS
// files, --auth_token_file, --group_secret_file). The path may go through links (the operator
// chose it), but the file must be a regular one of at most `max_bytes`, checked before it is
// opened, so that a FIFO or a device never blocks a start. NOT_FOUND for a missing file,
// INVALID_ARGUMENT for a directory, another kind of file or one too large,
// PERMISSION_DENIED / FAILED_PRECONDITION for one that cannot be read; every message names the
// flag and the path.
absl::StatusOr<std::string> ReadOperatorFile(std::string_view flag, const std::string& path,
                                             int64_t max_bytes = int64_t{1} << 20);

// The group's secret from `path` (--group_secret_file, read by ReadOperatorFile: a regular
// file, never blocking, of at most 4096 bytes), at least 16 bytes once surrounding whitespace is
// trimmed. The errors name the flag.
absl::StatusOr<std::string> ReadGroupSecret(const std::string& path);

// The token of --auth_token_file (trailing whitespace trimmed; visible ASCII only), with the
// errors BuildServerCredentials gives for it. The metrics endpoint checks the same token.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path);

// Whether `authorization` is "Bearer <token>" (the scheme case-insensitive), compared in constant
// time. HTTP's Authorization header, e.g. on /metrics.
bool IsBearerToken(std::string_view authorization, std::string_view token);

// The bearer-token check, exposed for tests. Accepts `authorization: Bearer <token>` (the
// scheme case-insensitive), compares in constant time, consumes the header so handlers never
// see it, and answers UNAUTHENTICATED otherwise. Calls to /grpc.health.v1.Health/ pass.
class BearerTokenProcessor : public grpc::AuthMetadataProcessor {
 public:
  explicit BearerTokenProcessor(std::string token) : token_(std::move(token)) {}
  bool IsBlocking() const override { return false; }  // a cheap comparison, no I/O
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::string token_;
};

}  // namespace remotehead::server
