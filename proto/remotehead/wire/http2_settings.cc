#include "remotehead/wire/http2_settings.h"

#include <grpc/impl/codegen/grpc_types.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace remotehead::wire {
namespace {

struct Setting {
  const char* name;  // as the field and the flag say it
  int32_t Http2Settings::*field;
  int64_t min, max;
  const char* channel_arg;
};

// SETTINGS_MAX_FRAME_SIZE's range is HTTP/2's (RFC 9113 6.5.2); the others are gRPC's ints.
constexpr Setting kSettings[] = {
    {"max_frame_bytes", &Http2Settings::max_frame_bytes, 16384, 16777215,
     GRPC_ARG_HTTP2_MAX_FRAME_SIZE},
    {"stream_window_bytes", &Http2Settings::stream_window_bytes, 1, int64_t{1} << 30,
     GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES},
    {"write_buffer_bytes", &Http2Settings::write_buffer_bytes, 1, int64_t{1} << 30,
     GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE},
};

}  // namespace

absl::Status CheckHttp2Settings(const Http2Settings& settings, absl::string_view prefix) {
  for (const Setting& s : kSettings) {
    const int64_t value = settings.*s.field;
    if (value != 0 && (value < s.min || value > s.max)) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, s.name, ": expected 0 (gRPC's) or ",
                                                     s.min, " to ", s.max, "; got ", value));
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, int>> Http2ChannelArgs(const Http2Settings& settings) {
  std::vector<std::pair<std::string, int>> args;
  for (const Setting& s : kSettings) {
    if (settings.*s.field != 0) args.emplace_back(s.channel_arg, settings.*s.field);
  }
  return args;
}

absl::StatusOr<Http2Settings> ParseHttp2Settings(absl::string_view text) {
  Http2Settings settings;
  if (text == "default") return settings;
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  bool ok = parts.size() == std::size(kSettings);
  for (size_t i = 0; ok && i < parts.size(); ++i) {
    ok = absl::SimpleAtoi(parts[i], &(settings.*kSettings[i].field));
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected \"default\" or FRAME:WINDOW:WRITE_BUFFER in bytes (0: gRPC's); got \"", text,
        "\""));
  }
  if (absl::Status s = CheckHttp2Settings(settings, ""); !s.ok()) return s;
  return settings;
}

std::string Http2SettingsName(const Http2Settings& settings) {
  if (settings == Http2Settings{}) return "default";
  return absl::StrCat(settings.max_frame_bytes, ":", settings.stream_window_bytes, ":",
                      settings.write_buffer_bytes);
}

}  // namespace remotehead::wire
