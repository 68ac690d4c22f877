// One message of a step call back to the client, as the server sends it: the StepResponse, and
// for a chunk of rows (dX, outputs, token ids, a token extra) their bytes where they lie in the
// engine's result (on a CUDA head, its host copy) — the message's values carry its dtype and
// shape, not its bytes. The stream's writer frames the message around them (wire::Frames): no
// copy of the rows into a protobuf message, none into gRPC's buffer, and none on the compute
// thread. The result must be the engine's own (a tensor no later batch writes into): it stays
// alive, unchanged, until written.
#pragma once

#include <cstdint>
#include <memory>

#include "remotehead/core/device_transfer.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::server {

struct StepResponseOut {
  v1::StepResponse message;
  torch::Tensor rows;    // owns `bytes` (undefined: the message is whole, e.g. the summary)
  wire::RowBytes bytes;  // the values' data, in `rows`' memory
  // The copy that fills `rows` from a CUDA head's device (landed at once on the CPU): the
  // message is written only once it has landed (StreamPipeline), so no thread waits for it.
  core::HostCopy landing;

  // The message framed around the rows' bytes, as gRPC sends it.
  std::shared_ptr<const wire::Frames> Frames() const;
  // The bytes it puts on the wire.
  int64_t ByteSize() const;
  // The message with its bytes copied in (for whom reads messages, e.g. the fuzzer's checks).
  v1::StepResponse Whole() const;
};

}  // namespace remotehead::server
