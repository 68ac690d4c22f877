#include "remotehead/server/group_log.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

std::string CommandKey(int64_t seq) { return absl::StrCat("cmd/", seq); }
std::string ReplyKey(int64_t seq, int rank) { return absl::StrCat("reply/", seq, "/", rank); }

}  // namespace

// "<code>:<message length>:<message><payload>"
std::string EncodeReply(const GroupReply& reply) {
  const std::string message(reply.status.message());
  return absl::StrCat(static_cast<int>(reply.status.code()), ":", message.size(), ":", message,
                      reply.payload);
}

absl::StatusOr<GroupReply> DecodeReply(const std::string& bytes) {
  const size_t first = bytes.find(':');
  const size_t second = first == std::string::npos ? first : bytes.find(':', first + 1);
  int code = 0;
  size_t length = 0;
  if (second == std::string::npos || !absl::SimpleAtoi(bytes.substr(0, first), &code) ||
      !absl::SimpleAtoi(bytes.substr(first + 1, second - first - 1), &length) || code < 0 ||
      code > static_cast<int>(absl::StatusCode::kUnauthenticated) ||
      length > bytes.size() - second - 1) {
    return absl::DataLossError(absl::StrCat("head group: a reply that is not code:length:message (",
                                            bytes.size(), " bytes)"));
  }
  GroupReply reply;
  reply.status =
      absl::Status(static_cast<absl::StatusCode>(code), bytes.substr(second + 1, length));
  reply.payload = bytes.substr(second + 1 + length);
  return reply;
}

absl::StatusOr<int64_t> GroupLog::Append(const std::string& command) {
  const int64_t seq = next_;
  RETURN_IF_ERROR(group_->Set(CommandKey(seq), command));
  ++next_;
  return seq;
}

absl::StatusOr<std::vector<std::string>> GroupLog::AwaitReplies(int64_t seq) {
  const auto timeout = group_->config().timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> payloads;
  absl::Status first_error;
  for (int rank = 1; rank < group_->size(); ++rank) {
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now()));
    absl::StatusOr<std::string> bytes = group_->Get(ReplyKey(seq, rank), left);
    if (!bytes.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "head group: rank ", rank, " of ", group_->size(), " did not reply to command ", seq,
          " within ", timeout.count() / 1000.0, " s (", bytes.status().message(), ")"));
    }
    ASSIGN_OR_RETURN(GroupReply reply, DecodeReply(*bytes));
    if (!reply.status.ok() && first_error.ok()) {
      first_error = absl::Status(reply.status.code(), absl::StrCat("head group rank ", rank, ": ",
                                                                   reply.status.message()));
    }
    payloads.push_back(std::move(reply.payload));
  }
  // Every rank has taken and answered the command: its keys are no longer needed.
  RETURN_IF_ERROR(group_->Delete(CommandKey(seq)));
  for (int rank = 1; rank < group_->size(); ++rank) {
    RETURN_IF_ERROR(group_->Delete(ReplyKey(seq, rank)));
  }
  if (!first_error.ok()) return first_error;
  return payloads;
}

absl::StatusOr<std::string> GroupLog::Next(std::chrono::milliseconds wait) {
  ASSIGN_OR_RETURN(std::string command, group_->Get(CommandKey(next_), wait));
  ++next_;
  return command;
}

absl::Status GroupLog::Reply(const GroupReply& reply) {
  if (next_ == 0) {
    return absl::FailedPreconditionError("head group: a reply before any command was taken");
  }
  return group_->Set(ReplyKey(next_ - 1, group_->rank()), EncodeReply(reply));
}

}  // namespace remotehead::server
