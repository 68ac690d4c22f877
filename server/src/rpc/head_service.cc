// The gRPC HeadService: one method per RPC of remotehead/v1/head_service.proto. Unary handlers
// are here and do three things only: protobuf → the server's types, one HeadOperations call,
// its result → protobuf (statuses through status_mapping). Streams are in step_reactor.cc
// (ForwardBackward, Forward, Backward) and stream_reactors.cc (UploadHead, ExportWeights,
// FetchGradients).
#include "remotehead/server/rpc/head_service.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "rpc/embedding_reactors.h"
#include "rpc/service_context.h"
#include "rpc/step_reactor.h"
#include "rpc/stream_reactors.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

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

// A streaming call refused before it starts (the server drains): answered at once.
template <class Reactor>
class RefusedReactor final : public Reactor {
 public:
  explicit RefusedReactor(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

// Unary for a call that trains or changes a head: refused once `service` does not serve
// (ServiceContext::Serving: its group or mesh is down) or drains (CallGate).
template <typename Fn>
grpc::ServerUnaryReactor* Training(grpc::CallbackServerContext* context,
                                   const ServiceContext& service, Fn&& fn) {
  if (absl::Status refused = service.gate.Admit(); !refused.ok()) {
    return Unary(context, [refused] { return refused; });
  }
  if (absl::Status down = service.Serving(); !down.ok()) {
    return Unary(context, [&] { return down; });
  }
  return Unary(context, std::forward<Fn>(fn));
}

// An optimizer step (plain or synchronous) of a frozen head: refused at once, nothing applied.
absl::Status CheckNotFrozen(const HeadDescription& head) {
  return head.frozen ? HeadFrozenError(head.id, "head_id", "an optimizer step") : absl::OkStatus();
}

// The answer of a handler that reports a head's state.
absl::Status Answer(const absl::StatusOr<HeadDescription>& result, v1::HeadInfo* info) {
  if (!result.ok()) return result.status();
  return ToWire(*result, info);
}

class HeadServiceImpl final : public HeadService, public v1::HeadService::CallbackService {
 public:
  HeadServiceImpl(HeadRegistry* registry, const ServiceOptions& options)
      : context_(std::make_unique<ServiceContext>(registry, options)) {
    // The step methods are served raw: their reactors parse requests and frame responses
    // themselves (step_reactor.h).
    ForEachStepMethod([this](int index, core::CallMode mode) {
      MarkMethodRawCallback(
          index,
          new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
              [this, mode](grpc::CallbackServerContext* context) { return Step(context, mode); }));
    });
    if (options.metrics != nullptr) options.metrics->set_admission(&context_->admission);
    // Once the group or mesh is down, the steps waiting here would wait for nothing.
    if (options.liveness != nullptr) {
      down_listener_ = options.liveness->OnDown([c = context_.get()](const absl::Status& verdict) {
        c->sync_steps.AbortAll(verdict);
        c->operations.mesh_steps().AbortWaiting(verdict, /*started=*/true);
      });
      // A mesh that enters another epoch (a replica evicted or admitted again) may serve this
      // front's waiting trainers elsewhere now: their steps are answered MESH_RECONFIGURING and
      // asked again, each at the front that serves it in the new epoch (WRONG_REPLICA here).
      // So are those waiting for a leader's step that it has not started (the leader may be
      // the replica evicted: then this front may lead in the new epoch).
      epoch_listener_ =
          options.liveness->epochs().OnEpoch([c = context_.get()](const MeshEpoch& next) {
            c->sync_steps.AbortAll(HeadMesh::EpochChanged(next));
            c->operations.mesh_steps().AbortWaiting(HeadMesh::EpochChanged(next),
                                                    /*started=*/false);
          });
    }
  }
  ~HeadServiceImpl() override {
    if (context_->options.liveness != nullptr) {
      context_->options.liveness->RemoveListener(down_listener_);
      context_->options.liveness->epochs().RemoveListener(epoch_listener_);
    }
    ServerMetrics* metrics = context_->options.metrics;
    context_.reset();  // the compute threads finish their tasks first (ServiceContext)
    if (metrics != nullptr) metrics->set_admission(nullptr);
  }

  v1::HeadService::CallbackService& service() override { return *this; }
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Step(
      grpc::CallbackServerContext* context, core::CallMode mode) override {
    return Admit([&] { return NewStepReactor(context, mode, context_.get()); });
  }
  AdmissionController& admission() override { return context_->admission; }
  absl::Status ReserveLoadedHeads() override { return context_->local.ReserveLoadedHeads(); }
  absl::Status SaveAllStates() override { return Ops().SaveAllStates(); }
  absl::Status FollowGroup(const std::atomic<bool>& stop) override {
    if (!context_->placement.follows_group()) {
      return absl::FailedPreconditionError("FollowGroup: expected a head group rank other than 0");
    }
    return context_->follower.Run(stop);
  }
  absl::Status FollowMesh(const std::atomic<bool>& stop) override {
    if (!context_->placement.follows_mesh()) {
      return absl::FailedPreconditionError(
          "FollowMesh: expected the front of a mesh's replica other than the leader");
    }
    return context_->mesh_follower.Run(stop);
  }

  grpc::ServerUnaryReactor* CreateHead(grpc::CallbackServerContext* context,
                                       const v1::CreateHeadRequest* request,
                                       v1::HeadInfo* response) override {
    return Training(context, *context_, [&]() -> absl::Status {
      ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                       OptionalDtype(request->dtype(), "dtype"));
      ASSIGN_OR_RETURN(const HeadTraits traits,
                       TraitsFromWire(request->frozen(), request->grad_dtype(), ""));
      switch (request->source_case()) {
        case v1::CreateHeadRequest::kSafetensors:
          return Answer(Ops().CreateFromSafetensors(
                            request->head_id(), FromWire(request->safetensors(), dtype), traits),
                        response);
        case v1::CreateHeadRequest::kInit:
          return Answer(Ops().CreateFromSeed(
                            request->head_id(),
                            FromWire(request->init(), dtype.value_or(torch::kFloat)), traits),
                        response);
        default:
          return absl::InvalidArgumentError("source: expected safetensors or init; got none");
      }
    });
  }

  grpc::ServerReadReactor<v1::UploadHeadRequest>* UploadHead(grpc::CallbackServerContext* context,
                                                             v1::HeadInfo* response) override {
    return Admit([&] { return NewUploadReactor(context, context_.get(), response); });
  }

  grpc::ServerUnaryReactor* SaveWeights(grpc::CallbackServerContext* context,
                                        const v1::SaveWeightsRequest* request,
                                        v1::SaveWeightsResponse* response) override {
    return Serve(context, [&]() -> absl::Status {
      ASSIGN_OR_RETURN(const int64_t bytes,
                       Ops().Save(request->head_id(), request->path(), request->weight_name(),
                                  request->bias_name()));
      response->set_bytes_written(bytes);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* DescribeHead(grpc::CallbackServerContext* context,
                                         const v1::HeadRef* request,
                                         v1::HeadInfo* response) override {
    // On a mesh, accumulated_micro_batches counts every replica's (MeshCounts); a trainer that
    // names itself learns whether this front serves it (a moved trainer's probe).
    return Serve(context, [&]() -> absl::Status {
      if (request->has_trainer_rank() && context_->placement.is_replica_front()) {
        RETURN_IF_ERROR(context_->Serving());
        RETURN_IF_ERROR(context_->operations.mesh_steps().CheckTrainer(request->trainer_rank(),
                                                                       "trainer_rank"));
      }
      return Answer(context_->mesh_counts.Describe(request->head_id()), response);
    });
  }

  grpc::ServerUnaryReactor* ListHeads(grpc::CallbackServerContext* context,
                                      const v1::ListHeadsRequest*,
                                      v1::ListHeadsResponse* response) override {
    return Serve(context, [&]() -> absl::Status {
      for (const HeadDescription& d : Local().List())
        RETURN_IF_ERROR(ToWire(d, response->add_heads()));
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* DropHead(grpc::CallbackServerContext* context,
                                     const v1::HeadRef* request, v1::DropHeadResponse*) override {
    return Training(context, *context_, [&] { return Ops().Drop(request->head_id()); });
  }

  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext* context,
                                          const v1::HeadRef* request,
                                          v1::ZeroGradientsResponse* response) override {
    return Training(context, *context_, [&] {
      return Answer(Ops().ZeroGradients(request->head_id()), response->mutable_info());
    });
  }

  grpc::ServerUnaryReactor* OptimizerStep(grpc::CallbackServerContext* context,
                                          const v1::OptimizerStepRequest* request,
                                          v1::OptimizerStepResponse* response) override {
    if (request->has_synchronous()) return SynchronousStep(context, *request, response);
    return Training(context, *context_, [&]() -> absl::Status {
      ASSIGN_OR_RETURN(const OptimizerStepSpec spec, FromWire(*request));
      ASSIGN_OR_RETURN(const HeadDescription head, Local().Describe(request->head_id()));
      RETURN_IF_ERROR(CheckNotFrozen(head));
      RETURN_IF_ERROR(
          CheckIncarnation(request->expected_incarnation(), "expected_incarnation", head));
      return Answer(Ops().StepOptimizer(request->head_id(), std::nullopt, spec),
                    response->mutable_info());
    });
  }

  grpc::ServerUnaryReactor* SaveHeadState(grpc::CallbackServerContext* context,
                                          const v1::HeadRef* request,
                                          v1::HeadStateInfo* response) override {
    return Training(context, *context_, [&]() -> absl::Status {
      ASSIGN_OR_RETURN(const HeadDescription d, Ops().SaveState(request->head_id()));
      response->set_state_id(d.state_id);
      response->set_weight_version(d.weight_version);
      return ToWire(d, response->mutable_info());
    });
  }

  grpc::ServerUnaryReactor* ListFunctions(grpc::CallbackServerContext* context,
                                          const v1::ListFunctionsRequest*,
                                          v1::ListFunctionsResponse* response) override {
    return Serve(context, [&] { return ToWire(core::FunctionRegistry::Builtin(), response); });
  }

  grpc::ServerUnaryReactor* RestoreHeadState(grpc::CallbackServerContext* context,
                                             const v1::RestoreHeadStateRequest* request,
                                             v1::HeadInfo* response) override {
    return Training(context, *context_, [&] {
      return Answer(Ops().RestoreState(request->head_id(), request->state_id()), response);
    });
  }

  grpc::ServerWriteReactor<v1::ExportWeightsResponse>* ExportWeights(
      grpc::CallbackServerContext*, const v1::ExportWeightsRequest* request) override {
    return Admit([&] { return NewExportReactor(context_.get(), *request); });
  }

  grpc::ServerWriteReactor<v1::FetchGradientsResponse>* FetchGradients(
      grpc::CallbackServerContext*, const v1::FetchGradientsRequest* request) override {
    return Admit([&] { return NewFetchGradientsReactor(context_.get(), *request); });
  }

  grpc::ServerWriteReactor<v1::EmbeddingLookupResponse>* EmbeddingLookup(
      grpc::CallbackServerContext*, const v1::EmbeddingLookupRequest* request) override {
    return Admit([&] { return NewEmbeddingLookupReactor(context_.get(), *request); });
  }

  grpc::ServerReadReactor<v1::EmbeddingGradientRequest>* EmbeddingGradient(
      grpc::CallbackServerContext* context, v1::EmbeddingGradientResponse* response) override {
    return Admit([&] { return NewEmbeddingGradientReactor(context, context_.get(), response); });
  }

  void Drain() override {
    context_->gate.Close();
    const absl::Status draining =
        core::WithReason(absl::UnavailableError(
                             "synchronous optimizer step: the server is draining; nothing applied"),
                         core::reason::kServerDraining);
    context_->sync_steps.AbortAll(draining);
    // On a mesh's front, also the steps whose trainers all came, waiting for the leader's; and
    // the steps the leader started, which no front waits for its trainers for any more.
    context_->operations.mesh_steps().AbortWaiting(draining, /*started=*/false);
    context_->operations.mesh_steps().Drain();
  }
  bool Quiesce(std::chrono::steady_clock::time_point deadline) override {
    Drain();
    return context_->gate.AwaitIdle(deadline);
  }
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallCounter() override {
    return context_->gate.Counter();
  }
  ClusterDrain& cluster_drain() override { return context_->drain; }

 private:
  // A unary call, refused at once while the server drains.
  template <typename Fn>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, Fn&& fn) {
    return Unary(context, [&]() -> absl::Status {
      RETURN_IF_ERROR(context_->gate.Admit());
      return fn();
    });
  }
  // A streaming call's reactor from `make`, or, while the server drains, one that refuses it.
  template <typename Make>
  auto Admit(Make&& make) -> decltype(make()) {
    using Reactor = std::remove_pointer_t<decltype(make())>;
    if (const absl::Status refused = context_->gate.Admit(); !refused.ok()) {
      return new RefusedReactor<Reactor>(ToGrpcStatus(refused));
    }
    return make();
  }

  ReplicatedHeadOperations& Ops() { return context_->operations; }
  const HeadOperations& Local() const { return context_->local; }

  // One rank's part of a synchronous step: answered when every rank came (sync_steps.h), from
  // whichever thread that is; a request refused up front is answered at once.
  grpc::ServerUnaryReactor* SynchronousStep(grpc::CallbackServerContext* context,
                                            const v1::OptimizerStepRequest& request,
                                            v1::OptimizerStepResponse* response) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    auto finish = [reactor, response](const absl::StatusOr<HeadDescription>& result) {
      reactor->Finish(ToGrpcStatus(Answer(result, response->mutable_info())));
    };
    absl::StatusOr<OptimizerStepSpec> spec = FromWire(request);
    absl::StatusOr<HeadDescription> head = Local().Describe(request.head_id());
    absl::Status refused = context_->gate.Admit();
    if (refused.ok()) refused = context_->Serving();
    if (refused.ok()) refused = !spec.ok() ? spec.status() : head.status();
    if (refused.ok()) refused = CheckNotFrozen(*head);
    if (refused.ok()) {
      refused = CheckIncarnation(request.expected_incarnation(), "expected_incarnation", *head);
    }
    if (!refused.ok()) {
      finish(refused);
      return reactor;
    }
    context_->sync_steps.Arrive({.head_id = request.head_id(),
                                 .step = request.synchronous().step(),
                                 .rank = request.synchronous().rank(),
                                 .world_size = request.synchronous().world_size(),
                                 .spec = *std::move(spec),
                                 .expected_incarnation = request.expected_incarnation()},
                                finish);
    return reactor;
  }

  std::unique_ptr<ServiceContext> context_;
  int down_listener_ = -1;   // on the liveness of the group or mesh, if any
  int epoch_listener_ = -1;  // on its epochs (a mesh that evicts)
};

}  // namespace

std::unique_ptr<HeadService> HeadService::Create(HeadRegistry* registry, ServiceOptions options) {
  return std::make_unique<HeadServiceImpl>(registry, options);
}

}  // namespace remotehead::server
