#include "rpc/stream_reactors.h"

#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "remotehead/wire/tensor_codec.h"
#include "rpc/client_stream_reactor.h"
#include "rpc/snapshot_stream.h"
#include "service/request_memory.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

absl::StatusOr<HeadSnapshot> Snapshot(ServiceContext* service, const std::string& head_id,
                                      v1::DType dtype, bool gradients) {
  ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> requested, OptionalDtype(dtype, "dtype"));
  return service->operations.Snapshot(head_id, requested, gradients);
}

// An export pinned to the server process and weight version the caller holds: refused, with
// nothing streamed, unless the snapshot is of that version (its version is read under the same
// lock as its rows).
absl::StatusOr<HeadSnapshot> PinnedExport(absl::StatusOr<HeadSnapshot> snapshot,
                                          const v1::ExportWeightsRequest& request) {
  if (!snapshot.ok()) return snapshot;
  RETURN_IF_ERROR(CheckIncarnation(request.expected_incarnation(), "expected_incarnation",
                                   snapshot->description));
  RETURN_IF_ERROR(CheckWeightVersion(ExpectedWeightVersion(request), "expected_weight_version",
                                     snapshot->description));
  return snapshot;
}

// UploadHead: a header, then the weight rows (and bias rows) in order, assembled on the CPU;
// the head is created only when every row arrived. A failed or cancelled upload creates
// nothing.
class UploadReactor final : public ClientStreamReactor<v1::UploadHeadRequest> {
 public:
  UploadReactor(grpc::CallbackServerContext* context, ServiceContext* service,
                v1::HeadInfo* response)
      : ClientStreamReactor(context), service_(*service), response_(response) {
    StartReading();
  }

  ~UploadReactor() override { service_.admission.Release(buffer_ticket_); }

 private:
  absl::Status OnMessage(const v1::UploadHeadRequest& request) override {
    switch (request.part_case()) {
      case v1::UploadHeadRequest::kHeader:
        return OnHeader(request.header());
      case v1::UploadHeadRequest::kWeightRows:
        if (!weight_) return NoHeaderYet("weight_rows");
        return weight_->Add(request.weight_rows());
      case v1::UploadHeadRequest::kBiasRows:
        if (!header_) return NoHeaderYet("bias_rows");
        if (!bias_) {
          return absl::InvalidArgumentError(
              "bias_rows: expected none (header.has_bias is false); got bias rows");
        }
        return bias_->Add(request.bias_rows());
      default:
        return absl::InvalidArgumentError("part: expected header, weight_rows or bias_rows");
    }
  }

  static absl::Status NoHeaderYet(const std::string& field) {
    return absl::InvalidArgumentError(
        absl::StrCat("header: expected the first message to be the header; got ", field));
  }

  absl::Status OnHeader(const v1::UploadHeadRequest::UploadHeader& h) {
    if (header_) {
      return absl::InvalidArgumentError("header: expected exactly one header; got a second");
    }
    RETURN_IF_ERROR(service_.local.CheckNewHeadId(h.head_id(), "header.head_id"));
    // Before the rows travel (checked again when they are in: the head may change meanwhile).
    ASSIGN_OR_RETURN(traits_, TraitsFromWire(h.frozen(), h.grad_dtype(), "header."));
    if (h.replace()) RETURN_IF_ERROR(service_.local.CheckReplaceKeepsTraits(h.head_id(), traits_));
    ASSIGN_OR_RETURN(const torch::ScalarType dtype, wire::FromWireDtype(h.dtype(), "header"));
    // Sizes checked, and the CPU buffer the rows are assembled in reserved in the memory budget,
    // before anything is allocated.
    RETURN_IF_ERROR(core::HeadMemoryBytes(h.vocab_size(), h.hidden_size(), dtype, h.has_bias(),
                                          traits_.grad_dtype, "header.")
                        .status());
    const MemoryEstimate buffer =
        UploadBufferMemory(h.head_id(), h.vocab_size(), h.hidden_size(), h.has_bias(), dtype);
    buffer_ticket_ = service_.admission.NewTicket();
    RETURN_IF_ERROR(service_.admission.Reserve(buffer_ticket_, buffer.bytes, buffer.breakdown));
    header_ = h;
    weight_.emplace(torch::empty({h.vocab_size(), h.hidden_size()}, torch::TensorOptions(dtype)),
                    "weight_rows", /*convert_dtype=*/false);
    if (h.has_bias()) {
      bias_.emplace(torch::empty({h.vocab_size()}, torch::TensorOptions(dtype)), "bias_rows",
                    /*convert_dtype=*/false);
    }
    return absl::OkStatus();
  }

  absl::Status Complete() override {
    if (!header_) return absl::InvalidArgumentError("header: the upload ended without one");
    if (!weight_->CheckComplete().ok() || (bias_ && !bias_->CheckComplete().ok())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight_rows, bias_rows: expected ", header_->vocab_size(), " rows each; got ",
          weight_->rows_received(), " and ", bias_ ? bias_->rows_received() : 0));
    }
    ASSIGN_OR_RETURN(const HeadDescription d,
                     service_.operations.AddUploaded(header_->head_id(), weight_->tensor(),
                                                     bias_ ? bias_->tensor() : torch::Tensor(),
                                                     header_->replace(), traits_));
    return ToWire(d, response_);
  }

  ServiceContext& service_;
  v1::HeadInfo* response_;
  std::optional<v1::UploadHeadRequest::UploadHeader> header_;
  HeadTraits traits_;  // the header's
  std::optional<wire::RowAssembler> weight_, bias_;
  uint64_t buffer_ticket_ = 0;  // the assembly buffer's bytes in the memory budget
};

}  // namespace

grpc::ServerReadReactor<v1::UploadHeadRequest>* NewUploadReactor(
    grpc::CallbackServerContext* context, ServiceContext* service, v1::HeadInfo* response) {
  return new UploadReactor(context, service, response);
}

grpc::ServerWriteReactor<v1::ExportWeightsResponse>* NewExportReactor(
    ServiceContext* service, const v1::ExportWeightsRequest& request) {
  using R = v1::ExportWeightsResponse;
  return new SnapshotStreamReactor<R>(
      PinnedExport(Snapshot(service, request.head_id(), request.dtype(), /*gradients=*/false),
                   request),
      service->options.response_chunk_bytes, &R::mutable_weight_rows, &R::mutable_bias_rows,
      nullptr);
}

grpc::ServerWriteReactor<v1::FetchGradientsResponse>* NewFetchGradientsReactor(
    ServiceContext* service, const v1::FetchGradientsRequest& request) {
  using R = v1::FetchGradientsResponse;
  return new SnapshotStreamReactor<R>(
      Snapshot(service, request.head_id(), request.dtype(), /*gradients=*/true),
      service->options.response_chunk_bytes, &R::mutable_weight_grad_rows,
      &R::mutable_bias_grad_rows, &R::mutable_info);
}

}  // namespace remotehead::server
