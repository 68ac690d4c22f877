// The ordered command log of a head group, kept in the group's store: rank 0 (the front) appends
// commands, every other rank takes them in order, executes them and replies with a status. It
// is how every rank executes the same operations in the same order, so that the collectives
// inside them pair up.
//
// The store (c10d's TCPStore) has no authentication: anyone who reaches its port can read, write
// and delete keys. So every entry is sealed with an HMAC-SHA256 under the group's secret
// (--group_secret_file) over its kind, the group's session, its sequence number and its content:
//   - the session is fixed when the log opens: every rank publishes a fresh random nonce (sealed
//     too) and the session is the hash of every rank's nonce, so an entry recorded from an earlier
//     run of the group never verifies in this one;
//   - a command binds its sequence number; a reply binds the command's sequence number, the
//     replying rank and the command's own seal, so a reply answers exactly one command;
//   - an entry that does not verify (forged, garbage, or an authentic one copied to another key:
//     a replay) is refused, logged and never executed; the reader waits for a valid entry at that
//     key until its deadline;
//   - an authentic reply to another command at this command's key means the log diverged: the
//     front fails the command UNAVAILABLE, which takes the group down (head_group.h);
//   - a pending entry tampered with is detected, never waited out: while the front awaits the
//     replies to a command it re-reads the command's key (every 100 ms of waiting) and compares
//     the bytes it wrote; each other rank, while it waits for the next command, re-reads the
//     reply it wrote until the front took it (the front deletes the command's key before the
//     replies', so a reply gone while its command's key is there was deleted by someone else)
//     and, finding it overwritten or deleted, logs it and reports it under "tampered/<rank>"
//     (sealed). A command overwritten or deleted, a report about the awaited reply, or an entry
//     at a report key that does not verify fails the front's command at once UNAVAILABLE
//     (GROUP_UNAVAILABLE, metadata "key": the full store key) saying the key was overwritten by
//     someone without the group's secret, and logs it: the group goes down (head_group.h). Only
//     the rank can tell that its reply was there (a stranger's entry written at a reply key
//     *before* the rank's reply, which then overwrites it, is refused as above and harmless),
//     and only the front whether it had taken it (a report about a reply it took is ignored).
// Without a secret (a group on loopback only), the seals use an empty key: entries are still
// checked for order, session and integrity, but any local process could forge them.
//
// Keys (under the group's command prefix): "hello/<rank>" the ranks' nonces, "cmd/<seq>" command
// <seq>, "reply/<seq>/<rank>" a rank's reply (the front removes both once every reply is in),
// "down": the front's declaration that the group is down, with its reason (every other rank
// leaves the group when it sees it, instead of running a command the front gave up on), and
// "tampered/<rank>": a rank's report that its reply was overwritten or deleted, and "drain": a
// rank's request that the front drain the group (SIGTERM on that rank), sealed too. In the store
// they are under CommandLogPrefix (process_group.h), e.g. "remotehead/commands/cmd/5".
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

struct GroupReply {
  absl::Status status;
  std::string payload;
};

class GroupLog {
 public:
  // `secret`: the group's shared secret (empty: none, see above). Refused entries are logged to
  // `log` (nullptr: not logged), one line each.
  explicit GroupLog(ProcessGroup* group, std::string secret = "", std::ostream* log = nullptr);

  // Publishes this rank's nonce and reads every other rank's (up to the group's timeout): the
  // session every later entry is sealed under. Called by the first call below if not before.
  // UNAVAILABLE naming the rank whose nonce did not come in time; PERMISSION_DENIED naming the
  // rank whose nonce does not verify (the ranks' secrets differ).
  absl::Status Open();

  // Front: appends `command`; returns its sequence number (0, 1, 2, … in append order).
  absl::StatusOr<int64_t> Append(const std::string& command);
  // Front: every other rank's reply to command `seq`, by rank (index r - 1 for rank r), waiting
  // up to `wait` in all. A rank without a valid reply in time makes it UNAVAILABLE naming the
  // rank and the command; an authentic reply to another command makes it UNAVAILABLE saying the
  // log diverged; otherwise, once every reply is in, the first rank that replied with an error
  // makes it that error, prefixed with the rank. A command or reply tampered with meanwhile (see
  // above) makes it UNAVAILABLE (GROUP_UNAVAILABLE) naming the key at once.
  absl::StatusOr<std::vector<std::string>> AwaitReplies(int64_t seq,
                                                        std::chrono::milliseconds wait);
  // As above, waiting up to the group's timeout.
  absl::StatusOr<std::vector<std::string>> AwaitReplies(int64_t seq);
  // Front: records that the group is down because of `reason` (every other rank leaves).
  absl::Status DeclareDown(const std::string& reason);

  // Other ranks: the next valid command, waiting up to `wait`; DEADLINE_EXCEEDED if none came in
  // time (the caller may check for shutdown and ask again), UNAVAILABLE if the store (served by
  // rank 0) is gone. While it waits, it checks the reply this rank last wrote (see above).
  absl::StatusOr<std::string> Next(std::chrono::milliseconds wait);
  // Other ranks: the reply to the command that Next() last returned.
  absl::Status Reply(const GroupReply& reply);
  // Other ranks: the front's declaration that the group is down (its reason), if it made one.
  absl::StatusOr<std::optional<std::string>> DownDeclared();

  // Any rank: asks the front to drain the group (replication/cluster_drain.h) because of
  // `reason`: a sealed entry at "drain" (a later request writes over an earlier one).
  absl::Status RequestDrain(const std::string& reason);
  // Front: the reason of a rank's drain request ("SIGTERM on global rank 3"), if one was made; a
  // request that does not verify is refused, logged once and never obeyed.
  absl::StatusOr<std::optional<std::string>> DrainRequested();

  // Front: while replies are awaited, `abandon` is asked (every poll); a status that is not OK
  // ends the wait with it (the group or mesh was declared down: liveness.h).
  void set_abandon(std::function<absl::Status()> abandon) { abandon_ = std::move(abandon); }

  int64_t next_seq() const { return next_; }

 private:
  // An entry read and verified: its body (without the seal) and its seal.
  struct Entry {
    std::string body;
    std::string seal;
  };
  // The entry of `kind` at `key` whose seal verifies and whose body `check` takes, waiting
  // until `deadline`. `check` returns OK, or PERMISSION_DENIED for an entry to refuse (as one
  // whose seal does not verify: logged once, then the key is read again until its value
  // changes), or any other error to return at once (a divergence). `refused` keeps the refused
  // value between calls. DEADLINE_EXCEEDED when no valid entry came in time. `watch` (if any)
  // runs about every kWatchPoll while the entry is missing or refused; its error is returned.
  absl::StatusOr<Entry> ReadValid(const std::string& key, char kind,
                                  std::chrono::steady_clock::time_point deadline,
                                  const std::function<absl::Status(const std::string&)>& check,
                                  std::string* refused,
                                  const std::function<absl::Status()>& watch = nullptr);
  void LogRefused(const std::string& key, const absl::Status& verdict);
  // The body after the rank of the sealed entry of `kind` at `key` (a declaration, a request),
  // if there is one that verifies and whose rank `by` takes; one that does not is logged once
  // (`not_by` saying why for a wrong rank) and remembered in `refused`, then ignored.
  absl::StatusOr<std::optional<std::string>> ReadSigned(const std::string& key, char kind,
                                                        const std::function<bool(int64_t)>& by,
                                                        const std::string& not_by,
                                                        std::string* refused);
  // Front, awaiting `rank`'s reply to command `seq`: the command still at its key as `written`,
  // and no report from `rank` that its reply to `seq` was changed.
  absl::Status WatchPending(int64_t seq, const std::string& written, int rank);
  // Other ranks: the reply this rank last wrote still there as written, until the front took it;
  // reported under "tampered/<rank>" (and logged) otherwise.
  absl::Status WatchOwnReply();
  // "the store key "<full key>" (<what>) was <how> by someone without the group's secret".
  std::string Tampering(const std::string& key, const std::string& what,
                        const std::string& how) const;
  // UNAVAILABLE (GROUP_UNAVAILABLE, metadata "key": the full store key) saying so; logged.
  absl::Status Tampered(const std::string& key, const std::string& what, const std::string& how);

  ProcessGroup* group_;
  const std::string secret_;
  std::ostream* log_;
  std::optional<std::string> session_;  // set by Open()
  int64_t next_ = 0;  // front: the next command's seq; other ranks: the next one to take
  std::map<int64_t, std::string> commands_;  // front: commands awaiting replies, as written
  std::string taken_seal_;                   // other ranks: of the command last taken
  std::string written_reply_;    // other ranks: the reply last written, until the front took it
  std::string refused_command_;  // other ranks: the refused value at cmd/<next_>, if any
  std::string refused_down_;     // other ranks: a refused value at "down", if any
  std::string refused_drain_;    // front: a refused value at "drain", if any
  std::function<absl::Status()> abandon_;  // front: set_abandon
};

// `body` sealed as the log seals its entries (the HMAC-SHA256 of `kind`, `session` and `body`
// under `secret`, appended), and back: the body, or PERMISSION_DENIED if the seal does not
// verify. The log's kinds are 'H', 'C', 'R', 'D'; liveness.h seals its beats and verdict so, with
// kinds of its own.
std::string SealEntry(const std::string& secret, char kind, const std::string& session,
                      const std::string& body);
absl::StatusOr<std::string> UnsealEntry(const std::string& secret, char kind,
                                        const std::string& session, const std::string& value);

// A reply's status and payload as sealed in the log (exposed for tests).
std::string EncodeReply(const GroupReply& reply);
absl::StatusOr<GroupReply> DecodeReply(const std::string& bytes);

}  // namespace remotehead::server
