// The reactor of one stream of a streaming compute call (one reactor per stream, gRPC's callback
// API, served raw: gRPC's ByteBuffers): it reads the stream's first message, finds the call's
// StreamPipeline — a new one, or for a striped call the one its other streams share, by key —
// and from then on hands every gRPC reaction to it. The pipeline decides when to read and write;
// this class only moves messages, parsed and framed by the call (`Call`, stream_pipeline.h).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "rpc/service_context.h"
#include "rpc/stream_pipeline.h"

namespace remotehead::server {

template <typename Call>
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public StreamPort<typename Call::Request, typename Call::Response> {
 public:
  using Pipeline = StreamPipeline<Call>;
  using Request = typename Call::Request;
  using Response = typename Call::Response;
  using First = typename Call::First;

  StreamReactor(grpc::CallbackServerContext* context, core::CallMode mode, ServiceContext* service)
      : context_(context), mode_(mode), service_(*service) {
    StartRead(&read_);
  }

  // StreamPort: the pipeline's calls, under its lock.
  void Read(Request* into) override {
    into_ = into;
    StartRead(&read_);
  }
  void Write(const Response* response) override {
    writing_ = Call::Serialize(*response);
    StartWrite(&writing_);
  }
  void Finish(const grpc::Status& status) override {
    grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>::Finish(status);
  }
  bool IsCancelled() const override { return context_->IsCancelled(); }

  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (pipeline_ != nullptr) {
      std::shared_ptr<Pipeline> pipeline = pipeline_;
      lock.unlock();
      if (absl::Status read = ok ? pipeline->Decode(&read_, into_) : absl::OkStatus(); !read.ok()) {
        pipeline->Fail(read);
        return;
      }
      pipeline->OnReadDone(index_, ok);
      return;
    }
    if (ok) {
      if (absl::Status parsed = Call::ParseFirst(&read_, &first_); !parsed.ok()) {
        FinishAloneLocked(parsed);
        return;
      }
    }
    if (finished_) {
      // Cancelled before it joined: a striped call's other streams fail now, not after waiting
      // for this one.
      const StripeOf sent = Call::StripeAsSent(first_);
      if (ok && !sent.key.empty()) {
        service_.stripes.Abort(sent.key, absl::CancelledError(absl::StrCat(
                                             "stream ", sent.index, " of ", sent.count,
                                             " was cancelled by the client, or its deadline "
                                             "expired")));
      }
      return;
    }
    JoinLocked(ok);
  }

  void OnWriteDone(bool ok) override { CurrentPipeline()->OnWriteDone(index_, ok); }

  void OnCancel() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (pipeline_ == nullptr) {
      FinishAloneLocked(absl::CancelledError("cancelled by the client, or its deadline expired"));
      return;
    }
    std::shared_ptr<Pipeline> pipeline = pipeline_;
    lock.unlock();
    pipeline->OnCancel(index_);
  }

  void OnDone() override {
    if (std::shared_ptr<Pipeline> pipeline = CurrentPipeline()) pipeline->OnDone(index_);
    delete this;
  }

 private:
  std::shared_ptr<Pipeline> CurrentPipeline() {
    std::lock_guard<std::mutex> lock(mu_);
    return pipeline_;
  }

  // The first message is read (or the stream ended without one): the stream joins its call.
  void JoinLocked(bool ok) {
    if (!ok && context_->IsCancelled()) {
      FinishAloneLocked(absl::CancelledError("cancelled by the client"));
      return;
    }
    absl::StatusOr<StripeOf> stripe = ok ? Call::ReadStripe(first_) : StripeOf{};
    if (!stripe.ok()) {
      // The call's other streams fail with it rather than wait for this one.
      const std::string key = Call::StripeAsSent(first_).key;
      if (!key.empty()) service_.stripes.Abort(key, stripe.status());
      FinishAloneLocked(stripe.status());
      return;
    }
    if (stripe->count == 1) {
      pipeline_ = std::make_shared<Pipeline>(&service_, mode_, 1, "");
    } else {
      absl::StatusOr<std::shared_ptr<StripedCall>> joined =
          service_.stripes.Join(stripe->key, [&]() -> std::shared_ptr<StripedCall> {
            return std::make_shared<Pipeline>(&service_, mode_, stripe->count, stripe->key);
          });
      if (!joined.ok()) {
        FinishAloneLocked(joined.status());
        return;
      }
      pipeline_ = std::dynamic_pointer_cast<Pipeline>(*std::move(joined));
      if (pipeline_ == nullptr) {
        FinishAloneLocked(absl::InvalidArgumentError(absl::StrCat(
            "header.stripe.key: \"", stripe->key, "\" names a striped call of another method")));
        return;
      }
    }
    index_ = stripe->index;
    std::optional<First> first;
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
  grpc::ByteBuffer read_;     // the read in flight (one at a time)
  First first_;               // the first message, parsed
  Request* into_ = nullptr;   // where the pipeline wants the read in flight
  grpc::ByteBuffer writing_;  // the write in flight (one at a time), until OnWriteDone

  std::mutex mu_;  // guards the join: taken before the pipeline's lock, never after
  std::shared_ptr<Pipeline> pipeline_;  // set once, when the first message is read
  int index_ = 0;                       // this stream's index among the call's streams
  bool finished_ = false;               // finished before joining
};

}  // namespace remotehead::server
