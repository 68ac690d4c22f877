#include "remotehead/core/mac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cstdlib>
#include <iostream>
#include <memory>

namespace remotehead::core {
namespace {

// Fetched once (a provider lookup) and shared: an EVP_MAC is immutable and thread-safe.
EVP_MAC* Hmac() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  return mac;
}

// OpenSSL failing to compute an HMAC is a broken installation, not a condition to recover from:
// an unsealed state or log entry must never pass for a sealed one.
[[noreturn]] void Fail(const char* what) {
  std::cerr << "remotehead: OpenSSL HMAC-SHA256 failed (" << what << ")" << std::endl;
  std::abort();
}

}  // namespace

std::string HmacSha256(std::string_view key, std::initializer_list<std::string_view> parts) {
  if (Hmac() == nullptr) Fail("EVP_MAC_fetch");
  std::unique_ptr<EVP_MAC_CTX, decltype(&EVP_MAC_CTX_free)> ctx(EVP_MAC_CTX_new(Hmac()),
                                                                &EVP_MAC_CTX_free);
  if (ctx == nullptr) Fail("EVP_MAC_CTX_new");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  // An empty key is a valid HMAC key; a null one would mean "the key set before" to OpenSSL.
  static const unsigned char kEmpty = 0;
  const unsigned char* k =
      key.empty() ? &kEmpty : reinterpret_cast<const unsigned char*>(key.data());
  if (EVP_MAC_init(ctx.get(), k, key.size(), params) != 1) Fail("EVP_MAC_init");
  for (const std::string_view part : parts) {
    if (!part.empty() &&
        EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(part.data()),
                       part.size()) != 1) {
      Fail("EVP_MAC_update");
    }
  }
  std::string out(kMacBytes, '\0');
  size_t length = 0;
  if (EVP_MAC_final(ctx.get(), reinterpret_cast<unsigned char*>(out.data()), &length, out.size()) !=
          1 ||
      length != kMacBytes) {
    Fail("EVP_MAC_final");
  }
  return out;
}

bool MacEquals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace remotehead::core
