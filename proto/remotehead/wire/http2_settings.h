// The HTTP/2 framing and flow-control settings of the service's connections, which the server
// (its --http2_* flags) and the C++ client (ClientOptions::http2) both take: one home for their
// ranges and for the gRPC channel arguments they become. 0 leaves gRPC's own choice — which is
// what both ends use unless told otherwise: the sweep in docs/benchmarks.md ("HTTP/2 settings")
// found none of them moving the step's bytes per second on loopback.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace remotehead::wire {

struct Http2Settings {
  // The largest DATA frame this end accepts (SETTINGS_MAX_FRAME_SIZE): the peer sends frames up to
  // it. HTTP/2 allows 16,384 (its default) to 16,777,215.
  int32_t max_frame_bytes = 0;
  // A stream's flow-control window at its start (gRPC's "lookahead"; 64 KiB by default, grown by
  // its bandwidth-delay probing): how far a sender may run ahead of the reader.
  int32_t stream_window_bytes = 0;
  // What a stream may have queued in gRPC before a write completes (its write buffer).
  int32_t write_buffer_bytes = 0;

  bool operator==(const Http2Settings&) const = default;
};

// OK when every setting is 0 (gRPC's) or in its range; else the field (named under `prefix`,
// e.g. "http2." or "--http2_"), the range and the value.
absl::Status CheckHttp2Settings(const Http2Settings& settings, absl::string_view prefix);

// The gRPC channel arguments of the settings that are not 0, for a channel or a server builder.
std::vector<std::pair<std::string, int>> Http2ChannelArgs(const Http2Settings& settings);

// "default" (every setting 0) or "FRAME:WINDOW:WRITE_BUFFER" in bytes (0: gRPC's), as a
// benchmark's sweep names one; and back.
absl::StatusOr<Http2Settings> ParseHttp2Settings(absl::string_view text);
std::string Http2SettingsName(const Http2Settings& settings);

}  // namespace remotehead::wire
