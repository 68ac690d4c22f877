// Transport security and authentication of remotehead-server's gRPC: insecure, TLS, mTLS, and
// bearer tokens on top of TLS. Built from the server's flags; every bad option or file is
// refused at start with a message that names the flag and the path (the files are read by
// operator_files.h).
#pragma once

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "remotehead/server/service/operator_files.h"

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
