// Where the streams of a striped call (StepHeader.stripe) find each other: the call's pipeline
// by its key, while it runs, and how it ended for a while after — so a stream that comes late
// to a step that already failed is refused at once instead of waiting for streams that will
// never come.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace remotehead::server {

// A call whose streams join by key (StreamPipeline, whatever its messages), as the joins see
// it.
class StripedCall {
 public:
  virtual ~StripedCall() = default;
  // Fails the call from outside (a stream of it refused before joining).
  virtual void Fail(const absl::Status& why) = 0;
  // Fails the call (ABORTED, naming them) if some of its streams have not joined yet: they were
  // given `within` since the first came.
  virtual void FailUnlessJoined(std::chrono::milliseconds within) = 0;
};

// The most streams one call may be striped over.
inline constexpr int kMaxStripes = 64;

// Which stream of which call a stream is, as its first message states it (the call reads it:
// StepStream::ReadStripe).
struct StripeOf {
  std::string key;  // empty for one stream
  int count = 1;
  int index = 0;
  std::optional<int64_t> messages;  // StripeSpec.messages: the rows messages after the header
};

class StripeJoins {
 public:
  using Create = std::function<std::shared_ptr<StripedCall>()>;

  // `join_within`: how long a step's streams may take to join after its first (a stream
  // cancelled or lost before the server read its header never comes; the others must not wait
  // for it). ServiceOptions::stripe_join_seconds.
  explicit StripeJoins(std::chrono::milliseconds join_within) : join_within_(join_within) {}
  ~StripeJoins();  // stops the watcher
  StripeJoins(const StripeJoins&) = delete;
  StripeJoins& operator=(const StripeJoins&) = delete;

  // The running pipeline of `key`, made by `create` for the step's first stream to arrive.
  // FAILED_PRECONDITION when the step of `key` has ended (a key names one attempt).
  absl::StatusOr<std::shared_ptr<StripedCall>> Join(const std::string& key, const Create& create);
  // The step of `key` is over: later streams are refused, naming `how` when it failed.
  void End(const std::string& key, const absl::Status& how);
  // A stream of `key` was refused before it could join (a malformed stripe): the step fails
  // with `why` — its running pipeline at once, its streams yet to come when they arrive.
  void Abort(const std::string& key, const absl::Status& why);

 private:
  using Clock = std::chrono::steady_clock;
  struct Ended {
    absl::Status how;
    Clock::time_point at;
  };
  struct Running {
    std::weak_ptr<StripedCall> pipeline;
    Clock::time_point since;  // when its first stream came
  };
  // How long an ended key is remembered: far longer than streams opened together arrive apart.
  static constexpr std::chrono::minutes kRemember{10};

  // The watcher's loop: fails the steps whose streams did not all join within join_within_.
  void Watch();

  const std::chrono::milliseconds join_within_;
  std::mutex mu_;  // a leaf: held while nothing else is called but `create`
  std::map<std::string, Running> running_;
  std::map<std::string, Ended> ended_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread watcher_;  // started by the first striped step
};

}  // namespace remotehead::server
