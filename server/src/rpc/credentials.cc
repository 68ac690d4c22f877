#include "remotehead/server/rpc/credentials.h"

#include <grpcpp/security/server_credentials.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstdio>
#include <filesystem>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/rpc/status_mapping.h"

namespace remotehead::server {
namespace {

constexpr std::string_view kHealthPrefix = "/grpc.health.v1.Health/";
constexpr std::string_view kExpectedToken =
    "authorization: expected a bearer token (call metadata \"authorization: Bearer <token>\" "
    "matching the server's --auth_token_file)";

using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
}

// Refuses to prompt for a passphrase: encrypted keys are reported, not waited on.
int NoPassphrase(char*, int, int, void*) { return 0; }

// gRPC would accept any bytes here and fail only at the first handshake (or refuse to listen
// without saying why); checking the PEM now gives the operator a precise message at start.
absl::Status CheckKeyPair(const TlsOptions& options, const std::string& cert_pem,
                          const std::string& key_pem) {
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(MemoryBio(cert_pem).get(), nullptr, nullptr, nullptr), &X509_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(MemoryBio(key_pem).get(), nullptr, &NoPassphrase, nullptr),
      &EVP_PKEY_free);
  absl::Status status;
  if (cert == nullptr) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls_cert: expected a PEM certificate (\"-----BEGIN CERTIFICATE-----\") in ",
                     options.cert_file, "; got none that parses"));
  } else if (key == nullptr) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls_key: expected an unencrypted PEM private key in ", options.key_file,
                     "; got none that parses"));
  } else if (X509_check_private_key(cert.get(), key.get()) != 1) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls_key: expected the private key of the certificate in ",
                     options.cert_file, "; got a different key in ", options.key_file));
  }
  ERR_clear_error();  // leave OpenSSL's thread-local error queue clean for gRPC
  return status;
}

absl::Status CheckCaBundle(const TlsOptions& options, const std::string& ca_pem) {
  std::unique_ptr<X509, decltype(&X509_free)> ca(
      PEM_read_bio_X509(MemoryBio(ca_pem).get(), nullptr, nullptr, nullptr), &X509_free);
  ERR_clear_error();
  if (ca == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_client_ca: expected PEM CA certificates (\"-----BEGIN CERTIFICATE-----\") in ",
        options.client_ca_file, "; got none that parses"));
  }
  return absl::OkStatus();
}

std::string_view View(const grpc::string_ref& s) { return std::string_view(s.data(), s.size()); }

grpc::Status Unauthenticated(std::string_view got) {
  return ToGrpcStatus(absl::UnauthenticatedError(
      absl::StrCat(std::string(kExpectedToken), "; got ", std::string(got))));
}

}  // namespace

grpc::Status BearerTokenProcessor::Process(const InputMetadata& auth_metadata,
                                           grpc::AuthContext* /*context*/,
                                           OutputMetadata* consumed_auth_metadata,
                                           OutputMetadata* /*response_metadata*/) {
  // gRPC hands the processor the call's whole initial metadata, :path included (the method the
  // call is routed to), so health probes can be let through without a token.
  const auto path = auth_metadata.find(":path");
  if (path != auth_metadata.end() && View(path->second).starts_with(kHealthPrefix)) {
    return grpc::Status::OK;
  }
  const auto [first, last] = auth_metadata.equal_range("authorization");
  if (first == last) return Unauthenticated("none");
  if (std::next(first) != last) return Unauthenticated("more than one authorization entry");
  const std::string_view value = View(first->second);
  if (!HasBearerScheme(value)) {
    return Unauthenticated("a value that is not \"Bearer <token>\"");
  }
  if (!IsBearerToken(value, token_)) {
    return Unauthenticated("a different token");
  }
  // Handlers never see the token.
  consumed_auth_metadata->emplace("authorization", std::string(value));
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsOptions& options) {
  const bool has_cert = !options.cert_file.empty();
  const bool has_key = !options.key_file.empty();
  if (has_cert != has_key) {
    return absl::InvalidArgumentError(
        has_cert ? "--tls_key: expected a PEM private key file with --tls_cert; got none"
                 : "--tls_cert: expected a PEM certificate file with --tls_key; got none");
  }
  if (!has_cert) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca: expected --tls_cert and --tls_key as well (mTLS is TLS with client "
          "certificates); got no server certificate");
    }
    if (!options.token_file.empty()) {
      return absl::InvalidArgumentError(
          "--auth_token_file: expected --tls_cert and --tls_key as well (bearer tokens are not "
          "sent in plaintext; gRPC clients refuse to attach them to insecure channels); got no "
          "server certificate");
    }
    return grpc::InsecureServerCredentials();
  }

  ASSIGN_OR_RETURN(const std::string cert_pem, ReadOperatorFile("tls_cert", options.cert_file));
  ASSIGN_OR_RETURN(const std::string key_pem, ReadOperatorFile("tls_key", options.key_file));
  RETURN_IF_ERROR(CheckKeyPair(options, cert_pem, key_pem));
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({.private_key = key_pem, .cert_chain = cert_pem});
  if (!options.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadOperatorFile("tls_client_ca", options.client_ca_file));
    RETURN_IF_ERROR(CheckCaBundle(options, ssl.pem_root_certs));
    ssl.client_certificate_request =
        options.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                    : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  std::string token;
  if (!options.token_file.empty()) {
    ASSIGN_OR_RETURN(token, ReadBearerToken(options.token_file));
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::SslServerCredentials(ssl);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_cert/--tls_key: gRPC refused ",
                                                   options.cert_file, " and ", options.key_file));
  }
  if (!token.empty()) {
    credentials->SetAuthMetadataProcessor(std::make_shared<BearerTokenProcessor>(token));
  }
  return credentials;
}

std::string DescribeSecurityMode(const TlsOptions& options) {
  std::string mode;
  if (options.cert_file.empty()) {
    mode = "insecure (plaintext, no TLS)";
  } else if (options.client_ca_file.empty()) {
    mode = "TLS (server certificate only)";
  } else if (options.require_client_cert) {
    mode = "mTLS (client certificate required)";
  } else {
    mode = "mTLS (client certificate verified if presented)";
  }
  return absl::StrCat(mode, options.token_file.empty()
                                ? ", bearer-token auth off"
                                : ", bearer-token auth on (health checks exempt)");
}

}  // namespace remotehead::server
