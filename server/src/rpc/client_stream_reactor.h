// The server side of a client stream that ends in one answer (UploadHead, EmbeddingGradient):
// every message handed to OnMessage, the stream's end to Complete. The first error, an exception
// or the client's cancellation finishes the call with its status; a call that failed or was
// cancelled changes nothing (what a derived reactor assembles is committed in Complete only).
#pragma once

#include <grpcpp/grpcpp.h>

#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "remotehead/server/rpc/status_mapping.h"

namespace remotehead::server {

template <typename Request>
class ClientStreamReactor : public grpc::ServerReadReactor<Request> {
 public:
  explicit ClientStreamReactor(grpc::CallbackServerContext* context) : context_(context) {}

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {
      this->Finish(ToGrpcStatus(absl::CancelledError("cancelled by the client")));
      return;
    }
    absl::Status status;
    try {
      status = ok ? OnMessage(request_) : Complete();
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
    }
    if (!status.ok()) {
      this->Finish(ToGrpcStatus(status));
    } else if (ok) {
      this->StartRead(&request_);
    } else {
      this->Finish(grpc::Status::OK);
    }
  }

  void OnDone() override { delete this; }

 protected:
  // Called last by the derived reactor's constructor: no message may reach a reactor that is
  // not yet whole.
  void StartReading() { this->StartRead(&request_); }
  virtual absl::Status OnMessage(const Request& request) = 0;
  virtual absl::Status Complete() = 0;

 private:
  grpc::CallbackServerContext* context_;
  Request request_;
};

}  // namespace remotehead::server
