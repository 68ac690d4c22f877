// The calls on a head as a whole: its lifecycle (create, upload, describe, list, drop), its
// weights and gradients streamed out or saved on the server, and the server-side optimizer step.
#include <algorithm>
#include <memory>
#include <optional>
#include <variant>

#include "absl/strings/str_cat.h"
#include "client_impl.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"
#include "stream.h"

namespace remotehead::client {
namespace {

using internal::BrokenResponse;
using internal::FromGrpc;
using internal::ReadStream;
using internal::ResponseRows;
using internal::ShapeOf;
using internal::Stub;

absl::StatusOr<HeadInfo> FromWire(const v1::HeadInfo& wire) {
  HeadInfo info;
  info.head_id = wire.head_id();
  info.vocab_size = wire.vocab_size();
  info.hidden_size = wire.hidden_size();
  ASSIGN_OR_RETURN(info.dtype, BrokenResponse(wire::FromWireDtype(wire.dtype(), "info")));
  info.has_bias = wire.has_bias();
  info.device = wire.device();
  info.weight_version = wire.weight_version();
  info.accumulated_micro_batches = wire.accumulated_micro_batches();
  info.incarnation = wire.incarnation();
  info.state_id = wire.state_id();
  info.group_size = std::max(1, wire.group_size());
  for (const v1::ShardRange& shard : wire.shards()) {
    info.shards.emplace_back(shard.offset(), shard.rows());
  }
  info.frozen = wire.frozen();
  info.teacher_of.assign(wire.teacher_of().begin(), wire.teacher_of().end());
  if (wire.grad_dtype() != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(info.grad_dtype,
                     BrokenResponse(wire::FromWireDtype(wire.grad_dtype(), "info.grad_dtype")));
  }
  return info;
}

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

// The shape and dtype of a head, read inside an attempt (with that attempt's deadline) before
// its weights or gradients are streamed into tensors allocated from them.
absl::StatusOr<HeadInfo> DescribeForStream(Stub& stub, const grpc::ClientContext& attempt_context,
                                           const std::string& head_id) {
  grpc::ClientContext context;
  context.set_deadline(attempt_context.deadline());
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::HeadInfo info;
  RETURN_IF_ERROR(FromGrpc(stub.DescribeHead(&context, ref, &info)));
  return FromWire(info);
}

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

}  // namespace

absl::StatusOr<HeadInfo> Client::CreateHead(const std::string& head_id, const InitSpec& init) {
  v1::CreateHeadRequest request;
  request.set_head_id(head_id);
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(init.dtype, "init.dtype"));
  request.set_dtype(dtype);
  v1::CreateHeadRequest::FromInit* wire_init = request.mutable_init();
  wire_init->set_vocab_size(init.vocab_size);
  wire_init->set_hidden_size(init.hidden_size);
  wire_init->set_bias(init.bias);
  wire_init->set_seed(init.seed);
  wire_init->set_init_std(init.init_std);
  request.set_frozen(init.frozen);
  RETURN_IF_ERROR(SetGradDtype(init.grad_dtype, "init.grad_dtype", &request));
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->ToLeader(
      [&](Stub* on) { return impl_->Unary("CreateHead", &Stub::CreateHead, request, &info, on); }));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::CreateHead(const std::string& head_id,
                                            const SafetensorsSource& source) {
  v1::CreateHeadRequest request;
  request.set_head_id(head_id);
  if (source.dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(*source.dtype, "source.dtype"));
    request.set_dtype(dtype);
  }
  request.mutable_safetensors()->set_path(source.path);
  request.mutable_safetensors()->set_weight_name(source.weight_name);
  request.mutable_safetensors()->set_bias_name(source.bias_name);
  request.set_frozen(source.frozen);
  RETURN_IF_ERROR(SetGradDtype(source.grad_dtype, "source.grad_dtype", &request));
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->ToLeader(
      [&](Stub* on) { return impl_->Unary("CreateHead", &Stub::CreateHead, request, &info, on); }));
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
  RETURN_IF_ERROR(impl_->ToLeader([&](Stub* on) {
    return impl_->WithRetries("UploadHead", [&](grpc::ClientContext* context) {
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
  RETURN_IF_ERROR(impl_->Unary("DescribeHead", &Stub::DescribeHead, ref, &info));
  return FromWire(info);
}

absl::StatusOr<std::vector<HeadInfo>> Client::ListHeads() {
  v1::ListHeadsResponse response;
  RETURN_IF_ERROR(impl_->Unary("ListHeads", &Stub::ListHeads, v1::ListHeadsRequest(), &response));
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
  return impl_->ToLeader(
      [&](Stub* on) { return impl_->Unary("DropHead", &Stub::DropHead, ref, &response, on); });
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
  RETURN_IF_ERROR(impl_->WithRetries("ExportWeights", [&](grpc::ClientContext* context) {
    return ReadHeadRows(
        *impl_->stub, &Stub::ExportWeights, request, context, dtype,
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
  RETURN_IF_ERROR(impl_->Unary("SaveWeights", &Stub::SaveWeights, request, &response));
  return response.bytes_written();
}

absl::StatusOr<HeadInfo> Client::SaveHeadState(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::HeadStateInfo response;
  RETURN_IF_ERROR(impl_->ToLeader([&](Stub* on) {
    return impl_->Unary("SaveHeadState", &Stub::SaveHeadState, ref, &response, on);
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
  RETURN_IF_ERROR(impl_->ToLeader([&](Stub* on) {
    return impl_->Unary("RestoreHeadState", &Stub::RestoreHeadState, request, &info, on);
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
  RETURN_IF_ERROR(impl_->ToLeader([&](Stub* on) {
    return impl_->WithRetries("FetchGradients", [&](grpc::ClientContext* context) {
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
  RETURN_IF_ERROR(impl_->ToLeader([&](Stub* on) {
    return impl_->Unary("ZeroGradients", &Stub::ZeroGradients, ref, &response, on);
  }));
  return FromWire(response.info());
}

absl::StatusOr<HeadInfo> Client::OptimizerStep(const std::string& head_id,
                                               const OptimizerStepOptions& options) {
  v1::OptimizerStepRequest request;
  request.set_head_id(head_id);
  if (const Sgd* sgd = std::get_if<Sgd>(&options.optimizer)) {
    request.mutable_sgd()->set_lr(sgd->lr);
    request.mutable_sgd()->set_momentum(sgd->momentum);
    request.mutable_sgd()->set_weight_decay(sgd->weight_decay);
  } else {
    const AdamW& adamw = std::get<AdamW>(options.optimizer);
    request.mutable_adamw()->set_lr(adamw.lr);
    request.mutable_adamw()->set_beta1(adamw.beta1);
    request.mutable_adamw()->set_beta2(adamw.beta2);
    request.mutable_adamw()->set_eps(adamw.eps);
    request.mutable_adamw()->set_weight_decay(adamw.weight_decay);
  }
  if (options.grad_scale.has_value()) request.set_grad_scale(*options.grad_scale);
  request.set_zero_gradients(options.zero_gradients);
  request.set_expected_incarnation(options.expected_incarnation);
  if (options.expected_weight_version.has_value()) {
    request.set_expected_weight_version(*options.expected_weight_version);
  }
  if (options.synchronous.has_value()) {
    v1::SynchronousStep* sync = request.mutable_synchronous();
    sync->set_step(options.synchronous->step);
    sync->set_rank(options.synchronous->rank);
    sync->set_world_size(options.synchronous->world_size);
  }

  v1::OptimizerStepResponse response;
  // A synchronous step goes to this trainer's own replica; a single caller's, which changes
  // every replica of a mesh, to the leader.
  const auto run = [&](Stub* on) -> absl::Status {
    Impl::AlreadyDone already_done;
    int64_t version_before = 0;
    // A synchronous step needs no check before a retry: the server answers a retry of a step
    // it applied with that step's own HeadInfo, the same as every rank got — which a
    // DescribeHead after the fact is not (the other ranks may have added the next step's dW
    // meanwhile).
    if (options_.retry.max_attempts > 1 && !options.synchronous.has_value()) {
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
    return impl_->WithRetries(
        "OptimizerStep",
        [&](grpc::ClientContext* context) {
          response.Clear();
          return FromGrpc(on->OptimizerStep(context, request, &response));
        },
        already_done);
  };
  RETURN_IF_ERROR(options.synchronous.has_value() ? run(impl_->stub.get()) : impl_->ToLeader(run));
  return FromWire(response.info());
}

namespace {

// Token ids as the wire's repeated int64: INVALID_ARGUMENT naming `field` unless int64 [n].
absl::Status SetIds(const torch::Tensor& ids, const char* field,
                    google::protobuf::RepeatedField<int64_t>* out) {
  if (!ids.defined() || ids.dim() != 1 || ids.scalar_type() != torch::kLong) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected int64 token ids [n]; got ",
                                                   ids.defined() ? ShapeOf(ids) : "none"));
  }
  const torch::Tensor cpu = ids.cpu().contiguous();
  out->Add(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
  return absl::OkStatus();
}

}  // namespace

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
  RETURN_IF_ERROR(impl_->WithRetries("EmbeddingLookup", [&](grpc::ClientContext* context) {
    ASSIGN_OR_RETURN(const HeadInfo head, DescribeForStream(*impl_->stub, *context, head_id));
    result.rows = torch::empty({ids.size(0), head.hidden_size}, dtype.value_or(head.dtype));
    ResponseRows rows(result.rows, "rows");
    auto reader = impl_->stub->EmbeddingLookup(context, request);
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
  }));
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
  RETURN_IF_ERROR(impl_->WithRetries("EmbeddingGradient", [&](grpc::ClientContext* context) {
    response.Clear();
    auto writer = impl_->stub->EmbeddingGradient(context, &response);
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
