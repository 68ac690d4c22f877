#include "rpc/embedding_reactors.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "remotehead/core/head.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "remotehead/wire/tensor_codec.h"
#include "rpc/client_stream_reactor.h"
#include "rpc/snapshot_stream.h"
#include "service/head_expectations.h"
#include "service/request_memory.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

torch::Tensor IdsTensor(const google::protobuf::RepeatedField<int64_t>& ids) {
  return torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong);
}

absl::StatusOr<HeadSnapshot> Lookup(ServiceContext* service,
                                    const v1::EmbeddingLookupRequest& request) {
  ASSIGN_OR_RETURN(const HeadDescription head, service->local.Describe(request.head_id()));
  RETURN_IF_ERROR(CheckIncarnation(request.expected_incarnation(), "expected_incarnation", head));
  ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                   OptionalDtype(request.dtype(), "dtype"));
  // The rows. bytes, reserved while they are gathered.
  const MemoryEstimate rows = EmbeddingRowsMemory(
      request.head_id(), request.ids_size(), head.hidden_size, dtype.value_or(head.dtype), "ids");
  const uint64_t ticket = service->admission.NewTicket();
  RETURN_IF_ERROR(service->admission.Reserve(ticket, rows.bytes, rows.breakdown));
  absl::StatusOr<HeadSnapshot> snapshot = service->operations.LookupEmbedding(
      request.head_id(), IdsTensor(request.ids()), dtype, "ids");
  service->admission.Release(ticket);
  if (!snapshot.ok()) return snapshot;
  // The version is read under the same lock as the rows.
  RETURN_IF_ERROR(CheckWeightVersion(ExpectedWeightVersion(request), "expected_weight_version",
                                     snapshot->description));
  return snapshot;
}

// EmbeddingGradient: a header, then the gradient rows in order, assembled on the CPU (float32);
// added into dW only when every row arrived. A failed or cancelled call adds nothing.
class EmbeddingGradientReactor final : public ClientStreamReactor<v1::EmbeddingGradientRequest> {
 public:
  EmbeddingGradientReactor(grpc::CallbackServerContext* context, ServiceContext* service,
                           v1::EmbeddingGradientResponse* response)
      : ClientStreamReactor(context), service_(*service), response_(response) {
    StartReading();
  }

  ~EmbeddingGradientReactor() override { service_.admission.Release(buffer_ticket_); }

 private:
  absl::Status OnMessage(const v1::EmbeddingGradientRequest& request) override {
    switch (request.part_case()) {
      case v1::EmbeddingGradientRequest::kHeader:
        return OnHeader(request.header());
      case v1::EmbeddingGradientRequest::kGradRows:
        if (!rows_) {
          return absl::InvalidArgumentError(
              "header: expected the first message to be the header; got grad_rows");
        }
        return rows_->Add(request.grad_rows());
      default:
        return absl::InvalidArgumentError("part: expected header or grad_rows");
    }
  }

  absl::Status OnHeader(const v1::EmbeddingGradientRequest::Header& h) {
    if (header_) {
      return absl::InvalidArgumentError("header: expected exactly one header; got a second");
    }
    ASSIGN_OR_RETURN(const HeadDescription head, service_.local.Describe(h.head_id()));
    RETURN_IF_ERROR(
        CheckIncarnation(h.expected_incarnation(), "header.expected_incarnation", head));
    if (!h.has_gradient_id() || h.gradient_id().trainer().empty()) {
      return absl::InvalidArgumentError(
          "header.gradient_id.trainer: expected the trainer's identity (a tied embedding's "
          "gradient is added exactly once per gradient id); got none");
    }
    // Checked before the rows travel (and again on every rank when they are in).
    ids_ = IdsTensor(h.ids());
    RETURN_IF_ERROR(CheckEmbeddingIds(ids_, head.vocab_size, "header.ids"));
    RETURN_IF_ERROR(CheckEmbeddingGradientIds(ids_, "header.ids"));
    // The rows are added to dW in the head's accumulation dtype (float64 for a float64 head).
    const torch::ScalarType rows_dtype = core::AccumulationDtype(head.dtype);
    const MemoryEstimate buffer =
        EmbeddingRowsMemory(h.head_id(), h.ids_size(), head.hidden_size, rows_dtype, "header.ids");
    buffer_ticket_ = service_.admission.NewTicket();
    RETURN_IF_ERROR(service_.admission.Reserve(buffer_ticket_, buffer.bytes, buffer.breakdown));
    header_ = h;
    rows_.emplace(torch::empty({h.ids_size(), head.hidden_size}, rows_dtype), "grad_rows",
                  /*convert_dtype=*/true);
    return absl::OkStatus();
  }

  absl::Status Complete() override {
    if (!header_) return absl::InvalidArgumentError("header: the call ended without one");
    if (!rows_->CheckComplete().ok()) {
      return absl::InvalidArgumentError(absl::StrCat("grad_rows: expected ", ids_.size(0),
                                                     " rows (one per header.ids); got ",
                                                     rows_->rows_received()));
    }
    const GradientKey key{.trainer = header_->gradient_id().trainer(),
                          .step = header_->gradient_id().step(),
                          .micro_batch = header_->gradient_id().micro_batch(),
                          .use = GradientUse::kEmbedding};
    ASSIGN_OR_RETURN(
        const EmbeddingGradientOutcome outcome,
        service_.operations.AddEmbeddingGradient(header_->head_id(), ids_, rows_->tensor(), key,
                                                 ExpectedWeightVersion(*header_), "header.ids",
                                                 "grad_rows", "header.expected_weight_version"));
    response_->set_replayed(outcome.replayed);
    return ToWire(outcome.description, response_->mutable_info());
  }

  ServiceContext& service_;
  v1::EmbeddingGradientResponse* response_;
  std::optional<v1::EmbeddingGradientRequest::Header> header_;
  torch::Tensor ids_;
  std::optional<wire::RowAssembler> rows_;
  uint64_t buffer_ticket_ = 0;  // the assembly buffer's bytes in the memory budget
};

}  // namespace

grpc::ServerWriteReactor<v1::EmbeddingLookupResponse>* NewEmbeddingLookupReactor(
    ServiceContext* service, const v1::EmbeddingLookupRequest& request) {
  using R = v1::EmbeddingLookupResponse;
  return new SnapshotStreamReactor<R>(Lookup(service, request),
                                      service->options.response_chunk_bytes, &R::mutable_rows,
                                      nullptr, &R::mutable_info);
}

grpc::ServerReadReactor<v1::EmbeddingGradientRequest>* NewEmbeddingGradientReactor(
    grpc::CallbackServerContext* context, ServiceContext* service,
    v1::EmbeddingGradientResponse* response) {
  return new EmbeddingGradientReactor(context, service, response);
}

}  // namespace remotehead::server
