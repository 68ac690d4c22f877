// The connections' HTTP/2 settings (wire/http2_settings.h): their ranges, the gRPC channel
// arguments they become, the names a benchmark's sweep gives them — and both ends taking them:
// the server binary refuses a setting out of range by its flag, a client by its field, and a
// server and client on settings other than gRPC's give the default connection's bits.
#include "remotehead/wire/http2_settings.h"

#include <grpc/impl/codegen/grpc_types.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "remotehead/client/client.h"
#include "support/child_process.h"

namespace remotehead::http2_settings_test {
namespace {

using wire::Http2Settings;

TEST(Http2Settings, ZerosAndTheRangesEndsAreAccepted) {
  EXPECT_TRUE(wire::CheckHttp2Settings({}, "http2.").ok());
  EXPECT_TRUE(wire::CheckHttp2Settings({16384, 1, 1}, "http2.").ok());
  EXPECT_TRUE(wire::CheckHttp2Settings({16777215, 1 << 30, 1 << 30}, "http2.").ok());
}

TEST(Http2Settings, OutOfRangeIsNamedWithTheRangeAndTheValue) {
  const std::vector<std::pair<Http2Settings, std::string>> cases = {
      {{.max_frame_bytes = 16383},
       "--http2_max_frame_bytes: expected 0 (gRPC's) or 16384 to 16777215; got 16383"},
      {{.max_frame_bytes = 16777216},
       "--http2_max_frame_bytes: expected 0 (gRPC's) or 16384 to 16777215; got 16777216"},
      {{.stream_window_bytes = -1},
       "--http2_stream_window_bytes: expected 0 (gRPC's) or 1 to 1073741824; got -1"},
      {{.write_buffer_bytes = (1 << 30) + 1},
       "--http2_write_buffer_bytes: expected 0 (gRPC's) or 1 to 1073741824; got 1073741825"},
  };
  for (const auto& [settings, message] : cases) {
    const absl::Status s = wire::CheckHttp2Settings(settings, "--http2_");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), message);
  }
}

TEST(Http2Settings, OnlySetValuesBecomeGrpcChannelArguments) {
  EXPECT_TRUE(wire::Http2ChannelArgs({}).empty());
  using Args = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ(
      wire::Http2ChannelArgs({.max_frame_bytes = 1 << 20, .write_buffer_bytes = 4096}),
      (Args{{GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20}, {GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 4096}}));
  EXPECT_EQ(wire::Http2ChannelArgs({.stream_window_bytes = 65536}),
            (Args{{GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 65536}}));
}

TEST(Http2Settings, SweepNamesParseBackAndBadOnesAreRefused) {
  for (const Http2Settings& s :
       {Http2Settings{}, Http2Settings{16777215, 0, 0}, Http2Settings{16384, 65536, 1 << 20}}) {
    const absl::StatusOr<Http2Settings> back = wire::ParseHttp2Settings(wire::Http2SettingsName(s));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, s);
  }
  EXPECT_EQ(wire::Http2SettingsName({}), "default");
  EXPECT_EQ(wire::Http2SettingsName({16384, 0, 1}), "16384:0:1");
  for (const char* bad : {"", "1:2", "a:b:c", "16384:0:0:0", "100:0:0"}) {
    EXPECT_EQ(wire::ParseHttp2Settings(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(wire::ParseHttp2Settings("100:0:0").status().message(),
            "max_frame_bytes: expected 0 (gRPC's) or 16384 to 16777215; got 100");
}

TEST(Http2Settings, TheServerRefusesAFlagOutOfRange) {
  testing::ServerProcess refused({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                                  "--http2_stream_window_bytes=0", "--http2_max_frame_bytes=1024"});
  EXPECT_EQ(refused.ExitCode(), 2) << refused.log();
  EXPECT_NE(refused.log().find(
                "--http2_max_frame_bytes: expected 0 (gRPC's) or 16384 to 16777215; got 1024"),
            std::string::npos)
      << refused.log();
}

TEST(Http2Settings, TheClientRefusesAFieldOutOfRange) {
  const auto c = client::Client::Create({.http2 = {.stream_window_bytes = -5}});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            "http2.stream_window_bytes: expected 0 (gRPC's) or 1 to 1073741824; got -5");
}

// Large frames and windows on both ends, and the smallest frames: the step's loss and dX are the
// default connection's, bit for bit, over one stream and over three.
TEST(Http2Settings, BothEndsOnOtherSettingsGiveTheDefaultsBits) {
  const std::vector<Http2Settings> sweep = {
      {}, {16777215, 16 << 20, 16 << 20}, {16384, 65536, 16384}};
  torch::manual_seed(3);
  const client::StepInputs inputs{.hidden = torch::randn({300, 64}),
                                  .targets = torch::randint(0, 97, {300}, torch::kLong)};
  const client::StepSpec spec{.head_id = "h", .accumulate_weight_grad = false};
  std::optional<client::ForwardBackwardResult> first;
  for (const Http2Settings& http2 : sweep) {
    testing::ServerProcess server(
        {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu", "--head=h:97:64",
         "--response_chunk_bytes=4096",
         "--http2_max_frame_bytes=" + std::to_string(http2.max_frame_bytes),
         "--http2_stream_window_bytes=" + std::to_string(http2.stream_window_bytes),
         "--http2_write_buffer_bytes=" + std::to_string(http2.write_buffer_bytes)});
    ASSERT_NE(server.port(), 0) << server.log();
    for (const int streams : {1, 3}) {
      auto c = client::Client::Create(
          {.target = server.target(), .chunk_bytes = 4096, .http2 = http2, .streams = streams});
      ASSERT_TRUE(c.ok()) << c.status();
      auto r = (*c)->ForwardBackward(spec, inputs);
      ASSERT_TRUE(r.ok()) << wire::Http2SettingsName(http2) << ": " << r.status();
      if (!first.has_value()) {
        first = *std::move(r);
        continue;
      }
      EXPECT_EQ(r->loss, first->loss) << wire::Http2SettingsName(http2);
      EXPECT_TRUE(torch::equal(r->grad_hidden, first->grad_hidden))
          << wire::Http2SettingsName(http2);
    }
    EXPECT_EQ(server.Terminate(), 0);
  }
}

}  // namespace
}  // namespace remotehead::http2_settings_test
