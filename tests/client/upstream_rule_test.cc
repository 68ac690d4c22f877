// The upstream-gradient rule of the fused loss (UpstreamMatchesDeclared) and the refusal of a
// zero or non-finite upstream_scale at Attach, against the cases in
// tests/data/upstream_scale_cases.json, which the Python client is tested against too
// (tests/python/test_upstream_rule.py). No server: Attach refuses before any call.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "nlohmann/json.hpp"
#include "remotehead/client/client.h"
#include "remotehead/client/remote_head.h"

namespace remotehead::client {
namespace {

nlohmann::json Cases() {
  std::ifstream in(REMOTEHEAD_UPSTREAM_CASES);
  EXPECT_TRUE(in.good()) << "cannot read " << REMOTEHEAD_UPSTREAM_CASES;
  return nlohmann::json::parse(in);
}

// A number, or one of the strings "nan", "inf", "-inf" (JSON has no non-finite numbers).
double Number(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  const std::string s = v.get<std::string>();
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  ADD_FAILURE() << "not a number: " << s;
  return 0;
}

TEST(UpstreamRule, EveryCaseOfTheSharedFile) {
  const nlohmann::json cases = Cases()["cases"];
  ASSERT_GE(cases.size(), 10u);
  for (const nlohmann::json& c : cases) {
    const double declared = Number(c["declared"]), got = Number(c["got"]);
    EXPECT_EQ(UpstreamMatchesDeclared(declared, got), c["matches"].get<bool>())
        << "declared " << declared << ", got " << got << ": " << c["why"].get<std::string>();
  }
}

TEST(UpstreamRule, AttachRefusesAZeroOrNonFiniteScale) {
  // Create does not connect; Attach checks the scale before it describes the head.
  auto client = Client::Create({.target = "127.0.0.1:1"});
  ASSERT_TRUE(client.ok()) << client.status();
  const nlohmann::json refused = Cases()["declared_refused"];
  ASSERT_FALSE(refused.empty());
  for (const nlohmann::json& v : refused) {
    const double scale = Number(v);
    auto head = RemoteHead::Attach(*client, {.head_id = "lm", .upstream_scale = scale});
    ASSERT_FALSE(head.ok()) << scale;
    EXPECT_EQ(head.status().code(), absl::StatusCode::kInvalidArgument) << scale;
    EXPECT_TRUE(absl::StrContains(head.status().message(),
                                  "spec.upstream_scale: expected a "
                                  "finite non-zero value; got"))
        << head.status();
  }
}

}  // namespace
}  // namespace remotehead::client
