// A Client made (its options checked, its channel opened) and the calls it hands on whole: the
// step calls to its StepCaller, the function listing to its FunctionListing, its stats from its
// channel. The calls on a head are head_calls.cc.
#include <memory>
#include <utility>

#include "client_impl.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::client {

Client::Client(ClientOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}

Client::~Client() = default;

absl::StatusOr<std::shared_ptr<Client>> Client::Create(ClientOptions options) {
  ASSIGN_OR_RETURN(const std::string leader, internal::Channel::CheckOptions(&options));
  std::shared_ptr<Client> client(new Client(std::move(options), nullptr));
  client->impl_ = std::make_unique<Impl>(client->options_, leader);
  return client;
}

ClientStats Client::stats() const { return impl_->channel.stats(); }

int Client::replica() const { return impl_->channel.front()->replica; }

std::string Client::target() const { return impl_->channel.front()->target; }

bool Client::meshed() const { return impl_->channel.meshed(); }

void Client::CountReplays(int64_t calls) { impl_->channel.CountReplays(calls); }

absl::StatusOr<std::vector<FunctionInfo>> Client::ListFunctions() { return impl_->functions.All(); }

absl::StatusOr<ForwardBackwardResult> Client::ForwardBackward(const StepSpec& spec,
                                                              const StepInputs& inputs) {
  return impl_->steps.ForwardBackward(spec, inputs);
}

absl::StatusOr<ForwardResult> Client::Forward(const StepSpec& spec, const StepInputs& inputs) {
  return impl_->steps.Forward(spec, inputs);
}

absl::StatusOr<BackwardResult> Client::Backward(const StepSpec& spec, const StepInputs& inputs,
                                                const torch::Tensor& grad_output) {
  return impl_->steps.Backward(spec, inputs, grad_output);
}

}  // namespace remotehead::client
