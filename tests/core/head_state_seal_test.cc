// A head state sealed under a state secret (core/head_state.h, core/mac.h): it verifies under
// that secret only. Under a secret, a state whose checksum is right but that whoever can write
// the state directory made — weights changed and the checksum recomputed, sealed under another
// secret, saved unsealed — is PERMISSION_DENIED naming the file; damage stays DATA_LOSS. With
// no secret, states load on their checksum alone, sealed or not.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "remotehead/core/head.h"
#include "remotehead/core/head_state.h"
#include "remotehead/core/mac.h"

namespace remotehead::core {
namespace {

const StateSecret kSecret{.secret = "0123456789abcdef-state-secret",
                          .origin = "--state_secret_file"};
const StateSecret kOther{.secret = "another secret, 16+ bytes long",
                         .origin = "--state_secret_file"};
const StateSecret kNone{};
const std::string kSource = "--state_dir file \"lm/s1.safetensors\"";

HeadState NewState() {
  auto head = Head::Initialize({.vocab_size = 12, .hidden_size = 4, .bias = true, .seed = 7}, {});
  EXPECT_TRUE(head.ok()) << head.status();
  return CaptureHeadState("lm", "s1", **head, {});
}

std::string Encode(const HeadState& state, const StateSecret& secret) {
  auto bytes = EncodeHeadState(state, secret);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return *bytes;
}

// The checksum of core/head_state.cc, as whoever can write the file recomputes it (it is no
// secret): FNV-1a over 64-bit little-endian words, then the tail bytes.
uint64_t Fnv(const std::string& data) {
  uint64_t h = 0xcbf29ce484222325ULL;
  size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, data.data() + i, 8);
    h = (h ^ word) * 0x100000001b3ULL;
  }
  for (; i < data.size(); ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  return h;
}

// `file` with the first weight's bytes changed and the checksum recomputed, its seal (if any)
// kept: an intact file, forged.
std::string Forge(const std::string& file) {
  uint64_t header_size = 0;
  std::memcpy(&header_size, file.data(), 8);
  nlohmann::json header = nlohmann::json::parse(file.substr(8, header_size));
  std::string data = file.substr(8 + header_size);
  data[header["weight"]["data_offsets"][0].get<size_t>()] ^= 0x01;
  header["__metadata__"].erase("checksum");
  const std::string checksum = absl::StrFormat("%016x-%016x", Fnv(header.dump()), Fnv(data));
  header["__metadata__"]["checksum"] = checksum;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t size = text.size();
  std::string out(reinterpret_cast<const char*>(&size), 8);
  return out + text + data;
}

void ExpectRefused(const std::string& file, const StateSecret& secret, const std::string& got) {
  const auto decoded = DecodeHeadState(file, kSource, secret);
  ASSERT_FALSE(decoded.ok()) << "a state that does not verify was loaded";
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kPermissionDenied) << decoded.status();
  EXPECT_EQ(decoded.status().message(),
            kSource + ": expected a head state sealed under the state secret (" + secret.origin +
                "); got " + got + " — it was not loaded");
}

TEST(Mac, IsHmacSha256OfItsPartsInTurn) {
  // RFC 4231, test cases 1 and 2; and the empty key (a group on loopback seals its log so).
  EXPECT_EQ(absl::BytesToHexString(HmacSha256(std::string(20, '\x0b'), {"Hi There"})),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(absl::BytesToHexString(HmacSha256("Jefe", {"what do ya ", "", "want for nothing?"})),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(absl::BytesToHexString(HmacSha256("", {})),
            "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
  EXPECT_TRUE(MacEquals("abc", "abc"));
  EXPECT_FALSE(MacEquals("abc", "abd"));
  EXPECT_FALSE(MacEquals("abc", "abcd"));
  EXPECT_FALSE(MacEquals("", "a"));
}

TEST(HeadStateSeal, ASealedStateVerifiesUnderItsSecret) {
  const HeadState state = NewState();
  const std::string file = Encode(state, kSecret);
  auto decoded = DecodeHeadState(file, kSource, kSecret);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(torch::equal(decoded->weight, state.weight));
  EXPECT_TRUE(torch::equal(decoded->bias, state.bias));
  // The seal is metadata of the safetensors file: 64 hex digits.
  uint64_t header_size = 0;
  std::memcpy(&header_size, file.data(), 8);
  const auto header = nlohmann::json::parse(file.substr(8, header_size));
  EXPECT_EQ(header["__metadata__"]["mac"].get<std::string>().size(), 2 * kMacBytes);
}

TEST(HeadStateSeal, AForgedStateIsRefusedNamingTheFile) {
  const std::string forged = Forge(Encode(NewState(), kSecret));
  // Intact as far as the checksum goes: a server without a secret loads it.
  auto loaded = DecodeHeadState(forged, kSource, kNone);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectRefused(forged, kSecret,
                "one whose seal does not verify under it: forged, or sealed with another secret");
}

TEST(HeadStateSeal, AStateSealedUnderAnotherSecretIsRefused) {
  ExpectRefused(Encode(NewState(), kOther), kSecret,
                "one whose seal does not verify under it: forged, or sealed with another secret");
  ExpectRefused(Encode(NewState(), kSecret), kOther,
                "one whose seal does not verify under it: forged, or sealed with another secret");
}

TEST(HeadStateSeal, AnUnsealedStateIsRefusedUnderASecret) {
  const std::string unsealed = Encode(NewState(), kNone);
  ExpectRefused(unsealed, kSecret,
                "one with no seal (saved by a server without a state secret, or forged)");
  ExpectRefused(Forge(unsealed), kSecret,
                "one with no seal (saved by a server without a state secret, or forged)");
}

TEST(HeadStateSeal, WithoutASecretStatesLoadOnTheirChecksum) {
  const HeadState state = NewState();
  for (const StateSecret& saved_with : {kNone, kSecret, kOther}) {
    auto decoded = DecodeHeadState(Encode(state, saved_with), kSource, kNone);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_TRUE(torch::equal(decoded->weight, state.weight));
  }
}

TEST(HeadStateSeal, DamageIsStillDataLossUnderASecret) {
  const std::string file = Encode(NewState(), kSecret);
  uint64_t header_size = 0;
  std::memcpy(&header_size, file.data(), 8);
  const size_t mac_at = file.find("\"mac\":\"") + 7;
  ASSERT_LT(mac_at, 8 + header_size);
  // A bit flipped in the seal, in the header, in the data; a truncation.
  for (size_t at : {mac_at, size_t{20}, 8 + header_size + 3, file.size() - 1}) {
    std::string damaged = file;
    damaged[at] ^= 0x01;
    const auto decoded = DecodeHeadState(damaged, kSource, kSecret);
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << at << decoded.status();
  }
  const auto truncated = DecodeHeadState(file.substr(0, file.size() - 4), kSource, kSecret);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss) << truncated.status();
}

}  // namespace
}  // namespace remotehead::core
