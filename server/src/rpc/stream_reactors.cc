#include "rpc/stream_reactors.h"

#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "remotehead/wire/tensor_codec.h"
#include "request_memory.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

// Streams a HeadSnapshot as row chunks — the matrix, then the vector — and, when `info_field`
// is given, the HeadInfo last. One message is built per OnWriteDone, so only the snapshot is
// held.
template <typename Response>
class SnapshotStreamReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  using ChunkField = v1::TensorChunk* (Response::*)();
  using InfoField = v1::HeadInfo* (Response::*)();

  SnapshotStreamReactor(absl::StatusOr<HeadSnapshot> snapshot, int64_t chunk_bytes,
                        ChunkField matrix_field, ChunkField vector_field, InfoField info_field)
      : matrix_field_(matrix_field), vector_field_(vector_field), info_field_(info_field) {
    if (!snapshot.ok()) {
      this->Finish(ToGrpcStatus(snapshot.status()));
      return;
    }
    snapshot_ = *std::move(snapshot);
    const torch::Tensor& m = snapshot_.matrix;
    for (const wire::RowRange& r :
         wire::PlanRowChunks(m.size(0), m.size(1) * m.element_size(), chunk_bytes)) {
      pieces_.push_back({false, r});
    }
    if (snapshot_.vector.defined()) {
      const torch::Tensor& v = snapshot_.vector;
      for (const wire::RowRange& r :
           wire::PlanRowChunks(v.size(0), v.element_size(), chunk_bytes)) {
        pieces_.push_back({true, r});
      }
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      this->Finish(ToGrpcStatus(absl::CancelledError("the client stopped reading")));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  struct Piece {
    bool vector;
    wire::RowRange rows;
  };

  void WriteNext() {
    response_.Clear();
    if (next_ < pieces_.size()) {
      const Piece& p = pieces_[next_++];
      v1::TensorChunk* chunk = (response_.*(p.vector ? vector_field_ : matrix_field_))();
      chunk->set_row_offset(p.rows.offset);
      const torch::Tensor& source = p.vector ? snapshot_.vector : snapshot_.matrix;
      const absl::Status s = wire::EncodeTensor(source.narrow(0, p.rows.offset, p.rows.count),
                                                chunk->mutable_values());
      if (!s.ok()) {
        this->Finish(ToGrpcStatus(s));
        return;
      }
      this->StartWrite(&response_);
    } else if (info_field_ != nullptr && !info_sent_) {
      info_sent_ = true;
      const absl::Status s = ToWire(snapshot_.description, (response_.*info_field_)());
      if (!s.ok()) {
        this->Finish(ToGrpcStatus(s));
        return;
      }
      this->StartWriteAndFinish(&response_, {}, grpc::Status::OK);
    } else {
      this->Finish(grpc::Status::OK);
    }
  }

  ChunkField matrix_field_;
  ChunkField vector_field_;
  InfoField info_field_;
  HeadSnapshot snapshot_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool info_sent_ = false;
  Response response_;
};

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
  RETURN_IF_ERROR(CheckWeightVersion(request.has_expected_weight_version()
                                         ? std::optional<int64_t>(request.expected_weight_version())
                                         : std::nullopt,
                                     "expected_weight_version", snapshot->description));
  return snapshot;
}

// UploadHead: a header, then the weight rows (and bias rows) in order, assembled on the CPU;
// the head is created only when every row arrived. A failed or cancelled upload creates
// nothing.
class UploadReactor final : public grpc::ServerReadReactor<v1::UploadHeadRequest> {
 public:
  UploadReactor(grpc::CallbackServerContext* context, ServiceContext* service,
                v1::HeadInfo* response)
      : context_(context), service_(*service), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {
      Finish(ToGrpcStatus(absl::CancelledError("cancelled by the client")));
      return;
    }
    absl::Status status;
    try {
      status = ok ? OnMessage() : Complete();
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
    }
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
    } else if (ok) {
      StartRead(&request_);
    } else {
      Finish(grpc::Status::OK);
    }
  }

  void OnDone() override { delete this; }
  ~UploadReactor() override { service_.admission.Release(buffer_ticket_); }

 private:
  absl::Status OnMessage() {
    switch (request_.part_case()) {
      case v1::UploadHeadRequest::kHeader:
        return OnHeader(request_.header());
      case v1::UploadHeadRequest::kWeightRows:
        if (!weight_) return NoHeaderYet("weight_rows");
        return weight_->Add(request_.weight_rows());
      case v1::UploadHeadRequest::kBiasRows:
        if (!header_) return NoHeaderYet("bias_rows");
        if (!bias_) {
          return absl::InvalidArgumentError(
              "bias_rows: expected none (header.has_bias is false); got bias rows");
        }
        return bias_->Add(request_.bias_rows());
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
    if (h.replace()) {
      RETURN_IF_ERROR(service_.local.CheckReplaceKeepsFrozen(h.head_id(), h.frozen()));
    }
    ASSIGN_OR_RETURN(const torch::ScalarType dtype, wire::FromWireDtype(h.dtype(), "header"));
    // Sizes checked, and the CPU buffer the rows are assembled in reserved in the memory budget,
    // before anything is allocated.
    RETURN_IF_ERROR(core::HeadMemoryBytes(h.vocab_size(), h.hidden_size(), dtype, h.has_bias(),
                                          torch::kFloat, "header.")
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

  absl::Status Complete() {
    if (!header_) return absl::InvalidArgumentError("header: the upload ended without one");
    if (!weight_->CheckComplete().ok() || (bias_ && !bias_->CheckComplete().ok())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight_rows, bias_rows: expected ", header_->vocab_size(), " rows each; got ",
          weight_->rows_received(), " and ", bias_ ? bias_->rows_received() : 0));
    }
    ASSIGN_OR_RETURN(const HeadDescription d,
                     service_.operations.AddUploaded(header_->head_id(), weight_->tensor(),
                                                     bias_ ? bias_->tensor() : torch::Tensor(),
                                                     header_->replace(), header_->frozen()));
    return ToWire(d, response_);
  }

  grpc::CallbackServerContext* context_;
  ServiceContext& service_;
  v1::HeadInfo* response_;
  v1::UploadHeadRequest request_;
  std::optional<v1::UploadHeadRequest::UploadHeader> header_;
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
