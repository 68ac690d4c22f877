// The reactor of one stream of a step call: it reads the stream's first message, finds the
// call's StepPipeline — a new one, or for a striped step (StepHeader.stripe) the one its other
// streams share, by key — and from then on hands every gRPC reaction to it. The pipeline decides
// when to read and write; this class only moves messages.
#include "rpc/step_reactor.h"

#include <memory>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "rpc/step_pipeline.h"
#include "rpc/stripe_joins.h"

namespace remotehead::server {
namespace {

class StepPortReactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>,
                              public StepPort {
 public:
  StepPortReactor(grpc::CallbackServerContext* context, core::CallMode mode,
                  ServiceContext* service)
      : context_(context), mode_(mode), service_(*service) {
    StartRead(&first_);
  }

  // StepPort: the pipeline's calls, under its lock.
  void Read(v1::StepRequest* into) override { StartRead(into); }
  void Write(const v1::StepResponse* response) override { StartWrite(response); }
  void Finish(const grpc::Status& status) override {
    grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>::Finish(status);
  }
  bool IsCancelled() const override { return context_->IsCancelled(); }

  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (pipeline_ != nullptr) {
      std::shared_ptr<StepPipeline> pipeline = pipeline_;
      lock.unlock();
      pipeline->OnReadDone(index_, ok);
      return;
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
  v1::StepRequest first_;  // target of the first read

  std::mutex mu_;  // guards the join: taken before the pipeline's lock, never after
  std::shared_ptr<StepPipeline> pipeline_;  // set once, when the first message is read
  int index_ = 0;                           // this stream's index among the call's streams
  bool finished_ = false;                   // finished before joining
};

}  // namespace

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* NewStepReactor(
    grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service) {
  return new StepPortReactor(context, mode, service);
}

}  // namespace remotehead::server
