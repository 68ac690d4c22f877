// libFuzzer target: streams of StepRequest messages (header + rows) through StepStream and its
// StepSession, the transport-free seam every ForwardBackward / Forward / Backward goes through,
// against two tiny heads (fp32 with bias, bf16 without; V = 17, D = 4) in a HeadRegistry.
//
// Input: parts separated by fuzz_input.h's separator; each part is one control byte and a
// serialized v1::StepRequest. Control bits:
//   0x80  start a new session before this message (the first part always does); its mode is
//         (ctl >> 4) & 3: 0 ForwardBackward, 1 Forward, 2 Backward (3 = ForwardBackward)
//   0x01  unused (rows are batched at fixed boundaries whatever the transport holds)
//   0x04  abandon the session after this message (a client that disconnects: no OnClientDone)
//   0x08  the session's should_stop says stop (cancellation, deadline)
// A header whose inputs_handle is "@" gets the handle of the last Forward of this input that
// retained its inputs, so Backward by handle is reachable.
//
// Checked, beyond "no crash, no exception, no sanitizer report": every streamed result decodes;
// a session that fails, is abandoned or cancelled, and every Forward, leaves both heads'
// gradients bit-identical; no session changes a head's weights or version. Every message's bytes
// also go to wire::SplitHiddenData (the server's decode of rows straight into staging): where it
// finds hidden's bytes, protobuf parses the split's rest exactly when it parses the message, and
// then the rest with those bytes put back is the message.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "remotehead/core/head.h"
#include "remotehead/server/service/admission.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/wire/split_rows.h"
#include "remotehead/wire/tensor_codec.h"
#include "rpc/step_stream.h"
#include "step/retained_inputs.h"

namespace remotehead::fuzz {
namespace {

constexpr size_t kMaxMessages = 64;

// SplitHiddenData agrees with protobuf's parse (`parsed`, null where it failed).
void CheckSplit(const std::string& bytes, const v1::StepRequest* parsed) {
  const std::vector<wire::BytePiece> pieces = {
      {bytes.data(), bytes.size() / 2},
      {bytes.data() + bytes.size() / 2, bytes.size() - bytes.size() / 2}};
  const std::optional<wire::SplitTensor> split = wire::SplitHiddenData(pieces);
  if (!split.has_value()) return;
  // The walk checks the fields on its way only: the rest of a message protobuf refuses
  // elsewhere (another field malformed) is refused too, and the server parses it whole.
  v1::StepRequest rebuilt;
  if (!rebuilt.ParseFromString(split->rest)) {
    if (parsed != nullptr) Fail("the split's rest does not parse, the message does");
    return;
  }
  if (parsed == nullptr) Fail("the split's rest parses, the message does not");
  std::string data(split->data_size, '\0');
  wire::CopyBytes(pieces, split->data_offset, split->data_size, data.data());
  rebuilt.mutable_rows()->mutable_hidden()->set_data(data);
  if (!google::protobuf::util::MessageDifferencer::Equals(rebuilt, *parsed)) {
    Fail("the split's rest with hidden's bytes put back is not the message");
  }
}

struct World {
  server::AdmissionController admission{server::AdmissionOptions{}};
  server::RetainedInputStore retained{&admission, /*max_seconds=*/2.0};
  server::HeadRegistry registry;
  std::vector<std::shared_ptr<server::HeadEntry>> heads;
};

World& TheWorld() {
  static World* world = [] {
    auto* w = new World;
    struct Spec {
      const char* id;
      torch::ScalarType dtype;
      bool bias;
    };
    for (const Spec& s : {Spec{"h", torch::kFloat, true}, Spec{"b", torch::kBFloat16, false}}) {
      auto head = core::Head::Initialize(
          {.vocab_size = 17, .hidden_size = 4, .dtype = s.dtype, .bias = s.bias, .seed = 1}, {});
      if (!head.ok()) Fail(head.status().ToString());
      auto entry = w->registry.Add(s.id, *std::move(head));
      if (!entry.ok()) Fail(entry.status().ToString());
      w->heads.push_back(*entry);
    }
    return w;
  }();
  return *world;
}

std::string Bytes(const torch::Tensor& t) {
  if (!t.defined()) return "";
  const torch::Tensor c = t.cpu().contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// Everything a session may change, per head: dW, db, W, b, version.
std::vector<std::string> Snapshot(const World& world, bool with_grads) {
  std::vector<std::string> out;
  for (const auto& entry : world.heads) {
    entry->Read([&](const core::Head& head) {
      out.push_back(with_grads ? Bytes(head.grads().weight) + Bytes(head.grads().bias) : "");
      out.push_back(Bytes(head.weight()) + Bytes(head.bias()) + std::to_string(head.version()));
    });
  }
  return out;
}

void CheckResponses(const std::vector<server::StepResponseOut>& responses) {
  for (const server::StepResponseOut& out : responses) {
    const v1::StepResponse r = out.Whole();  // as the client parses it
    const v1::TensorChunk* chunk = r.has_grad_hidden() ? &r.grad_hidden()
                                   : r.has_outputs()   ? &r.outputs()
                                                       : nullptr;
    if (chunk == nullptr) continue;
    auto decoded = wire::DecodeTensorView(chunk->values(), "response");
    if (!decoded.ok()) Fail("a streamed result does not decode: " + decoded.status().ToString());
  }
}

class Session {
 public:
  Session(World* world, uint8_t ctl)
      : world_(world),
        mode_(((ctl >> 4) & 3) == 1   ? core::CallMode::kForward
              : ((ctl >> 4) & 3) == 2 ? core::CallMode::kBackward
                                      : core::CallMode::kFused),
        stream_(&world->registry, &world->retained, mode_, /*response_chunk_bytes=*/64),
        before_(Snapshot(*world, /*with_grads=*/true)) {}

  bool open() const { return open_; }

  void OnMessage(uint8_t ctl, v1::StepRequest request, std::string* last_handle) {
    if (!open_) return;
    if (request.has_header() && request.header().inputs_handle() == "@") {
      request.mutable_header()->set_inputs_handle(*last_handle);
    }
    if ((ctl & 0x08) != 0) {
      cancelled_ = true;
      stream_.session().set_should_stop([] { return true; });
    }
    const bool had_header = stream_.session().has_begun();
    std::vector<server::StepResponseOut> responses;
    const absl::Status s = stream_.OnRequest(std::move(request), &responses);
    CheckResponses(responses);
    if (!s.ok()) return End(/*failed=*/true);
    // What the reactor asks right after the header, before admission.
    if (!had_header && stream_.session().has_begun()) {
      (void)stream_.session().EstimateMemory(int64_t{1} << 20);
    }
    if ((ctl & 0x04) != 0) End(/*failed=*/true);
  }

  // The client's end of the stream (unless the session already ended).
  void Finish(std::string* last_handle) {
    if (!open_) return;
    std::vector<server::StepResponseOut> responses;
    const absl::Status s = stream_.OnClientDone(&responses);
    CheckResponses(responses);
    if (s.ok()) {
      if (responses.empty() || !responses.back().message.has_summary()) {
        Fail("a successful session ended without a summary");
      }
      const std::string& handle = responses.back().message.summary().inputs_handle();
      if (!handle.empty()) *last_handle = handle;
    }
    End(/*failed=*/!s.ok());
  }

 private:
  void End(bool failed) {
    open_ = false;
    const bool unchanged_grads = failed || cancelled_ || mode_ == core::CallMode::kForward;
    const std::vector<std::string> after = Snapshot(*world_, unchanged_grads);
    std::vector<std::string> before = before_;
    if (!unchanged_grads) {
      for (size_t i = 0; i < before.size(); i += 2) before[i] = "";
    }
    if (after != before) {
      Fail(failed ? "a failed session changed a head" : "a session changed a head's weights");
    }
  }

  World* world_;
  core::CallMode mode_;
  server::StepStream stream_;
  std::vector<std::string> before_;
  bool open_ = true;
  bool cancelled_ = false;
};

}  // namespace
}  // namespace remotehead::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields: expected, noisy
  torch::set_num_threads(1);
  remotehead::fuzz::TheWorld();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace remotehead::fuzz;
  World& world = TheWorld();
  for (const auto& entry : world.heads) entry->ZeroGradients();  // inputs are independent
  std::vector<std::string> parts = SplitParts(data, size);
  if (parts.size() > kMaxMessages) parts.resize(kMaxMessages);
  std::optional<Session> session;
  std::string last_handle;
  for (const std::string& part : parts) {
    if (part.empty()) continue;
    const uint8_t ctl = static_cast<uint8_t>(part[0]);
    remotehead::v1::StepRequest request;
    const bool parsed = request.ParseFromArray(part.data() + 1, static_cast<int>(part.size() - 1));
    CheckSplit(part.substr(1), parsed ? &request : nullptr);
    if (!parsed) continue;
    if (!session.has_value() || (ctl & 0x80) != 0) {
      if (session.has_value()) session->Finish(&last_handle);
      session.emplace(&world, ctl);
    }
    session->OnMessage(ctl, std::move(request), &last_handle);
  }
  if (session.has_value()) session->Finish(&last_handle);
  return 0;
}
