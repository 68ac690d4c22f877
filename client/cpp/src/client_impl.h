// What a Client holds behind its public header: its channel (channel.h: the stubs, the retry
// policy every call runs in), the server's function listing (functions.h) and the streaming step
// calls over both (step_caller.h).
#pragma once

#include <string>

#include "channel.h"
#include "functions.h"
#include "remotehead/client/client.h"
#include "step_caller.h"

namespace remotehead::client {

struct Client::Impl {
  // `options`, checked (Channel::CheckOptions), must outlive the Impl: they are the Client's.
  Impl(const ClientOptions& options, const std::string& leader)
      : channel(options, leader), functions(channel), steps(channel, functions) {}

  internal::Channel channel;
  internal::FunctionListing functions;
  internal::StepCaller steps;
};

}  // namespace remotehead::client
