// The reactor of one stream of a step call: it reads the stream's first message, finds the
// call's StepPipeline — a new one, or for a striped step (StepHeader.stripe) the one its other
// streams share, by key — and from then on hands every gRPC reaction to it. The pipeline decides
// when to read and write; this class only moves messages. The step methods are served raw
// (gRPC's ByteBuffers): each request is parsed here as gRPC would parse it, and each response
// goes out framed around its rows' bytes (StepResponseOut::Frames), which nothing copies.
#include "rpc/step_reactor.h"

#include <google/protobuf/descriptor.h>

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "remotehead/wire/frames.h"
#include "rpc/step_pipeline.h"
#include "rpc/stripe_joins.h"

namespace remotehead::server {
namespace {

using RawBidiReactor = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

// A request as gRPC's own protobuf serialization would have parsed it.
absl::Status Parse(grpc::ByteBuffer* bytes, v1::StepRequest* into) {
  const grpc::Status parsed = grpc::SerializationTraits<v1::StepRequest>::Deserialize(bytes, into);
  if (parsed.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "request: expected a serialized remotehead.v1.StepRequest; got bytes that do not parse (",
      parsed.error_message(), ")"));
}

// A request of a running call: its hidden rows straight into the call's staging buffers where
// they can go there (row_staging.h), else parsed whole.
absl::Status Decode(grpc::ByteBuffer* bytes, RowStaging& staging, InboundRequest* into) {
  std::vector<grpc::Slice> slices;
  std::vector<wire::BytePiece> pieces;
  if (wire::ReceivedPieces(*bytes, &slices, &pieces)) {
    try {
      if (staging.Decode(pieces, &into->message, &into->staged)) return absl::OkStatus();
    } catch (const std::exception&) {
      // A staging buffer not had (memory): the request is parsed whole, as without staging.
    }
  }
  into->staged.clear();
  into->message.Clear();
  return Parse(bytes, &into->message);
}

class StepPortReactor final : public RawBidiReactor, public StepPort {
 public:
  StepPortReactor(grpc::CallbackServerContext* context, core::CallMode mode,
                  ServiceContext* service)
      : context_(context), mode_(mode), service_(*service) {
    StartRead(&read_);
  }

  // StepPort: the pipeline's calls, under its lock.
  void Read(InboundRequest* into) override {
    into_ = into;
    StartRead(&read_);
  }
  void Write(const StepResponseOut* response) override {
    writing_ = wire::ToByteBuffer(response->Frames());
    StartWrite(&writing_);
  }
  void Finish(const grpc::Status& status) override { RawBidiReactor::Finish(status); }
  bool IsCancelled() const override { return context_->IsCancelled(); }

  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (pipeline_ != nullptr) {
      std::shared_ptr<StepPipeline> pipeline = pipeline_;
      lock.unlock();
      if (absl::Status parsed = ok ? Decode(&read_, pipeline->staging(), into_) : absl::OkStatus();
          !parsed.ok()) {
        pipeline->Fail(parsed);
        return;
      }
      pipeline->OnReadDone(index_, ok);
      return;
    }
    if (ok) {
      if (absl::Status parsed = Parse(&read_, &first_); !parsed.ok()) {
        FinishAloneLocked(parsed);
        return;
      }
    }
    if (finished_) {
      // Cancelled before it joined: a striped step's other streams fail now, not after waiting
      // for this one.
      if (ok && first_.header().has_stripe() && !first_.header().stripe().key().empty()) {
        service_.stripes.Abort(first_.header().stripe().key(),
                               absl::CancelledError(absl::StrCat(
                                   "stream ", first_.header().stripe().index(), " of ",
                                   first_.header().stripe().count(),
                                   " was cancelled by the client, or its deadline expired")));
      }
      return;
    }
    JoinLocked(ok);
  }

  void OnWriteDone(bool ok) override { Pipeline()->OnWriteDone(index_, ok); }

  void OnCancel() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (pipeline_ == nullptr) {
      FinishAloneLocked(absl::CancelledError("cancelled by the client, or its deadline expired"));
      return;
    }
    std::shared_ptr<StepPipeline> pipeline = pipeline_;
    lock.unlock();
    pipeline->OnCancel(index_);
  }

  void OnDone() override {
    if (std::shared_ptr<StepPipeline> pipeline = Pipeline()) pipeline->OnDone(index_);
    delete this;
  }

 private:
  std::shared_ptr<StepPipeline> Pipeline() {
    std::lock_guard<std::mutex> lock(mu_);
    return pipeline_;
  }

  // The first message is read (or the stream ended without one): the stream joins its call.
  void JoinLocked(bool ok) {
    if (!ok && context_->IsCancelled()) {
      FinishAloneLocked(absl::CancelledError("cancelled by the client"));
      return;
    }
    absl::StatusOr<StripeOf> stripe = ok ? ReadStripe(first_) : StripeOf{};
    if (!stripe.ok()) {
      // The step's other streams fail with it rather than wait for this one.
      const std::string& key = first_.header().stripe().key();
      if (!key.empty()) service_.stripes.Abort(key, stripe.status());
      FinishAloneLocked(stripe.status());
      return;
    }
    auto create = [&] {
      return std::make_shared<StepPipeline>(&service_, mode_, stripe->count, stripe->key);
    };
    if (stripe->count == 1) {
      pipeline_ = create();
    } else {
      absl::StatusOr<std::shared_ptr<StepPipeline>> joined =
          service_.stripes.Join(stripe->key, create);
      if (!joined.ok()) {
        FinishAloneLocked(joined.status());
        return;
      }
      pipeline_ = *std::move(joined);
    }
    index_ = stripe->index;
    std::optional<v1::StepRequest> first;
    if (ok) first = std::move(first_);
    pipeline_->Attach(index_, stripe->count, mode_, context_->deadline(), this, std::move(first),
                      stripe->messages);
  }

  // Before the stream has joined a pipeline, it ends on its own.
  void FinishAloneLocked(const absl::Status& status) {
    if (finished_) return;
    finished_ = true;
    Finish(ToGrpcStatus(status));
  }

  grpc::CallbackServerContext* context_;  // valid until OnDone
  const core::CallMode mode_;
  ServiceContext& service_;
  grpc::ByteBuffer read_;           // the read in flight (one at a time)
  v1::StepRequest first_;           // the first message, parsed
  InboundRequest* into_ = nullptr;  // where the pipeline wants the read in flight
  grpc::ByteBuffer writing_;        // the write in flight (one at a time), until OnWriteDone

  std::mutex mu_;  // guards the join: taken before the pipeline's lock, never after
  std::shared_ptr<StepPipeline> pipeline_;  // set once, when the first message is read
  int index_ = 0;                           // this stream's index among the call's streams
  bool finished_ = false;                   // finished before joining
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewStepReactor(
    grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service) {
  return new StepPortReactor(context, mode, service);
}

namespace {

// The step methods by name, with their modes.
constexpr std::pair<const char*, core::CallMode> kStepMethods[] = {
    {"ForwardBackward", core::CallMode::kFused},
    {"Forward", core::CallMode::kForward},
    {"Backward", core::CallMode::kBackward}};

const google::protobuf::ServiceDescriptor& HeadServiceDescriptor() {
  return *google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
      v1::HeadService::service_full_name());
}

}  // namespace

void ForEachStepMethod(const std::function<void(int index, core::CallMode mode)>& f) {
  for (const auto& [name, mode] : kStepMethods) {
    f(HeadServiceDescriptor().FindMethodByName(name)->index(), mode);
  }
}

bool IsRawStepMethod(const std::string& method) {
  for (const auto& [name, mode] : kStepMethods) {
    if (method == absl::StrCat("/", v1::HeadService::service_full_name(), "/", name)) return true;
  }
  return false;
}

}  // namespace remotehead::server
