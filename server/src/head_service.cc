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

// Streams a snapshot of a head's accumulated dW (then db) as row chunks, then the HeadInfo the
// snapshot belongs to. One message is built per OnWriteDone, so only the snapshot is held.
class FetchGradientsReactor final : public grpc::ServerWriteReactor<v1::FetchGradientsResponse> {
 public:
  FetchGradientsReactor(HeadRegistry* registry, const v1::FetchGradientsRequest& request,
                        int64_t chunk_bytes) {
    const absl::Status status = Start(registry, request, chunk_bytes);
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  struct Piece {
    bool bias;
    int64_t offset;
    int64_t rows;
  };

  absl::Status Start(HeadRegistry* registry, const v1::FetchGradientsRequest& request,
                     int64_t chunk_bytes) {
    ASSIGN_OR_RETURN(auto entry, registry->Get(request.head_id()));
    std::optional<torch::ScalarType> dtype;
    if (request.dtype() != v1::DTYPE_UNSPECIFIED) {
      ASSIGN_OR_RETURN(dtype, FromWireDtype(request.dtype(), "dtype"));
    }
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      const core::GradientBuffers& g = entry->head->grads();
      const torch::ScalarType out = dtype.value_or(g.weight.scalar_type());
      weight_ = g.weight.to(torch::kCPU, out, /*non_blocking=*/false, /*copy=*/true);
      if (g.bias.defined()) bias_ = g.bias.to(torch::kCPU, out, false, true);
    }
    RETURN_IF_ERROR(DescribeInto(*entry, &info_));
    for (const auto& [offset, rows] :
         PlanRowChunks(weight_.size(0), weight_.size(1) * weight_.element_size(), chunk_bytes)) {
      pieces_.push_back({false, offset, rows});
    }
    if (bias_.defined()) {
      for (const auto& [offset, rows] :
           PlanRowChunks(bias_.size(0), bias_.element_size(), chunk_bytes)) {
        pieces_.push_back({true, offset, rows});
      }
    }
    return absl::OkStatus();
  }

  void WriteNext() {
    response_.Clear();
    if (next_ < pieces_.size()) {
      const Piece& p = pieces_[next_++];
      v1::TensorChunk* chunk =
          p.bias ? response_.mutable_bias_grad_rows() : response_.mutable_weight_grad_rows();
      chunk->set_row_offset(p.offset);
      const absl::Status s = EncodeTensor((p.bias ? bias_ : weight_).narrow(0, p.offset, p.rows),
                                          chunk->mutable_values());
      if (!s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
      StartWrite(&response_);
    } else if (!info_sent_) {
      info_sent_ = true;
      *response_.mutable_info() = info_;
      StartWriteAndFinish(&response_, {}, grpc::Status::OK);
    }
  }

  torch::Tensor weight_;
  torch::Tensor bias_;
  v1::HeadInfo info_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool info_sent_ = false;
  v1::FetchGradientsResponse response_;
};

}  // namespace

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
  return new FetchGradientsReactor(registry_, *request, options_.response_chunk_bytes);
}

}  // namespace remotehead::server
