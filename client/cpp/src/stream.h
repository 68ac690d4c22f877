// Reading what a server stream sends: the messages to the stream's end, and the rows of a result
// assembled into a preallocated tensor.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/tensor_codec.h"
#include "status.h"

namespace remotehead::client::internal {

// Reads a server stream to its end, handing each message to `handle`. The first error — a
// message `handle` refuses, or (with `finish`) the call's status — is returned; after a refused
// message the call is cancelled and drained, so the stream always ends cleanly. Without
// `finish` the caller calls Finish itself (after joining its writer).
template <typename Response, typename Reader, typename Handle>
absl::Status ReadStream(grpc::ClientContext* context, Reader& reader, Handle&& handle,
                        bool finish = true) {
  Response response;
  absl::Status received;
  while (received.ok() && reader.Read(&response)) received = handle(response);
  if (!received.ok()) {
    context->TryCancel();
    while (reader.Read(&response)) {
    }
  }
  if (!finish) return received;
  const grpc::Status finished = reader.Finish();
  RETURN_IF_ERROR(received);
  return FromGrpc(finished);
}

// The rows of a result the server streams, assembled by the wire codec; anything it refuses is
// a broken response (INTERNAL).
class ResponseRows {
 public:
  // kAnyOrder: the rows of a step striped over several streams, which come on any of them.
  ResponseRows(torch::Tensor dst, std::string field,
               wire::RowAssembler::Order order = wire::RowAssembler::Order::kInOrder)
      : rows_(std::move(dst), std::move(field), /*convert_dtype=*/true, order) {}
  absl::Status Add(const v1::TensorChunk& chunk) { return BrokenResponse(rows_.Add(chunk)); }
  absl::Status Add(const v1::TokenExtraChunk& chunk) {
    return BrokenResponse(rows_.Add(chunk.row_offset(), chunk.values()));
  }
  absl::Status CheckComplete() const { return BrokenResponse(rows_.CheckComplete()); }
  // The rows of a chunk whose values' data the caller copies itself (RowAssembler::Claim).
  absl::StatusOr<torch::Tensor> Claim(const v1::TensorChunk& chunk, torch::ScalarType dtype) {
    absl::StatusOr<torch::Tensor> rows = rows_.Claim(chunk.row_offset(), chunk.values(), dtype);
    if (!rows.ok()) return BrokenResponse(rows.status());
    return rows;
  }
  const torch::Tensor& tensor() const { return rows_.tensor(); }

 private:
  wire::RowAssembler rows_;
};

}  // namespace remotehead::client::internal
