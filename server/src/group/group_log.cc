#include "remotehead/server/group/group_log.h"

#include <openssl/rand.h>

#include <algorithm>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "group/log_format.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/liveness.h"

namespace remotehead::server {
namespace {

// The log's bytes (log_format.h): keys, kinds, layouts, seals; this file reads and writes them.
using namespace log_format;

}  // namespace

GroupLog::GroupLog(ProcessGroup* group, std::string secret, std::ostream* log)
    : group_(group), secret_(std::move(secret)), log_(log) {}

void GroupLog::LogRefused(const std::string& key, const absl::Status& verdict) {
  if (log_ == nullptr) return;
  *log_ << "remotehead-server: head group rank " << group_->rank() << ": refused the entry at \""
        << key << "\", not executed: " << verdict.message() << std::endl;
}

absl::StatusOr<GroupLog::Entry> GroupLog::ReadValid(
    const std::string& key, char kind, Clock::time_point deadline,
    const std::function<absl::Status(const std::string&)>& check, std::string* refused,
    const std::function<absl::Status()>& watch) {
  auto watched = Clock::now();
  for (;;) {
    // With a watch, the wait for the key is cut into slices and the watch runs between them.
    const std::chrono::milliseconds slice =
        watch ? std::min(Remaining(deadline), kWatchPoll) : Remaining(deadline);
    absl::StatusOr<std::string> got = group_->Get(key, slice);
    if (!got.ok()) {
      if (!watch || got.status().code() != absl::StatusCode::kDeadlineExceeded ||
          Clock::now() >= deadline) {
        return got.status();
      }
      RETURN_IF_ERROR(watch());
      watched = Clock::now();
      continue;
    }
    std::string value = *std::move(got);
    if (value != *refused) {
      absl::StatusOr<std::string> body = Unseal(secret_, static_cast<Kind>(kind), *session_, value);
      const absl::Status verdict = body.ok() ? check(*body) : body.status();
      if (verdict.ok()) {
        refused->clear();
        return Entry{.body = *std::move(body), .seal = value.substr(value.size() - kSealBytes)};
      }
      if (verdict.code() != absl::StatusCode::kPermissionDenied) return verdict;
      LogRefused(key, verdict);
      *refused = std::move(value);
    }
    // A refused entry stays until someone writes over it: read again until it changes.
    const auto now = Clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("only a refused entry at \"", key, "\" (see the server's log)"));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(kRefusedPoll, deadline - now));
    if (watch && Clock::now() - watched >= kWatchPoll) {
      RETURN_IF_ERROR(watch());
      watched = Clock::now();
    }
  }
}

std::string GroupLog::Tampering(const std::string& key, const std::string& what,
                                const std::string& how) const {
  return absl::StrCat("the store key \"", CommandLogStoreKey(group_->config(), key), "\" (", what,
                      ") was ", how, " by someone without the group's secret");
}

absl::Status GroupLog::Tampered(const std::string& key, const std::string& what,
                                const std::string& how) {
  const std::string message =
      absl::StrCat("head group: ", Tampering(key, what, how),
                   ": a stranger reaches the group's store — the group goes down; fence the store "
                   "(docs/security.md) and restart every rank of the group");
  if (log_ != nullptr) {
    *log_ << "remotehead-server: head group rank " << group_->rank() << ": " << message
          << std::endl;
  }
  return core::WithReason(
      absl::UnavailableError(message), core::reason::kGroupUnavailable,
      {{"key", CommandLogStoreKey(group_->config(), key)}, {"rank", absl::StrCat(group_->rank())}});
}

absl::Status GroupLog::WatchPending(int64_t seq, const std::string& written, int rank) {
  const std::string key = store_keys::Command(seq);
  const std::string what = absl::StrCat("command ", seq, ", not yet answered by every rank");
  ASSIGN_OR_RETURN(const bool there, group_->Exists(key));
  if (!there) return Tampered(key, what, "deleted");
  absl::StatusOr<std::string> value = group_->Get(key, kJustSeen);
  if (!value.ok() && value.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return Tampered(key, what, "deleted");  // between the two calls: only a stranger deletes it
  }
  RETURN_IF_ERROR(value.status());
  if (*value != written) return Tampered(key, what, "overwritten");

  // The awaited rank's report that its reply to this command was changed after it wrote it (a
  // report about an earlier command, whose reply the front took, changes nothing).
  const std::string report_key = store_keys::Tampered(rank);
  ASSIGN_OR_RETURN(const bool reported, group_->Exists(report_key));
  if (!reported) return absl::OkStatus();
  absl::StatusOr<std::string> report = group_->Get(report_key, kJustSeen);
  if (!report.ok() && report.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return Tampered(report_key, absl::StrCat("rank ", rank, "'s report"), "deleted");
  }
  RETURN_IF_ERROR(report.status());
  const absl::StatusOr<std::string> body = Unseal(secret_, Kind::kTampered, *session_, *report);
  if (!body.ok() || body->size() <= kSeqBytes) {
    // No rank writes an entry there that does not verify: a stranger did.
    return Tampered(report_key, absl::StrCat("rank ", rank, "'s report"), "written");
  }
  if (ReadFixed64(*body) != seq) return absl::OkStatus();
  return Tampered(
      store_keys::Reply(seq, rank),
      absl::StrCat("rank ", rank, "'s reply to command ", seq, ", as rank ", rank, " reports"),
      body->substr(kSeqBytes));
}

absl::Status GroupLog::WatchOwnReply() {
  if (written_reply_.empty()) return absl::OkStatus();
  const int64_t seq = next_ - 1;
  const std::string key = store_keys::Reply(seq, group_->rank());
  std::optional<std::string> value;
  ASSIGN_OR_RETURN(const bool there, group_->Exists(key));
  if (there) {
    absl::StatusOr<std::string> got = group_->Get(key, kJustSeen);
    if (got.ok()) {
      value = *std::move(got);
    } else if (got.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return got.status();
    }
  }
  std::string how;
  if (value.has_value()) {
    if (*value == written_reply_) return absl::OkStatus();
    how = "overwritten";
  } else {
    // The front deletes the command's key before the replies': with the command still there,
    // the reply was not the front's to delete.
    ASSIGN_OR_RETURN(const bool command_there, group_->Exists(store_keys::Command(seq)));
    if (!command_there) {
      written_reply_.clear();  // the front took it
      return absl::OkStatus();
    }
    how = "deleted";
  }
  written_reply_.clear();  // reported once
  // The front judges it: it fails the command if it had not taken this reply yet (WatchPending).
  if (log_ != nullptr) {
    *log_ << "remotehead-server: head group rank " << group_->rank() << ": "
          << Tampering(key, absl::StrCat("this rank's reply to command ", seq), how)
          << ": reported to the front (the command fails unless the front had taken the reply)"
          << std::endl;
  }
  return group_->Set(store_keys::Tampered(group_->rank()),
                     Seal(secret_, Kind::kTampered, *session_, Fixed64(seq) + how));
}

absl::Status GroupLog::Open() {
  if (session_.has_value()) return absl::OkStatus();
  const int size = group_->size();
  const int rank = group_->rank();
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), kNonceBytes) != 1) {
    return absl::InternalError("head group: no random bytes for this rank's nonce");
  }
  RETURN_IF_ERROR(
      group_->Set(store_keys::Hello(rank), Seal(secret_, Kind::kHello, "", Fixed64(rank) + nonce)));
  const auto timeout = group_->config().timeout;
  const auto deadline = Clock::now() + timeout;
  std::string nonces;
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      nonces += nonce;
      continue;
    }
    absl::StatusOr<std::string> value = group_->Get(store_keys::Hello(r), Remaining(deadline));
    if (!value.ok()) {
      return absl::UnavailableError(
          absl::StrCat("head group: rank ", r, " of ", size, " did not publish its nonce within ",
                       timeout.count() / 1000.0, " s (", value.status().message(), ")"));
    }
    absl::StatusOr<std::string> body = Unseal(secret_, Kind::kHello, "", *value);
    if (body.ok() && (body->size() != kSeqBytes + kNonceBytes || ReadFixed64(*body) != r)) {
      body = absl::PermissionDeniedError("it is another rank's");
    }
    if (!body.ok()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "head group: rank ", r, "'s nonce does not verify (", body.status().message(),
          "): every rank needs the same --group_secret_file, or none on loopback"));
    }
    nonces += body->substr(kSeqBytes);
  }
  session_ = Sha256(nonces);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> GroupLog::Append(const std::string& command) {
  RETURN_IF_ERROR(Open());
  const int64_t seq = next_;
  const std::string value = Seal(secret_, Kind::kCommand, *session_, Fixed64(seq) + command);
  RETURN_IF_ERROR(group_->Set(store_keys::Command(seq), value));
  commands_[seq] = value;
  ++next_;
  return seq;
}

absl::StatusOr<std::vector<std::string>> GroupLog::AwaitReplies(int64_t seq) {
  return AwaitReplies(seq, group_->config().timeout);
}

absl::StatusOr<std::vector<std::string>> GroupLog::AwaitReplies(int64_t seq,
                                                                std::chrono::milliseconds wait) {
  RETURN_IF_ERROR(Open());
  const auto found = commands_.find(seq);
  if (found == commands_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("head group: replies awaited for command ", seq, ", which was not appended"));
  }
  const std::string written = std::move(found->second);
  commands_.erase(found);
  const std::string command_seal = written.substr(written.size() - kSealBytes);
  // While the replies are awaited, the command is re-read: a stranger's change fails it at once.
  absl::Status tampered;
  int awaited = 0;
  auto watch = [&] {
    // The command or a reply changed by a stranger first: that is what the answer says, even
    // when the rank that left it pending is declared lost meanwhile (liveness.h: NamesTampering).
    tampered = WatchPending(seq, written, awaited);
    if (NamesTampering(tampered)) return tampered;
    // A group or mesh declared down meanwhile: its verdict, not a wait for ranks that will never
    // answer.
    if (abandon_) {
      if (absl::Status down = abandon_(); !down.ok()) return tampered = down;
    }
    return tampered;
  };
  const auto deadline = Clock::now() + wait;
  std::vector<std::string> payloads;
  absl::Status first_error;
  // Every rank's reply is read up to the same deadline, and every rank that missed it is named:
  // a rank killed mid-command and a live one slowed by the failure it meets both miss a short
  // grace, and the message must name the dead one too, not only the first in rank order.
  std::vector<std::string> missing;
  std::string missing_detail;
  for (int rank = 1; rank < group_->size(); ++rank) {
    awaited = rank;
    // A reply verifies only for this command (its seq, this rank, the command's seal).
    absl::Status diverged;
    auto check = [&](const std::string& body) -> absl::Status {
      if (body.size() < kReplyHeadBytes || ReadFixed64(body) != seq ||
          ReadFixed64(std::string_view(body).substr(kSeqBytes)) != rank) {
        return absl::PermissionDeniedError(
            "an authentic reply copied from another command or rank (a replay)");
      }
      if (body.compare(2 * kSeqBytes, kSealBytes, command_seal) != 0) {
        return diverged = absl::UnavailableError(absl::StrCat(
                   "head group: the group's log diverged: rank ", rank, "'s reply to command ", seq,
                   " answers another command than the front's — restart every rank of the group"));
      }
      return absl::OkStatus();
    };
    std::string refused;
    absl::StatusOr<Entry> entry =
        ReadValid(store_keys::Reply(seq, rank), static_cast<char>(Kind::kReply), deadline, check,
                  &refused, watch);
    if (!diverged.ok()) return diverged;
    if (!tampered.ok()) return tampered;
    if (!entry.ok()) {
      missing.push_back(absl::StrCat("rank ", rank));
      if (missing_detail.empty()) missing_detail = std::string(entry.status().message());
      continue;
    }
    ASSIGN_OR_RETURN(GroupReply reply, DecodeReply(entry->body.substr(kReplyHeadBytes)));
    if (!reply.status.ok() && first_error.ok()) {
      first_error = core::WithSerializedReason(
          absl::Status(reply.status.code(),
                       absl::StrCat("head group rank ", rank, ": ", reply.status.message())),
          core::SerializeReason(reply.status));
    }
    payloads.push_back(std::move(reply.payload));
  }
  if (!missing.empty()) {
    return absl::UnavailableError(absl::StrCat("head group: ", absl::StrJoin(missing, " and "),
                                               " of ", group_->size(), " did not reply to command ",
                                               seq, " within ", wait.count() / 1000.0, " s (",
                                               missing_detail, ")"));
  }
  // Every rank has taken and answered the command: its keys are no longer needed.
  RETURN_IF_ERROR(group_->Delete(store_keys::Command(seq)));
  for (int rank = 1; rank < group_->size(); ++rank) {
    RETURN_IF_ERROR(group_->Delete(store_keys::Reply(seq, rank)));
  }
  if (!first_error.ok()) return first_error;
  return payloads;
}

absl::Status GroupLog::DeclareDown(const std::string& reason) {
  RETURN_IF_ERROR(Open());
  return group_->Set(store_keys::kLogDown,
                     Seal(secret_, Kind::kDown, *session_, Fixed64(group_->rank()) + reason));
}

absl::StatusOr<std::string> GroupLog::Next(std::chrono::milliseconds wait) {
  RETURN_IF_ERROR(Open());
  const int64_t seq = next_;
  auto check = [&](const std::string& body) -> absl::Status {
    if (body.size() < kSeqBytes || ReadFixed64(body) != seq) {
      return absl::PermissionDeniedError(
          "an authentic command copied from another place in the log (a replay)");
    }
    return absl::OkStatus();
  };
  ASSIGN_OR_RETURN(
      Entry entry,
      ReadValid(store_keys::Command(seq), static_cast<char>(Kind::kCommand), Clock::now() + wait,
                check, &refused_command_, [this] { return WatchOwnReply(); }));
  taken_seal_ = std::move(entry.seal);
  written_reply_.clear();  // the front appended the next command: it took the last reply
  ++next_;
  return entry.body.substr(kSeqBytes);
}

absl::Status GroupLog::Reply(const GroupReply& reply) {
  if (next_ == 0) {
    return absl::FailedPreconditionError("head group: a reply before any command was taken");
  }
  const int64_t seq = next_ - 1;
  const std::string body =
      Fixed64(seq) + Fixed64(group_->rank()) + taken_seal_ + EncodeReply(reply);
  std::string value = Seal(secret_, Kind::kReply, *session_, body);
  RETURN_IF_ERROR(group_->Set(store_keys::Reply(seq, group_->rank()), value));
  written_reply_ = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> GroupLog::DownDeclared() {
  RETURN_IF_ERROR(Open());
  return ReadSigned(
      store_keys::kLogDown, static_cast<char>(Kind::kDown), [](int64_t rank) { return rank == 0; },
      "a declaration not made by the front", &refused_down_);
}

absl::StatusOr<std::optional<std::string>> GroupLog::ReadSigned(
    const std::string& key, char kind, const std::function<bool(int64_t rank)>& by,
    const std::string& not_by, std::string* refused) {
  ASSIGN_OR_RETURN(const bool there, group_->Exists(key));
  if (!there) return std::nullopt;
  ASSIGN_OR_RETURN(const std::string value, group_->Get(key, group_->config().timeout));
  if (value == *refused) return std::nullopt;
  absl::StatusOr<std::string> body = Unseal(secret_, static_cast<Kind>(kind), *session_, value);
  if (body.ok() && (body->size() < kSeqBytes || !by(ReadFixed64(*body)))) {
    body = absl::PermissionDeniedError(not_by);
  }
  if (!body.ok()) {
    LogRefused(key, body.status());
    *refused = value;
    return std::nullopt;
  }
  return body->substr(kSeqBytes);
}

// ----- drain requests (replication/cluster_drain.h) -----
//
// Kept apart from the log's commands: a request is no command (the front decides what the drain
// runs, through the log), and any rank may write one. Sealed like every entry, under a kind of
// its own, so a forged request drains nothing and a command never reads as one.

namespace {
constexpr auto kDrainKind = static_cast<Kind>('Q');
}  // namespace

absl::Status GroupLog::RequestDrain(const std::string& reason) {
  RETURN_IF_ERROR(Open());
  return group_->Set(store_keys::kDrainRequest,
                     Seal(secret_, kDrainKind, *session_, Fixed64(group_->rank()) + reason));
}

absl::StatusOr<std::optional<std::string>> GroupLog::DrainRequested() {
  RETURN_IF_ERROR(Open());
  const int64_t size = group_->size();
  return ReadSigned(
      store_keys::kDrainRequest, static_cast<char>(kDrainKind),
      [size](int64_t rank) { return rank >= 0 && rank < size; },
      "a request that names no rank of the group", &refused_drain_);
}

}  // namespace remotehead::server
