// A head's messages, as the calls on a head (head_calls.cc) read and write them: its HeadInfo
// from the wire, the requests built from the public types, the dtypes and token ids they carry,
// and its rows streamed — out of a server stream into tensors shaped from the head (its weights,
// its gradients), or into a client stream (uploaded weights, an embedding's gradient) as
// messages of at most chunk_bytes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "channel.h"
#include "remotehead/client/head_types.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/tensor_codec.h"
#include "stream.h"

namespace remotehead::client::internal {

// A head's info as the server sent it (a dtype the codec refuses: a broken response, INTERNAL).
absl::StatusOr<HeadInfo> FromWire(const v1::HeadInfo& wire);

// The requests that create a head, from its initialisation or from a safetensors file on the
// server (INVALID_ARGUMENT naming a dtype the wire has not).
absl::StatusOr<v1::CreateHeadRequest> ToCreateRequest(const std::string& head_id,
                                                      const InitSpec& init);
absl::StatusOr<v1::CreateHeadRequest> ToCreateRequest(const std::string& head_id,
                                                      const SafetensorsSource& source);

// The request of an optimizer step on the head.
v1::OptimizerStepRequest ToOptimizerStepRequest(const std::string& head_id,
                                                const OptimizerStepOptions& options);

// A creation's accumulator dtype into its request (CreateHeadRequest, UploadHeader); nullopt
// leaves the server's default.
template <typename Request>
absl::Status SetGradDtype(std::optional<torch::ScalarType> grad_dtype, const std::string& field,
                          Request* request) {
  if (!grad_dtype.has_value()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const v1::DType wire_dtype, wire::ToWireDtype(*grad_dtype, field));
  request->set_grad_dtype(wire_dtype);
  return absl::OkStatus();
}

// Asks `request` for its rows in `dtype`; nullopt leaves the server's default.
template <typename Request>
absl::Status RequestDtype(std::optional<torch::ScalarType> dtype, Request* request) {
  if (!dtype.has_value()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const v1::DType wire_dtype, wire::ToWireDtype(*dtype, "dtype"));
  request->set_dtype(wire_dtype);
  return absl::OkStatus();
}

// Token ids as the wire's repeated int64: INVALID_ARGUMENT naming `field` unless int64 [n].
absl::Status SetIds(const torch::Tensor& ids, const char* field,
                    google::protobuf::RepeatedField<int64_t>* out);

// The shape and dtype of a head, read inside an attempt (with that attempt's deadline) before
// its weights or gradients are streamed into tensors allocated from them.
absl::StatusOr<HeadInfo> DescribeForStream(Stub& stub, const grpc::ClientContext& attempt_context,
                                           const std::string& head_id);

// Where a stream of a head's rows goes: its [V, D] matrix and its [V] bias (undefined for a head
// without one), each with the field that its messages' rows are named by.
struct HeadRowsInto {
  torch::Tensor* weight;
  const char* weight_field;
  torch::Tensor* bias;
  const char* bias_field;
  bool gradients = false;  // dW and db: their default dtype is the accumulators'
};

// One attempt of a stream of a head's rows (ExportWeights: its weights; FetchGradients: dW and
// db): the head described, `into` allocated from that in `dtype` (nullopt: the head's own, or
// for gradients its accumulators'),
// then the stream that `method` answers `request` with read to its end — `handle` hands each
// message's rows to the weight's or the bias's assembler (nullptr for a head without a bias) —
// and the rows checked complete.
template <typename Request, typename Response, typename Handle>
absl::Status ReadHeadRows(Stub& stub,
                          std::unique_ptr<grpc::ClientReader<Response>> (Stub::*method)(
                              grpc::ClientContext*, const Request&),
                          const Request& request, grpc::ClientContext* context,
                          std::optional<torch::ScalarType> dtype, const HeadRowsInto& into,
                          Handle&& handle) {
  ASSIGN_OR_RETURN(const HeadInfo info, DescribeForStream(stub, *context, request.head_id()));
  const torch::ScalarType out = dtype.value_or(into.gradients ? info.grad_dtype : info.dtype);
  *into.weight = torch::empty({info.vocab_size, info.hidden_size}, out);
  *into.bias = info.has_bias ? torch::empty({info.vocab_size}, out) : torch::Tensor();
  ResponseRows w(*into.weight, into.weight_field), b(*into.bias, into.bias_field);
  ResponseRows* const bias_rows = info.has_bias ? &b : nullptr;
  auto reader = (stub.*method)(context, request);
  RETURN_IF_ERROR(ReadStream<Response>(
      context, *reader, [&](const Response& response) { return handle(response, w, bias_rows); }));
  RETURN_IF_ERROR(w.CheckComplete());
  if (info.has_bias) RETURN_IF_ERROR(b.CheckComplete());
  return absl::OkStatus();
}

// Writes `rows`' chunks (wire layout) as messages of a client stream, each made by
// `field(&message)` (the message's TensorChunk); false once the stream refuses a write.
template <typename Request, typename Writer>
bool WriteRowChunks(Writer& writer, const torch::Tensor& rows,
                    const std::vector<wire::RowRange>& chunks,
                    v1::TensorChunk* (Request::*field)()) {
  for (const auto& [offset, count] : chunks) {
    Request m;
    v1::TensorChunk* chunk = (m.*field)();
    chunk->set_row_offset(offset);
    wire::EncodeRows(rows, offset, count, chunk->mutable_values());
    if (!writer.Write(m)) return false;
  }
  return true;
}

}  // namespace remotehead::client::internal
