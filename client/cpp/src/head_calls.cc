// The calls on a head as a whole: its lifecycle (create, upload, describe, list, drop), its
// weights and gradients streamed out or saved on the server, and the server-side optimizer step.
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client_impl.h"
#include "head_messages.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"
#include "stream.h"

namespace remotehead::client {
namespace {

using internal::DescribeForStream;
using internal::FromGrpc;
using internal::FromWire;
using internal::ReadHeadRows;
using internal::ReadStream;
using internal::RequestDtype;
using internal::ResponseRows;
using internal::SetGradDtype;
using internal::SetIds;
using internal::ShapeOf;
using internal::Stub;
using internal::ToCreateRequest;
using internal::ToOptimizerStepRequest;
using internal::WriteRowChunks;

}  // namespace

absl::StatusOr<HeadInfo> Client::CreateHead(const std::string& head_id, const InitSpec& init) {
  ASSIGN_OR_RETURN(const v1::CreateHeadRequest request, ToCreateRequest(head_id, init));
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("CreateHead", &Stub::CreateHead, request, &info, on);
  }));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::CreateHead(const std::string& head_id,
                                            const SafetensorsSource& source) {
  ASSIGN_OR_RETURN(const v1::CreateHeadRequest request, ToCreateRequest(head_id, source));
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("CreateHead", &Stub::CreateHead, request, &info, on);
  }));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::UploadHead(const std::string& head_id, const torch::Tensor& weight,
                                            const torch::Tensor& bias,
                                            const UploadOptions& options) {
  if (!weight.defined() || weight.dim() != 2 || !c10::isFloatingType(weight.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight: expected a floating [V, D] tensor; got ",
                     weight.defined() ? ShapeOf(weight) : "none"));
  }
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(weight.scalar_type(), "weight"));
  const int64_t vocab = weight.size(0);
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != vocab)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bias: expected shape [", vocab, "]; got ", ShapeOf(bias)));
  }
  const torch::Tensor w = wire::ToWireLayout(weight);
  // The server stores the bias in the head's (weight's) dtype.
  const torch::Tensor b = bias.defined() ? wire::ToWireLayout(bias, w.scalar_type()) : bias;
  ASSIGN_OR_RETURN(const auto weight_chunks,
                   wire::PlanRequestChunks(vocab, w.size(1) * w.element_size(),
                                           wire::FramingBytes(1, 0), options_.chunk_bytes));
  std::vector<wire::RowRange> bias_chunks;
  if (b.defined()) {
    ASSIGN_OR_RETURN(bias_chunks,
                     wire::PlanRequestChunks(vocab, b.element_size(), wire::FramingBytes(1, 0),
                                             options_.chunk_bytes));
  }
  v1::UploadHeadRequest header;
  header.mutable_header()->set_head_id(head_id);
  header.mutable_header()->set_vocab_size(vocab);
  header.mutable_header()->set_hidden_size(w.size(1));
  header.mutable_header()->set_dtype(dtype);
  header.mutable_header()->set_has_bias(b.defined());
  header.mutable_header()->set_frozen(options.frozen);
  RETURN_IF_ERROR(SetGradDtype(options.grad_dtype, "options.grad_dtype", header.mutable_header()));
  header.mutable_header()->set_replace(options.replace);
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.WithRetries("UploadHead", [&](grpc::ClientContext* context) {
      info.Clear();
      auto writer = on->UploadHead(context, &info);
      using R = v1::UploadHeadRequest;
      const bool ok = writer->Write(header) &&
                      WriteRowChunks(*writer, w, weight_chunks, &R::mutable_weight_rows) &&
                      WriteRowChunks(*writer, b, bias_chunks, &R::mutable_bias_rows);
      if (ok) writer->WritesDone();
      return FromGrpc(writer->Finish());
    });
  }));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::DescribeHead(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::HeadInfo info;
  RETURN_IF_ERROR(
      impl_->channel.UnaryAtOwnFront("DescribeHead", head_id, &Stub::DescribeHead, ref, &info));
  return FromWire(info);
}

absl::StatusOr<std::vector<HeadInfo>> Client::ListHeads() {
  v1::ListHeadsResponse response;
  // Every replica of a mesh holds the same heads: any front that is there answers.
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("ListHeads", &Stub::ListHeads, v1::ListHeadsRequest(), &response,
                                on);
  }));
  std::vector<HeadInfo> heads;
  for (const v1::HeadInfo& wire_info : response.heads()) {
    ASSIGN_OR_RETURN(HeadInfo info, FromWire(wire_info));
    heads.push_back(std::move(info));
  }
  return heads;
}

absl::Status Client::DropHead(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::DropHeadResponse response;
  return impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("DropHead", &Stub::DropHead, ref, &response, on);
  });
}

absl::StatusOr<HeadWeights> Client::ExportWeights(const std::string& head_id,
                                                  std::optional<torch::ScalarType> dtype,
                                                  const ExportPin& pin) {
  v1::ExportWeightsRequest request;
  request.set_head_id(head_id);
  request.set_expected_incarnation(pin.expected_incarnation);
  if (pin.expected_weight_version.has_value()) {
    request.set_expected_weight_version(*pin.expected_weight_version);
  }
  RETURN_IF_ERROR(RequestDtype(dtype, &request));
  HeadWeights weights;
  RETURN_IF_ERROR(impl_->channel.WithRetries("ExportWeights", [&](grpc::ClientContext* context) {
    return ReadHeadRows(
        *impl_->channel.stub(), &Stub::ExportWeights, request, context, dtype,
        {&weights.weight, "weight_rows", &weights.bias, "bias_rows"},
        [](const v1::ExportWeightsResponse& response, ResponseRows& w, ResponseRows* b) {
          if (response.has_weight_rows()) return w.Add(response.weight_rows());
          if (response.has_bias_rows() && b != nullptr) return b->Add(response.bias_rows());
          return absl::InternalError("response: expected weight_rows or bias_rows");
        });
  }));
  return weights;
}

absl::StatusOr<int64_t> Client::SaveWeights(const std::string& head_id, const std::string& path,
                                            const std::string& weight_name,
                                            const std::string& bias_name) {
  v1::SaveWeightsRequest request;
  request.set_head_id(head_id);
  request.set_path(path);
  request.set_weight_name(weight_name);
  request.set_bias_name(bias_name);
  v1::SaveWeightsResponse response;
  RETURN_IF_ERROR(impl_->channel.Unary("SaveWeights", &Stub::SaveWeights, request, &response));
  return response.bytes_written();
}

absl::StatusOr<HeadInfo> Client::SaveHeadState(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::HeadStateInfo response;
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("SaveHeadState", &Stub::SaveHeadState, ref, &response, on);
  }));
  ASSIGN_OR_RETURN(HeadInfo info, FromWire(response.info()));
  // The state just written, whatever the info's field says of it: RestoreHeadState takes it.
  info.state_id = response.state_id();
  return info;
}

absl::StatusOr<HeadInfo> Client::RestoreHeadState(const std::string& head_id,
                                                  const std::string& state_id) {
  v1::RestoreHeadStateRequest request;
  request.set_head_id(head_id);
  request.set_state_id(state_id);
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("RestoreHeadState", &Stub::RestoreHeadState, request, &info, on);
  }));
  return FromWire(info);
}

absl::StatusOr<HeadGradients> Client::FetchGradients(const std::string& head_id,
                                                     std::optional<torch::ScalarType> dtype) {
  v1::FetchGradientsRequest request;
  request.set_head_id(head_id);
  RETURN_IF_ERROR(RequestDtype(dtype, &request));
  HeadGradients grads;
  // On a mesh, the leader sums every replica's dW (another front names it: NOT_THE_LEADER).
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.WithRetries("FetchGradients", [&](grpc::ClientContext* context) {
      bool have_info = false;
      // In the accumulators' dtype (HeadInfo::grad_dtype) unless asked for another.
      RETURN_IF_ERROR(
          ReadHeadRows(*on, &Stub::FetchGradients, request, context, dtype,
                       {&grads.weight_grad, "weight_grad_rows", &grads.bias_grad, "bias_grad_rows",
                        /*gradients=*/true},
                       [&](const v1::FetchGradientsResponse& response, ResponseRows& w,
                           ResponseRows* b) -> absl::Status {
                         if (response.has_weight_grad_rows())
                           return w.Add(response.weight_grad_rows());
                         if (response.has_bias_grad_rows() && b != nullptr) {
                           return b->Add(response.bias_grad_rows());
                         }
                         if (!response.has_info()) {
                           return absl::InternalError(
                               "response: expected weight_grad_rows, bias_grad_rows or info");
                         }
                         ASSIGN_OR_RETURN(grads.info, FromWire(response.info()));
                         have_info = true;
                         return absl::OkStatus();
                       }));
      if (!have_info) return absl::InternalError("info: the stream ended without one");
      return absl::OkStatus();
    });
  }));
  return grads;
}

absl::StatusOr<HeadInfo> Client::ZeroGradients(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::ZeroGradientsResponse response;
  RETURN_IF_ERROR(impl_->channel.ToLeader([&](Stub* on) {
    return impl_->channel.Unary("ZeroGradients", &Stub::ZeroGradients, ref, &response, on);
  }));
  return FromWire(response.info());
}

absl::StatusOr<HeadInfo> Client::OptimizerStep(const std::string& head_id,
                                               const OptimizerStepOptions& options) {
  const v1::OptimizerStepRequest request = ToOptimizerStepRequest(head_id, options);
  v1::OptimizerStepResponse response;
  // A synchronous step goes to this trainer's own replica (following the mesh when that replica
  // is evicted), retried as it is: the server answers a retry of a step it applied with that
  // step's own HeadInfo, the same as every rank got — which a DescribeHead after the fact is not
  // (the other ranks may have added the next step's dW meanwhile).
  if (options.synchronous.has_value()) {
    RETURN_IF_ERROR(impl_->channel.UnaryAtOwnFront("OptimizerStep", head_id, &Stub::OptimizerStep,
                                                   request, &response));
    return FromWire(response.info());
  }
  // A single caller's, which changes every replica of a mesh, to the leader.
  const auto run = [&](Stub* on) -> absl::Status {
    internal::Channel::AlreadyDone already_done;
    int64_t version_before = 0;
    if (options_.retry.max_attempts > 1) {
      ASSIGN_OR_RETURN(const HeadInfo before, DescribeHead(head_id));
      version_before = before.weight_version;
      already_done = [&](grpc::ClientContext* context) -> absl::StatusOr<bool> {
        v1::HeadRef ref;
        ref.set_head_id(head_id);
        v1::HeadInfo now;
        RETURN_IF_ERROR(FromGrpc(on->DescribeHead(context, ref, &now)));
        if (now.weight_version() <= version_before) return false;
        *response.mutable_info() = now;
        return true;
      };
    }
    return impl_->channel.WithRetries(
        "OptimizerStep",
        [&](grpc::ClientContext* context) {
          response.Clear();
          return FromGrpc(on->OptimizerStep(context, request, &response));
        },
        already_done);
  };
  RETURN_IF_ERROR(impl_->channel.ToLeader(run));
  return FromWire(response.info());
}

absl::StatusOr<EmbeddingRows> Client::EmbeddingLookup(const std::string& head_id,
                                                      const torch::Tensor& ids,
                                                      std::optional<torch::ScalarType> dtype,
                                                      const ExportPin& pin) {
  v1::EmbeddingLookupRequest request;
  request.set_head_id(head_id);
  RETURN_IF_ERROR(SetIds(ids, "ids", request.mutable_ids()));
  request.set_expected_incarnation(pin.expected_incarnation);
  if (pin.expected_weight_version.has_value()) {
    request.set_expected_weight_version(*pin.expected_weight_version);
  }
  RETURN_IF_ERROR(RequestDtype(dtype, &request));
  EmbeddingRows result;
  const auto attempt = [&](grpc::ClientContext* context) -> absl::Status {
    const std::shared_ptr<Stub> stub = impl_->channel.stub();
    ASSIGN_OR_RETURN(const HeadInfo head, DescribeForStream(*stub, *context, head_id));
    result.rows = torch::empty({ids.size(0), head.hidden_size}, dtype.value_or(head.dtype));
    ResponseRows rows(result.rows, "rows");
    auto reader = stub->EmbeddingLookup(context, request);
    RETURN_IF_ERROR(ReadStream<v1::EmbeddingLookupResponse>(
        context, *reader, [&](const v1::EmbeddingLookupResponse& response) -> absl::Status {
          if (response.has_rows()) return rows.Add(response.rows());
          if (response.has_info()) {
            result.weight_version = response.info().weight_version();
            return absl::OkStatus();
          }
          return absl::InternalError("response: expected rows or info");
        }));
    return rows.CheckComplete();
  };
  RETURN_IF_ERROR(impl_->channel.AtOwnFront("EmbeddingLookup", head_id, attempt));
  return result;
}

absl::StatusOr<EmbeddingGradientResult> Client::EmbeddingGradient(const std::string& head_id,
                                                                  const torch::Tensor& ids,
                                                                  const torch::Tensor& grad,
                                                                  const GradientId& gradient_id,
                                                                  const ExportPin& pin) {
  v1::EmbeddingGradientRequest header;
  v1::EmbeddingGradientRequest::Header* h = header.mutable_header();
  h->set_head_id(head_id);
  RETURN_IF_ERROR(SetIds(ids, "ids", h->mutable_ids()));
  // A gradient for rows the lookup did not read is refused here, before anything travels.
  if (!grad.defined() || grad.dim() != 2 || grad.size(0) != ids.size(0) ||
      !c10::isFloatingType(grad.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat("grad: expected a floating [", ids.size(0),
                                                   ", D] tensor (one row per id); got ",
                                                   grad.defined() ? ShapeOf(grad) : "none"));
  }
  h->mutable_gradient_id()->set_trainer(gradient_id.trainer);
  h->mutable_gradient_id()->set_step(gradient_id.step);
  h->mutable_gradient_id()->set_micro_batch(gradient_id.micro_batch);
  h->set_expected_incarnation(pin.expected_incarnation);
  if (pin.expected_weight_version.has_value()) {
    h->set_expected_weight_version(*pin.expected_weight_version);
  }
  const torch::Tensor rows = wire::ToWireLayout(grad);
  ASSIGN_OR_RETURN(const auto chunks,
                   wire::PlanRequestChunks(rows.size(0), rows.size(1) * rows.element_size(),
                                           wire::FramingBytes(1, 0), options_.chunk_bytes));
  v1::EmbeddingGradientResponse response;
  RETURN_IF_ERROR(
      impl_->channel.AtOwnFront("EmbeddingGradient", head_id, [&](grpc::ClientContext* context) {
        response.Clear();
        const std::shared_ptr<Stub> stub = impl_->channel.stub();
        auto writer = stub->EmbeddingGradient(context, &response);
        const bool ok =
            writer->Write(header) &&
            WriteRowChunks(*writer, rows, chunks, &v1::EmbeddingGradientRequest::mutable_grad_rows);
        if (ok) writer->WritesDone();
        return FromGrpc(writer->Finish());
      }));
  EmbeddingGradientResult result;
  result.replayed = response.replayed();
  ASSIGN_OR_RETURN(result.info, FromWire(response.info()));
  return result;
}

}  // namespace remotehead::client
