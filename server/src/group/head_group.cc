#include "remotehead/server/group/head_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

// How long a following rank waits for a command before checking whether it should stop.
constexpr std::chrono::milliseconds kFollowPoll{200};

// `t` as a flat byte tensor sharing its storage (a contiguous tensor), so that any dtype
// travels through the transport's byte type.
torch::Tensor Bytes(const torch::Tensor& t) { return t.reshape({-1}).view(torch::kByte); }

// UNAVAILABLE with its reason: the group (or its front) is down.
absl::Status GroupUnavailable(const std::string& message, int rank) {
  return core::WithReason(absl::UnavailableError(message), core::reason::kGroupUnavailable,
                          {{"rank", absl::StrCat(rank)}});
}

}  // namespace

std::vector<MetricFamilySamples> HeadGroup::Metrics() const {
  const std::map<std::string, CollectiveBytes> moved = group_->Bytes();
  MetricFamilySamples calls{.name = "remotehead_group_collectives_total",
                            .help = "Collectives this rank ran, by operation",
                            .counter = true};
  for (const auto& [op, b] : moved) {
    calls.samples.push_back({.labels = {{"op", op}}, .value = static_cast<double>(b.calls)});
  }
  return {
      {.name = "remotehead_group_info",
       .help = "1, labelled with this process's rank in its head group and the group size",
       .samples = {{.labels = {{"rank", std::to_string(rank())}, {"size", std::to_string(size())}},
                    .value = 1}}},
      OneValue("remotehead_group_up", "1 while the head group works, 0 once it is down", false,
               health().ok() ? 1 : 0),
      CollectiveBytesByOp("remotehead_group_collective_bytes_total",
                          "Bytes this rank's collectives sent and received, by operation", moved),
      std::move(calls)};
}

bool IsGroupFailure(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded;
}

HeadGroup::HeadGroup(std::unique_ptr<ProcessGroup> group, std::string secret, std::ostream* log)
    : group_(std::move(group)), event_log_(log), log_(group_.get(), std::move(secret), log) {}

absl::StatusOr<std::vector<core::ShardRange>> HeadGroup::Ranges(int64_t vocab_size) const {
  return core::SplitVocabulary(vocab_size, size());
}

absl::Status HeadGroup::health() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!down_.ok()) return down_;
  }
  return liveness_ != nullptr ? liveness_->health() : absl::OkStatus();
}

std::string HeadGroup::front_address() const {
  std::lock_guard<std::mutex> lock(mu_);
  return front_address_;
}

void HeadGroup::set_front_address(std::string address) {
  std::lock_guard<std::mutex> lock(mu_);
  front_address_ = std::move(address);
}

void HeadGroup::Retire(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (retired_.ok()) retired_ = why;
}

absl::Status HeadGroup::Retired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return retired_;
}

absl::Status HeadGroup::Check(absl::Status failure) {
  if (!IsGroupFailure(failure)) return failure;
  // A group the mesh left behind fails as its peers go: that is no verdict on anyone.
  if (const absl::Status retired = Retired(); !retired.ok()) return retired;
  // A stranger's change of the store says it best: what to do is fence the store, whatever else
  // is seen (the rank stopped meanwhile, whose command stayed pending, looks lost too).
  const bool tampering = NamesTampering(failure);
  // Else a verdict that names the process lost says it best (liveness.h).
  if (!tampering && liveness_ != nullptr && NamesLostProcess(liveness_->health())) {
    failure = liveness_->health();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!down_.ok()) return failure;  // down already: this failure as it is (a reply's names)
  }
  // Named after the process lost (whose heartbeat stopped), not the live rank that noticed; the
  // verdict of every process of the group or mesh.
  if (liveness_ != nullptr) {
    if (!tampering && !NamesLostProcess(failure)) failure = liveness_->Blame(failure);
    liveness_->DeclareDown(failure);  // a rank's reply may carry the verdict: ours too, at once
    if (!tampering && NamesLostProcess(liveness_->health())) failure = liveness_->health();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!down_.ok()) return failure;
    down_ = failure;
  }
  // The front tells the other ranks, so that none runs a command it gave up on (a rank that is
  // stopped now and continued later); the store lives in the front's process.
  if (is_front()) {
    if (const absl::Status told = log_.DeclareDown(std::string(failure.message()));
        !told.ok() && event_log_ != nullptr) {
      *event_log_ << "remotehead-server: head group: could not declare the group down to the "
                     "other ranks: "
                  << told.message() << std::endl;
    }
  }
  return failure;
}

absl::Status HeadGroup::CheckFront() {
  const absl::StatusOr<std::optional<std::string>> declared = log_.DownDeclared();
  if (declared.ok() && !declared->has_value()) return absl::OkStatus();
  const std::string why = declared.ok() ? absl::StrCat("it declared the group down: ", **declared)
                                        : std::string(declared.status().message());
  const absl::Status gone = GroupUnavailable(
      absl::StrCat("head group rank ", rank(), ": the front (rank 0) is gone: ", why), rank());
  Check(gone).IgnoreError();  // health reports it
  return gone;
}

absl::Status HeadGroup::Timed(const std::string& command,
                              const std::function<absl::Status()>& part) {
  if (!observer_) return part();
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = part();
  observer_(command,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return status;
}

// UNAVAILABLE saying why `failure` took the group down and what to do; OK for OK.
absl::Status HeadGroup::Unavailable(const absl::Status& failure) const {
  // A verdict naming the process lost, the key a stranger changed or the replica evicted says
  // what to do.
  if (failure.ok() || NamesLostProcess(failure) || NamesTampering(failure) ||
      NamesEvictedReplica(failure)) {
    return failure;
  }
  return GroupUnavailable(absl::StrCat("head group of ", size(), " is down since: ",
                                       failure.message(), " — restart every rank of the group"),
                          rank());
}

absl::Status HeadGroup::Serving() const { return Unavailable(health()); }

absl::Status HeadGroup::OwnHealth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return down_;
}

absl::StatusOr<HeadGroup::Lane> HeadGroup::Enter() {
  RETURN_IF_ERROR(Retired());
  // The group's own failure only: once the mesh it is part of is down, its ranks still answer
  // the calls that read (the service refuses every other: ServiceContext::Serving).
  RETURN_IF_ERROR(Unavailable(OwnHealth()));
  std::unique_lock<std::mutex> lock(lane_);
  RETURN_IF_ERROR(Unavailable(OwnHealth()));  // it may have gone down while this call waited
  return Lane(this, std::move(lock));
}

absl::Status HeadGroup::Lane::Run(const Command& command,
                                  const std::function<absl::Status()>& local, bool local_last) {
  HeadGroup& g = *group_;
  const absl::StatusOr<int64_t> seq = g.log_.Append(command.bytes);
  if (!seq.ok()) return g.Check(seq.status());
  absl::Status mine;
  if (!local_last) mine = g.Check(g.Timed(command.name, local));
  // Once this rank's part failed on the transport (a collective timed out: a rank hung or
  // died), the failure is already one timeout old: the other ranks' replies, which name the
  // rank at fault, get a short grace instead of a fresh timeout.
  const std::chrono::milliseconds timeout = g.group_->config().timeout;
  const std::chrono::milliseconds wait =
      IsGroupFailure(mine) ? std::min(timeout / 5, std::chrono::milliseconds(2000)) : timeout;
  const absl::Status replies = g.Check(g.log_.AwaitReplies(*seq, wait).status());
  if (local_last && replies.ok()) mine = g.Check(g.Timed(command.name, local));
  // An error of the request itself happens on every rank alike: this rank's says it. A
  // transport failure is best told by the replies, which name the rank that did not answer.
  if (!mine.ok() && !IsGroupFailure(mine)) return mine;
  return replies.ok() ? mine : replies;
}

absl::Status HeadGroup::Follow(const std::function<absl::Status(const std::string&)>& execute,
                               const std::atomic<bool>& stop) {
  while (!stop.load()) {
    RETURN_IF_ERROR(Retired());
    absl::StatusOr<std::string> bytes = log_.Next(kFollowPoll);
    if (bytes.status().code() == absl::StatusCode::kDeadlineExceeded) {
      RETURN_IF_ERROR(CheckFront());
      continue;
    }
    if (!bytes.ok()) {
      Check(bytes.status()).IgnoreError();  // health reports it
      return GroupUnavailable(
          absl::StrCat("head group rank ", rank(),
                       ": the front (rank 0) is gone: ", bytes.status().message()),
          rank());
    }
    // A command taken late (this rank was stopped, or slow) may be one the front gave up on.
    RETURN_IF_ERROR(CheckFront());
    absl::Status status = OwnHealth();
    if (!status.ok()) {
      // Down: c10d cannot resume, so nothing more runs here; the front learns it at once.
      status = GroupUnavailable(
          absl::StrCat("head group rank ", rank(), " is down since: ", status.message()), rank());
    } else {
      try {
        status = Check(execute(*bytes));
      } catch (const std::exception& e) {
        status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
      }
    }
    if (const absl::Status sent = log_.Reply({.status = status}); !sent.ok()) {
      Check(sent).IgnoreError();
      return GroupUnavailable(absl::StrCat("head group rank ", rank(),
                                           ": the front (rank 0) is gone: ", sent.message()),
                              rank());
    }
  }
  return absl::OkStatus();
}

absl::Status HeadGroup::Share(std::vector<torch::Tensor>& tensors) {
  for (torch::Tensor& t : tensors) {
    if (t.numel() == 0) continue;  // every rank knows the shape: nothing to send
    if (is_front() && !t.is_contiguous()) t = t.contiguous();
    torch::Tensor bytes = Bytes(t);
    RETURN_IF_ERROR(Check(group_->Broadcast(bytes, /*root=*/0)));
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> HeadGroup::GatherRows(const torch::Tensor& mine,
                                                    const std::vector<core::ShardRange>& ranges) {
  int64_t largest = 0;
  for (const core::ShardRange& r : ranges) largest = std::max(largest, r.rows);
  // Gathered as bytes of equal size: each rank's rows padded to the largest shard's.
  std::vector<int64_t> padded_shape = mine.sizes().vec();
  padded_shape[0] = largest;
  torch::Tensor padded = torch::zeros(padded_shape, mine.options());
  padded.narrow(0, 0, mine.size(0)).copy_(mine);
  const absl::StatusOr<torch::Tensor> all = group_->Gather(Bytes(padded), /*root=*/0);
  if (!all.ok()) return Check(all.status());
  if (!is_front()) return torch::Tensor();
  const int64_t row_bytes = padded.nbytes() / std::max<int64_t>(largest, 1);
  std::vector<torch::Tensor> parts;
  for (size_t r = 0; r < ranges.size(); ++r) {
    std::vector<int64_t> shape = padded_shape;
    shape[0] = ranges[r].rows;
    parts.push_back((*all)[static_cast<int64_t>(r)]
                        .narrow(0, 0, ranges[r].rows * row_bytes)
                        .view(mine.scalar_type())
                        .reshape(shape));
  }
  return torch::cat(parts);
}

absl::StatusOr<torch::Tensor> HeadGroup::SumToFront(const torch::Tensor& mine) {
  if (mine.numel() == 0) return is_front() ? mine : torch::Tensor();
  const torch::Tensor contiguous = mine.contiguous();
  const absl::StatusOr<torch::Tensor> all = group_->Gather(Bytes(contiguous), /*root=*/0);
  if (!all.ok()) return Check(all.status());
  if (!is_front()) return torch::Tensor();
  std::vector<int64_t> shape = mine.sizes().vec();
  shape.insert(shape.begin(), all->size(0));
  return all->contiguous()
      .view(mine.scalar_type())
      .reshape(shape)
      .sum(0, false, mine.scalar_type());
}

}  // namespace remotehead::server
