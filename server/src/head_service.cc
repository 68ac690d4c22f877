#include "remotehead/server/head_service.h"

#include <deque>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/status_mapping.h"
#include "remotehead/server/tensor_codec.h"
#include "step_session.h"

namespace remotehead::server {
namespace {

absl::Status DescribeInto(HeadEntry& entry, v1::HeadInfo* info) {
  std::lock_guard<std::mutex> lock(entry.mu);
  const core::Head& head = *entry.head;
  info->set_head_id(entry.id);
  info->set_vocab_size(head.vocab_size());
  info->set_hidden_size(head.hidden_size());
  ASSIGN_OR_RETURN(const v1::DType dtype, ToWireDtype(head.dtype()));
  info->set_dtype(dtype);
  info->set_has_bias(head.has_bias());
  info->set_device(head.device().str());
  info->set_weight_version(head.version());
  info->set_accumulated_micro_batches(static_cast<int64_t>(entry.applied.size()));
  return absl::OkStatus();
}

// Runs `fn` (returning absl::Status) and finishes a unary call with its status. No exception
// escapes a handler: anything thrown becomes INTERNAL with its message.
template <typename Fn>
grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, Fn&& fn) {
  absl::Status status;
  try {
    status = fn();
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One ForwardBackward / Forward / Backward call. Messages are handled in order: read one, compute,
// write what it produced (one write in flight at a time: back-pressure through OnWriteDone), then
// read the next. A failed request finishes with its status and commits nothing (StepSession).
class StepReactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  StepReactor(grpc::CallbackServerContext* context, HeadRegistry* registry, StepSession::Mode mode,
              const ServiceOptions& options)
      : context_(context), session_(registry, mode, options.response_chunk_bytes) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    std::vector<v1::StepResponse> produced;
    absl::Status status;
    try {
      if (!ok) {
        if (context_->IsCancelled()) {
          Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
          return;
        }
        status = session_.OnClientDone(&produced);
        finishing_ = true;
      } else {
        status = session_.OnRequest(request_, &produced);
      }
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
    }
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    for (auto& r : produced) pending_.push_back(std::move(r));
    WriteNextOrContinue();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    pending_.pop_front();
    WriteNextOrContinue();
  }

  void OnDone() override { delete this; }

 private:
  void WriteNextOrContinue() {
    if (!pending_.empty()) {
      StartWrite(&pending_.front());
    } else if (finishing_) {
      Finish(grpc::Status::OK);
    } else {
      StartRead(&request_);
    }
  }

  grpc::CallbackServerContext* context_;
  StepSession session_;
  v1::StepRequest request_;
  std::deque<v1::StepResponse> pending_;
  bool finishing_ = false;
};

// A snapshot of a head's [V, D] matrix and optional [V] vector (weights or gradients), taken
// under the head's lock, copied to the CPU in the requested dtype (default: as stored).
struct Snapshot {
  torch::Tensor matrix;
  torch::Tensor vector;
  v1::HeadInfo info;
};

absl::StatusOr<Snapshot> TakeSnapshot(HeadRegistry* registry, const std::string& head_id,
                                      v1::DType wire_dtype, bool gradients) {
  ASSIGN_OR_RETURN(auto entry, registry->Get(head_id));
  std::optional<torch::ScalarType> dtype;
  if (wire_dtype != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(dtype, FromWireDtype(wire_dtype, "dtype"));
  }
  Snapshot snapshot;
  {
    std::lock_guard<std::mutex> lock(entry->mu);
    const core::Head& head = *entry->head;
    const torch::Tensor& m = gradients ? head.grads().weight : head.weight();
    const torch::Tensor& v = gradients ? head.grads().bias : head.bias();
    const torch::ScalarType out = dtype.value_or(m.scalar_type());
    snapshot.matrix = m.to(torch::kCPU, out, /*non_blocking=*/false, /*copy=*/true);
    if (v.defined()) snapshot.vector = v.to(torch::kCPU, out, false, true);
  }
  RETURN_IF_ERROR(DescribeInto(*entry, &snapshot.info));
  return snapshot;
}

// Streams a Snapshot as row chunks — the matrix, then the vector — and, when `info_field` is
// given, the HeadInfo last. One message is built per OnWriteDone, so only the snapshot is held.
template <typename Response>
class SnapshotStreamReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  using ChunkField = v1::TensorChunk* (Response::*)();
  using InfoField = v1::HeadInfo* (Response::*)();

  SnapshotStreamReactor(absl::StatusOr<Snapshot> snapshot, int64_t chunk_bytes,
                        ChunkField matrix_field, ChunkField vector_field, InfoField info_field)
      : matrix_field_(matrix_field), vector_field_(vector_field), info_field_(info_field) {
    if (!snapshot.ok()) {
      this->Finish(ToGrpcStatus(snapshot.status()));
      return;
    }
    snapshot_ = *std::move(snapshot);
    const torch::Tensor& m = snapshot_.matrix;
    for (const auto& [offset, rows] :
         PlanRowChunks(m.size(0), m.size(1) * m.element_size(), chunk_bytes)) {
      pieces_.push_back({false, offset, rows});
    }
    if (snapshot_.vector.defined()) {
      const torch::Tensor& v = snapshot_.vector;
      for (const auto& [offset, rows] : PlanRowChunks(v.size(0), v.element_size(), chunk_bytes)) {
        pieces_.push_back({true, offset, rows});
      }
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      this->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  struct Piece {
    bool vector;
    int64_t offset;
    int64_t rows;
  };

  void WriteNext() {
    response_.Clear();
    if (next_ < pieces_.size()) {
      const Piece& p = pieces_[next_++];
      v1::TensorChunk* chunk = (response_.*(p.vector ? vector_field_ : matrix_field_))();
      chunk->set_row_offset(p.offset);
      const torch::Tensor& source = p.vector ? snapshot_.vector : snapshot_.matrix;
      const absl::Status s =
          EncodeTensor(source.narrow(0, p.offset, p.rows), chunk->mutable_values());
      if (!s.ok()) {
        this->Finish(ToGrpcStatus(s));
        return;
      }
      this->StartWrite(&response_);
    } else if (info_field_ != nullptr && !info_sent_) {
      info_sent_ = true;
      *(response_.*info_field_)() = snapshot_.info;
      this->StartWriteAndFinish(&response_, {}, grpc::Status::OK);
    } else {
      this->Finish(grpc::Status::OK);
    }
  }

  ChunkField matrix_field_;
  ChunkField vector_field_;
  InfoField info_field_;
  Snapshot snapshot_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool info_sent_ = false;
  Response response_;
};

// UploadHead: a header, then the weight rows (and bias rows) in order, assembled on the CPU;
// the head is created only when every row arrived. A failed or cancelled upload creates
// nothing.
class UploadReactor final : public grpc::ServerReadReactor<v1::UploadHeadRequest> {
 public:
  UploadReactor(grpc::CallbackServerContext* context, HeadRegistry* registry,
                const ServiceOptions& options, v1::HeadInfo* response)
      : context_(context), registry_(registry), options_(options), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
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

 private:
  absl::Status OnMessage() {
    switch (request_.part_case()) {
      case v1::UploadHeadRequest::kHeader: {
        if (header_) {
          return absl::InvalidArgumentError("header: expected exactly one header; got a second");
        }
        const auto& h = request_.header();
        if (h.vocab_size() < 1 || h.hidden_size() < 1) {
          return absl::InvalidArgumentError(
              absl::StrCat("header.vocab_size, header.hidden_size: expected >= 1; got ",
                           h.vocab_size(), ", ", h.hidden_size()));
        }
        ASSIGN_OR_RETURN(const torch::ScalarType dtype, FromWireDtype(h.dtype(), "header.dtype"));
        header_ = h;
        weight_ = torch::empty({h.vocab_size(), h.hidden_size()}, torch::TensorOptions(dtype));
        if (h.has_bias()) bias_ = torch::empty({h.vocab_size()}, torch::TensorOptions(dtype));
        return absl::OkStatus();
      }
      case v1::UploadHeadRequest::kWeightRows:
        return AddRows(request_.weight_rows(), "weight_rows", weight_, &next_weight_row_);
      case v1::UploadHeadRequest::kBiasRows:
        if (header_ && !header_->has_bias()) {
          return absl::InvalidArgumentError(
              "bias_rows: expected none (header.has_bias is false); got bias rows");
        }
        return AddRows(request_.bias_rows(), "bias_rows", bias_, &next_bias_row_);
      default:
        return absl::InvalidArgumentError("part: expected header, weight_rows or bias_rows");
    }
  }

  absl::Status AddRows(const v1::TensorChunk& chunk, const std::string& field,
                       torch::Tensor& target, int64_t* next_row) {
    if (!header_) {
      return absl::InvalidArgumentError(
          absl::StrCat("header: expected the first message to be the header; got ", field));
    }
    if (chunk.row_offset() != *next_row) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".row_offset: expected ", *next_row,
                                                     " (rows arrive in order); got ",
                                                     chunk.row_offset()));
    }
    ASSIGN_OR_RETURN(torch::Tensor values, DecodeTensor(chunk.values(), field + ".values"));
    const int64_t rows = values.dim() >= 1 ? values.size(0) : 0;
    std::vector<int64_t> expected = target.sizes().vec();
    expected[0] = rows;
    if (values.scalar_type() != target.scalar_type() || values.sizes().vec() != expected ||
        *next_row + rows > target.size(0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".values: expected ", c10::toString(target.scalar_type()), " ",
                       c10::str(c10::IntArrayRef(expected)), " within ", target.size(0),
                       " rows; got ", c10::toString(values.scalar_type()), " ",
                       c10::str(values.sizes()), " at row ", *next_row));
    }
    target.narrow(0, *next_row, rows).copy_(values);
    *next_row += rows;
    return absl::OkStatus();
  }

  absl::Status Complete() {
    if (!header_) return absl::InvalidArgumentError("header: the upload ended without one");
    if (next_weight_row_ != weight_.size(0) ||
        (bias_.defined() && next_bias_row_ != bias_.size(0))) {
      return absl::InvalidArgumentError(absl::StrCat("weight_rows, bias_rows: expected ",
                                                     weight_.size(0), " rows each; got ",
                                                     next_weight_row_, " and ", next_bias_row_));
    }
    ASSIGN_OR_RETURN(auto head,
                     core::Head::FromTensors(weight_, bias_, {.device = options_.device}));
    ASSIGN_OR_RETURN(auto entry, registry_->Add(header_->head_id(), std::move(head)));
    return DescribeInto(*entry, response_);
  }

  grpc::CallbackServerContext* context_;
  HeadRegistry* registry_;
  ServiceOptions options_;
  v1::HeadInfo* response_;
  v1::UploadHeadRequest request_;
  std::optional<v1::UploadHeadRequest::UploadHeader> header_;
  torch::Tensor weight_, bias_;
  int64_t next_weight_row_ = 0;
  int64_t next_bias_row_ = 0;
};

}  // namespace

grpc::ServerReadReactor<v1::UploadHeadRequest>* HeadServiceImpl::UploadHead(
    grpc::CallbackServerContext* context, v1::HeadInfo* response) {
  return new UploadReactor(context, registry_, options_, response);
}

grpc::ServerUnaryReactor* HeadServiceImpl::CreateHead(grpc::CallbackServerContext* context,
                                                      const v1::CreateHeadRequest* request,
                                                      v1::HeadInfo* response) {
  return Unary(context, [&]() -> absl::Status {
    std::optional<torch::ScalarType> requested_dtype;
    if (request->dtype() != v1::DTYPE_UNSPECIFIED) {
      ASSIGN_OR_RETURN(requested_dtype, FromWireDtype(request->dtype(), "dtype"));
    }
    if (request->source_case() == v1::CreateHeadRequest::kSafetensors) {
      const auto& src = request->safetensors();
      const std::string weight_name =
          src.weight_name().empty() ? "lm_head.weight" : src.weight_name();
      ASSIGN_OR_RETURN(torch::Tensor weight, core::ReadSafetensor(src.path(), weight_name));
      torch::Tensor bias;
      if (!src.bias_name().empty()) {
        ASSIGN_OR_RETURN(bias, core::ReadSafetensor(src.path(), src.bias_name()));
      }
      if (requested_dtype) {
        weight = weight.to(*requested_dtype);
        if (bias.defined()) bias = bias.to(*requested_dtype);
      }
      ASSIGN_OR_RETURN(auto head,
                       core::Head::FromTensors(weight, bias, {.device = options_.device}));
      ASSIGN_OR_RETURN(auto entry, registry_->Add(request->head_id(), std::move(head)));
      return DescribeInto(*entry, response);
    }
    if (request->source_case() != v1::CreateHeadRequest::kInit) {
      return absl::InvalidArgumentError("source: expected safetensors or init; got none");
    }
    const auto& init = request->init();
    const torch::ScalarType dtype = requested_dtype.value_or(torch::kFloat);
    core::HeadInit head_init{.vocab_size = init.vocab_size(),
                             .hidden_size = init.hidden_size(),
                             .dtype = dtype,
                             .bias = init.bias(),
                             .seed = init.seed()};
    if (init.init_std() != 0) head_init.init_std = init.init_std();
    ASSIGN_OR_RETURN(auto head, core::Head::Initialize(head_init, {.device = options_.device}));
    ASSIGN_OR_RETURN(auto entry, registry_->Add(request->head_id(), std::move(head)));
    return DescribeInto(*entry, response);
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::SaveWeights(grpc::CallbackServerContext* context,
                                                       const v1::SaveWeightsRequest* request,
                                                       v1::SaveWeightsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    std::map<std::string, torch::Tensor> tensors;
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      tensors[request->weight_name().empty() ? "lm_head.weight" : request->weight_name()] =
          entry->head->weight().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
      if (entry->head->has_bias()) {
        tensors[request->bias_name().empty() ? "lm_head.bias" : request->bias_name()] =
            entry->head->bias().to(torch::kCPU, false, true);
      }
    }
    ASSIGN_OR_RETURN(const int64_t bytes, core::WriteSafetensors(request->path(), tensors));
    response->set_bytes_written(bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::DescribeHead(grpc::CallbackServerContext* context,
                                                        const v1::HeadRef* request,
                                                        v1::HeadInfo* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    return DescribeInto(*entry, response);
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::ListHeads(grpc::CallbackServerContext* context,
                                                     const v1::ListHeadsRequest*,
                                                     v1::ListHeadsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    for (const auto& entry : registry_->List()) {
      RETURN_IF_ERROR(DescribeInto(*entry, response->add_heads()));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::DropHead(grpc::CallbackServerContext* context,
                                                    const v1::HeadRef* request,
                                                    v1::DropHeadResponse*) {
  return Unary(context, [&] { return registry_->Drop(request->head_id()); });
}

grpc::ServerUnaryReactor* HeadServiceImpl::ZeroGradients(grpc::CallbackServerContext* context,
                                                         const v1::HeadRef* request,
                                                         v1::ZeroGradientsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      entry->head->ZeroGrad();
      entry->applied.clear();  // a new accumulation window: ids may be reused
    }
    return DescribeInto(*entry, response->mutable_info());
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::OptimizerStep(grpc::CallbackServerContext* context,
                                                         const v1::OptimizerStepRequest* request,
                                                         v1::OptimizerStepResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    const double grad_scale = request->has_grad_scale() ? request->grad_scale() : 1.0;
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      core::Head& head = *entry->head;
      switch (request->optimizer_case()) {
        case v1::OptimizerStepRequest::kSgd: {
          const auto& o = request->sgd();
          RETURN_IF_ERROR(core::SgdStep(
              head, {.lr = o.lr(), .momentum = o.momentum(), .weight_decay = o.weight_decay()},
              grad_scale, &entry->optimizer));
          break;
        }
        case v1::OptimizerStepRequest::kAdamw: {
          const auto& o = request->adamw();
          core::AdamWOptions options{.lr = o.lr()};
          // Unset (0) hyper-parameters take torch.optim.AdamW's defaults.
          if (o.beta1() != 0) options.beta1 = o.beta1();
          if (o.beta2() != 0) options.beta2 = o.beta2();
          if (o.eps() != 0) options.eps = o.eps();
          options.weight_decay = o.weight_decay();
          RETURN_IF_ERROR(core::AdamWStep(head, options, grad_scale, &entry->optimizer));
          break;
        }
        default:
          return absl::InvalidArgumentError("optimizer: expected sgd or adamw; got none");
      }
      if (request->zero_gradients()) {
        head.ZeroGrad();
        entry->applied.clear();
      }
    }
    return DescribeInto(*entry, response->mutable_info());
  });
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* HeadServiceImpl::ForwardBackward(
    grpc::CallbackServerContext* context) {
  return new StepReactor(context, registry_, StepSession::Mode::kFused, options_);
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* HeadServiceImpl::Forward(
    grpc::CallbackServerContext* context) {
  return new StepReactor(context, registry_, StepSession::Mode::kForward, options_);
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* HeadServiceImpl::Backward(
    grpc::CallbackServerContext* context) {
  return new StepReactor(context, registry_, StepSession::Mode::kBackward, options_);
}

grpc::ServerWriteReactor<v1::FetchGradientsResponse>* HeadServiceImpl::FetchGradients(
    grpc::CallbackServerContext*, const v1::FetchGradientsRequest* request) {
  using R = v1::FetchGradientsResponse;
  return new SnapshotStreamReactor<R>(
      TakeSnapshot(registry_, request->head_id(), request->dtype(), /*gradients=*/true),
      options_.response_chunk_bytes, &R::mutable_weight_grad_rows, &R::mutable_bias_grad_rows,
      &R::mutable_info);
}

grpc::ServerWriteReactor<v1::ExportWeightsResponse>* HeadServiceImpl::ExportWeights(
    grpc::CallbackServerContext*, const v1::ExportWeightsRequest* request) {
  using R = v1::ExportWeightsResponse;
  return new SnapshotStreamReactor<R>(
      TakeSnapshot(registry_, request->head_id(), request->dtype(), /*gradients=*/false),
      options_.response_chunk_bytes, &R::mutable_weight_rows, &R::mutable_bias_rows, nullptr);
}

}  // namespace remotehead::server
