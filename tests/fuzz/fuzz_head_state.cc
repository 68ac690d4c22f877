// libFuzzer target: core::DecodeHeadState (core/head_state.h) on bytes in memory — the durable
// training state a server restores at start from --state_dir.
//
// The file carries a checksum of its header and data, which byte mutations rarely keep right:
// most inputs stop at the checks before it (size, JSON, metadata, entries), which is where a
// malformed file could do harm; the seeds are valid states so the fuzzer starts from there.
//
// Checked, beyond "no crash, no exception, no sanitizer report": anything refused is DATA_LOSS
// (decoded without a state secret, as a server without one does); anything accepted encodes
// again and decodes to the same state, and sealed under a secret it verifies under that secret
// only (PERMISSION_DENIED under another).
#include <string>

#include "fuzz_input.h"
#include "remotehead/core/head_state.h"

namespace remotehead::fuzz {
namespace {

std::string Bytes(const torch::Tensor& t) {
  if (!t.defined()) return "";
  const torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

}  // namespace
}  // namespace remotehead::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace remotehead;
  using namespace remotehead::fuzz;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto state = core::DecodeHeadState(bytes, "fuzz.state", {});
  if (!state.ok()) {
    if (state.status().code() != absl::StatusCode::kDataLoss) {
      Fail("a bad head state is not DATA_LOSS: " + state.status().ToString());
    }
    return 0;
  }
  const core::StateSecret secret{.secret = "fuzz-state-secret-0123", .origin = "fuzz"};
  auto encoded = core::EncodeHeadState(*state, secret);
  if (!encoded.ok()) Fail("a decoded head state does not encode: " + encoded.status().ToString());
  auto again = core::DecodeHeadState(*encoded, "fuzz.state (re-encoded)", secret);
  if (!again.ok()) Fail("a re-encoded head state does not decode: " + again.status().ToString());
  if (again->head_id != state->head_id || again->state_id != state->state_id ||
      again->weight_version != state->weight_version ||
      Bytes(again->weight) != Bytes(state->weight) || Bytes(again->bias) != Bytes(state->bias)) {
    Fail("decode(encode(state)) != state");
  }
  const auto other = core::DecodeHeadState(*encoded, "fuzz.state (re-encoded)",
                                           {.secret = "another-secret-0123456", .origin = "fuzz"});
  if (other.status().code() != absl::StatusCode::kPermissionDenied) {
    Fail("a state sealed under one secret is not refused under another: " +
         other.status().ToString());
  }
  return 0;
}
