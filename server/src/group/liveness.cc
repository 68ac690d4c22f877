#include "remotehead/server/group/liveness.h"

#include <openssl/rand.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "group/exchange.h"
#include "group/lost_verdicts.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/group_log.h"

namespace remotehead::server {
namespace {

// What an entry is, bound into its seal (the log's kinds are others).
constexpr char kSession = 'S';
constexpr char kBeat = 'B';
constexpr char kAddress = 'A';
constexpr char kVerdict = 'V';
constexpr char kShared = 'P';
constexpr char kSettled = 'D';
constexpr size_t kLivenessNonceBytes = 16;

}  // namespace

absl::StatusOr<std::unique_ptr<Liveness>> Liveness::Start(const GroupConfig& config,
                                                          std::ostream* log, Timing timing,
                                                          std::unique_ptr<KeyValueStore> store,
                                                          bool joining) {
  std::unique_ptr<Liveness> liveness(new Liveness(config, std::move(store), log, timing));
  RETURN_IF_ERROR(liveness->OpenSession(joining));
  if (joining) {
    ASSIGN_OR_RETURN(const MeshEpoch now, liveness->NewestEpoch());
    liveness->epochs_.Resume(now);
    // Only the serving replicas' processes are watched (this one's are new, as it is).
    const int k = config.ranks_per_replica();
    for (int g = 0; g < config.size; ++g) {
      if (!now.serves(g / k)) liveness->last_change_.erase(g);
    }
  }
  liveness->thread_ = std::thread([l = liveness.get()] { l->Run(); });
  return liveness;
}

absl::StatusOr<bool> Liveness::MeshRunning(KeyValueStore& store, const GroupConfig& config) {
  ASSIGN_OR_RETURN(const bool session, store.Exists(store_keys::kSession));
  if (!session) return false;
  // A running mesh beats: some process's beat changes within a few beats. A store that outlived
  // its mesh (an external one, kept while every process stopped) holds a session nobody beats in.
  const auto beats = [&]() -> absl::StatusOr<std::vector<std::string>> {
    std::vector<std::string> values;
    for (int g = 0; g < config.size; ++g) {
      ASSIGN_OR_RETURN(const bool there, store.Exists(store_keys::Beat(g)));
      values.push_back(std::string());
      if (there) {
        ASSIGN_OR_RETURN(values.back(), store.Get(store_keys::Beat(g), config.timeout));
      }
    }
    return values;
  };
  ASSIGN_OR_RETURN(const std::vector<std::string> before, beats());
  const Timing timing;
  for (int look = 0; look < 5; ++look) {
    std::this_thread::sleep_for(timing.beat);
    ASSIGN_OR_RETURN(const std::vector<std::string> now, beats());
    if (now != before) return true;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the store at ", config.store_address(),
      " holds a mesh's session but no process of it beats: a store that outlived its mesh; "
      "start the store again with the mesh (remotehead-server --serve_group_store)"));
}

absl::StatusOr<MeshEpoch> Liveness::NewestEpoch() {
  MeshEpoch newest = MeshEpoch::First(config_.replicas);
  for (;;) {
    ASSIGN_OR_RETURN(const std::optional<std::string> record,
                     ReadSettled(store_keys::MeshEpochRecord(newest.number + 1)));
    if (!record.has_value()) return newest;
    ASSIGN_OR_RETURN(newest, MeshEpoch::Decode(*record));
  }
}

absl::Status Liveness::AskToJoin(int epoch) {
  return Publish(store_keys::MeshJoin(config_.rank), absl::StrCat(epoch));
}

absl::StatusOr<bool> Liveness::AskedToJoin(int replica, int epoch) {
  const int k = config_.ranks_per_replica();
  bool all = true;
  for (int s = 0; s < k; ++s) {
    const int g = replica * k + s;
    const std::string key = store_keys::MeshJoin(g);
    // One read (a request written between two would look forged), verified as Read does.
    ASSIGN_OR_RETURN(const std::optional<std::string> raw, Fetch(store_keys::Shared(key)));
    if (!raw.has_value()) {
      all = false;
      continue;
    }
    const std::optional<std::string> body = Opened(kShared, *raw);
    if (body.has_value() && body->starts_with(key + "\n")) {
      all = all && body->substr(key.size() + 1) == absl::StrCat(epoch);
      continue;
    }
    // Made without the group's secret: refused, said once, and taken away.
    all = false;
    if (log_ != nullptr) {
      *log_ << "remotehead-server: mesh: a request to join as " << Describe(g)
            << " was refused: it does not verify under the group's secret" << std::endl;
    }
    RETURN_IF_ERROR(Unpublish(key));
  }
  return all;
}

absl::Status Liveness::ForgetJoin(int replica) {
  const int k = config_.ranks_per_replica();
  for (int s = 0; s < k; ++s) RETURN_IF_ERROR(Unpublish(store_keys::MeshJoin(replica * k + s)));
  return absl::OkStatus();
}

absl::StatusOr<MeshEpoch> Liveness::AwaitAdmission() {
  int asked = -1;
  auto said = Clock::now();
  for (;;) {
    RETURN_IF_ERROR(health());
    const MeshEpoch now = epochs_.current();
    // Admitted: an epoch that says so (the replica may still serve in the epoch this process
    // found, its old process's loss not noticed yet: then it waits for the eviction first).
    if (!epochs_.joining()) return now;
    if (now.number != asked) {  // asked again in each epoch the mesh enters meanwhile
      RETURN_IF_ERROR(AskToJoin(now.number));
      asked = now.number;
      said = Clock::now();
    } else if (Clock::now() - said > std::chrono::seconds(30) && log_ != nullptr) {
      *log_ << "remotehead-server: mesh: still waiting to be admitted (in " << now.Describe()
            << "): every process of replica " << config_.replica() << " must ask" << std::endl;
      said = Clock::now();
    }
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait_for(lock, timing_.beat);
  }
}

Liveness::Liveness(const GroupConfig& config, std::unique_ptr<KeyValueStore> store,
                   std::ostream* log, Timing timing)
    : config_(config),
      store_(std::move(store)),
      log_(log),
      timing_(timing),
      epochs_(config, log,
              {.settle = [this](const std::string& key,
                                const std::string& proposed) { return Settle(key, proposed); },
               .describe = [this](int global_rank) { return Describe(global_rank); },
               .watch = [this](const MeshEpoch& entered) { Watch(entered); },
               .go_down = [this](const absl::Status& verdict) { GoDown(verdict, false); }}) {
  const Clock::time_point now = Clock::now();
  for (int r = 0; r < config_.size; ++r) {
    if (r != config_.rank) last_change_[r] = now;
  }
}

Liveness::~Liveness() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::Status Liveness::OpenSession(bool joining) {
  // Global rank 0 (whose process serves the store, fresh for every run, unless the store is
  // external: then it lives as long as the mesh) picks the session at the first rendezvous: a
  // beat or verdict recorded in another run never verifies in this one. A process joining the
  // running mesh reads it, global rank 0's too.
  if (config_.rank == 0 && !joining) {
    std::string nonce(kLivenessNonceBytes, '\0');
    if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), kLivenessNonceBytes) != 1) {
      return absl::InternalError("liveness: no random bytes for the session");
    }
    RETURN_IF_ERROR(
        store_->Set(store_keys::kSession, SealEntry(config_.secret, kSession, "", nonce)));
    session_ = nonce;
    return absl::OkStatus();
  }
  const absl::StatusOr<std::string> value = store_->Get(store_keys::kSession, config_.timeout);
  if (!value.ok()) {
    return absl::UnavailableError(
        absl::StrCat("liveness: global rank 0 did not publish the session within ",
                     Tenths(config_.timeout), " (", value.status().message(), ")"));
  }
  ASSIGN_OR_RETURN(session_, UnsealEntry(config_.secret, kSession, "", *value));
  return absl::OkStatus();
}

std::string Liveness::Sealed(char kind, const std::string& body) const {
  return SealEntry(config_.secret, kind, session_, body);
}

std::optional<std::string> Liveness::Opened(char kind, const std::string& value) const {
  absl::StatusOr<std::string> body = UnsealEntry(config_.secret, kind, session_, value);
  if (!body.ok()) return std::nullopt;
  return *std::move(body);
}

absl::Status Liveness::Publish(const std::string& key, const std::string& value) {
  return store_->Set(store_keys::Shared(key), Sealed(kShared, absl::StrCat(key, "\n", value)));
}

absl::Status Liveness::Unpublish(const std::string& key) {
  return store_->Delete(store_keys::Shared(key));
}

absl::StatusOr<std::optional<std::string>> Liveness::Fetch(const std::string& key) {
  ASSIGN_OR_RETURN(const bool there, store_->Exists(key));
  if (!there) return std::nullopt;
  ASSIGN_OR_RETURN(std::string value, store_->Get(key, timing_.beat));
  return value;
}

absl::StatusOr<std::optional<std::string>> Liveness::Read(const std::string& key) {
  ASSIGN_OR_RETURN(const std::optional<std::string> value, Fetch(store_keys::Shared(key)));
  if (!value.has_value()) return std::nullopt;
  // Bound to its key: a value copied to another key does not verify there.
  std::optional<std::string> body = Opened(kShared, *value);
  if (!body.has_value() || !body->starts_with(key + "\n")) return std::nullopt;
  return body->substr(key.size() + 1);
}

absl::StatusOr<std::string> Liveness::Settle(const std::string& key, const std::string& proposed) {
  const std::string where = store_keys::Settled(key);
  ASSIGN_OR_RETURN(
      const std::string now,
      store_->CompareSet(where, "", Sealed(kSettled, absl::StrCat(key, "\n", proposed))));
  return OpenSettled(key, where, now);
}

absl::StatusOr<std::string> Liveness::OpenSettled(const std::string& key, const std::string& where,
                                                  const std::string& value) const {
  // Bound to its key: a value settled for another key, or forged, does not verify here.
  std::optional<std::string> body = Opened(kSettled, value);
  if (!body.has_value() || !body->starts_with(key + "\n")) {
    return absl::DataLossError(absl::StrCat(
        "store key \"", where, "\": the value there does not verify with the group's secret (",
        value.size(), " bytes, written by a process outside the group?)"));
  }
  return body->substr(key.size() + 1);
}

absl::StatusOr<std::optional<std::string>> Liveness::ReadSettled(const std::string& key) {
  const std::string where = store_keys::Settled(key);
  ASSIGN_OR_RETURN(const std::optional<std::string> value, Fetch(where));
  if (!value.has_value()) return std::nullopt;
  return OpenSettled(key, where, *value);
}

absl::Status Liveness::Unsettle(const std::string& key) {
  return store_->Delete(store_keys::Settled(key));
}

void Liveness::Announce(const std::string& address) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    addresses_[config_.rank] = address;
  }
  const std::string body = absl::StrCat(config_.rank, " ", address);
  if (const absl::Status s = store_->Set(store_keys::Address(config_.rank), Sealed(kAddress, body));
      !s.ok() && log_ != nullptr) {
    *log_ << "remotehead-server: liveness: this process's address was not announced: "
          << s.message() << std::endl;
  }
}

std::string Liveness::Describe(int global_rank) const {
  std::string address;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = addresses_.find(global_rank); it != addresses_.end()) address = it->second;
  }
  const int k = config_.ranks_per_replica();
  return absl::StrCat("global rank ", global_rank, " (replica ", global_rank / k, ", shard ",
                      global_rank % k, ", at ", address.empty() ? "an unknown address" : address,
                      ")");
}

absl::Status Liveness::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return down_;
}

int Liveness::OnDown(std::function<void(const absl::Status&)> listener) {
  std::lock_guard<std::mutex> lock(calling_);
  listeners_[next_listener_] = std::move(listener);
  return next_listener_++;
}

void Liveness::RemoveListener(int id) {
  std::lock_guard<std::mutex> lock(calling_);
  listeners_.erase(id);
}

void Liveness::Watch(const MeshEpoch& entered) {
  const int k = config_.ranks_per_replica();
  {
    // The evicted replica's processes are no longer watched: their beats say nothing of the mesh.
    // An admitted replica's are new processes: watched from now on, as at the start.
    std::lock_guard<std::mutex> lock(mu_);
    for (int s = 0; s < k; ++s) {
      const int g = (entered.evicted >= 0 ? entered.evicted : entered.admitted) * k + s;
      if (g < 0 || g == config_.rank) continue;
      last_beat_.erase(g);
      if (entered.evicted >= 0) {
        last_change_.erase(g);
      } else {
        addresses_.erase(g);  // announced again
        last_change_[g] = Clock::now();
      }
    }
  }
  wake_.notify_all();
}

absl::Status Liveness::Lost(int global_rank, std::chrono::milliseconds since,
                            const std::string& first_seen) const {
  if (global_rank == kStoreProcess) return LostStoreVerdict(config_, first_seen);
  std::string address;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = addresses_.find(global_rank); it != addresses_.end()) address = it->second;
  }
  return LostProcessVerdict(config_,
                            {.global_rank = global_rank,
                             .described = Describe(global_rank),
                             .address = address,
                             .since = since},
                            first_seen);
}

std::pair<int, std::chrono::milliseconds> Liveness::StalledLocked(
    std::chrono::milliseconds at_least) const {
  const Clock::time_point now = Clock::now();
  const bool store_failing = store_failing_since_ != Clock::time_point::max();
  if (store_failing && now - store_failing_since_ >= at_least) {
    // The store's process: global rank 0, or the store's own (--group_store_external).
    return {config_.store_external ? kStoreProcess : 0, std::chrono::milliseconds(-1)};
  }
  // A store of its own that fails stops every beat it serves: no process is to blame (yet).
  if (store_failing && config_.store_external) return {kNoProcess, std::chrono::milliseconds(0)};
  int worst = -1;
  std::chrono::milliseconds longest{0};
  for (const auto& [rank, changed] : last_change_) {
    const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - changed);
    if (since >= at_least && since > longest) {
      worst = rank;
      longest = since;
    }
  }
  return {worst, longest};
}

bool NamesLostProcess(const absl::Status& status) {
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  return reason.has_value() && reason->metadata.contains("lost_rank");
}

bool NamesEvictedReplica(const absl::Status& status) {
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  return reason.has_value() && reason->reason == core::reason::kGroupUnavailable &&
         reason->metadata.contains("evicted");
}

bool NamesTampering(const absl::Status& status) {
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  return reason.has_value() && reason->reason == core::reason::kGroupUnavailable &&
         reason->metadata.contains("key");
}

absl::Status Liveness::Blame(const absl::Status& failure) {
  if ((failure.code() != absl::StatusCode::kUnavailable &&
       failure.code() != absl::StatusCode::kDeadlineExceeded) ||
      NamesTampering(failure)) {
    return failure;
  }
  // A process killed just now beat less than `stalled` ago: the evidence takes that long.
  const Clock::time_point deadline = Clock::now() + timing_.stalled + 2 * timing_.beat;
  const int epoch = epochs_.current().number;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (NamesLostProcess(down_)) return down_;  // another process named it already
    // Evicted meanwhile (its processes are no longer watched): the loss the epoch names.
    if (const MeshEpoch now = epochs_.current(); now.number != epoch) {
      lock.unlock();
      return EvictedLoss(now, failure);
    }
    const auto [rank, since] = StalledLocked(timing_.stalled);
    if (rank != kNoProcess) {
      lock.unlock();
      return Lost(rank, since, std::string(failure.message()));
    }
    if (Clock::now() >= deadline) return failure;
    wake_.wait_for(lock, timing_.beat / 4);
  }
}

absl::Status Liveness::EvictedLoss(const MeshEpoch& entered, const absl::Status& failure) const {
  const int k = config_.ranks_per_replica();
  return core::WithReason(
      absl::UnavailableError(absl::StrCat(entered.cause, ": replica ", entered.evicted,
                                          " was evicted (the mesh goes on in ", entered.Describe(),
                                          "; first seen as: ", failure.message(), ")")),
      core::reason::kGroupUnavailable,
      {{"rank", absl::StrCat(config_.rank)},
       {"lost_rank", absl::StrCat(entered.evicted * k)},
       {"lost_replica", absl::StrCat(entered.evicted)},
       {"epoch", absl::StrCat(entered.number)}});
}

void Liveness::DeclareDown(const absl::Status& verdict) {
  if (epochs_.Evict(verdict)) return;  // the mesh goes on without the lost process's replica
  GoDown(verdict, /*write=*/true);
}

void Liveness::GoDown(const absl::Status& verdict, bool write) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!down_.ok()) return;
    down_ = verdict;
  }
  wake_.notify_all();
  if (log_ != nullptr) {
    *log_ << "remotehead-server: " << (config_.replicas > 1 ? "mesh" : "head group")
          << " down: " << verdict.message() << std::endl;
  }
  if (write) {
    // Best effort: a store that is gone is itself the verdict every process finds.
    store_->Set(store_keys::kVerdict, Sealed(kVerdict, EncodeStatus(verdict))).IgnoreError();
  }
  std::lock_guard<std::mutex> calling(calling_);
  for (const auto& [id, listener] : listeners_) listener(verdict);
}

void Liveness::Beat() {
  const Clock::time_point now = Clock::now();
  std::set<int> known;  // the addresses read already (read once each)
  const MeshEpoch current = epochs_.current();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [rank, address] : addresses_) known.insert(rank);
  }
  // A process joining the mesh beats only once admitted: until then its global rank's beat is
  // its lost predecessor's, whose stop must still be seen (a restart must not hide a loss).
  absl::Status reached = epochs_.joining() ? store_->Exists(store_keys::kSession).status()
                                           : store_->Set(store_keys::Beat(config_.rank),
                                                         Sealed(kBeat, absl::StrCat(++beats_)));
  std::map<int, std::string> beats;
  std::map<int, std::string> addresses;
  std::optional<absl::Status> verdict;
  for (int r = 0; r < config_.size && reached.ok(); ++r) {
    if (r == config_.rank || !current.serves(r / config_.ranks_per_replica())) continue;
    absl::StatusOr<std::optional<std::string>> beat = Fetch(store_keys::Beat(r));
    reached = beat.status();
    if (beat.ok() && beat->has_value()) beats[r] = **std::move(beat);
    if (!reached.ok() || known.contains(r)) continue;
    const absl::StatusOr<std::optional<std::string>> announced = Fetch(store_keys::Address(r));
    std::optional<std::string> body;
    if (announced.ok() && announced->has_value()) body = Opened(kAddress, **announced);
    const size_t space = body.has_value() ? body->find(' ') : std::string::npos;
    int rank = -1;
    if (space != std::string::npos && absl::SimpleAtoi(body->substr(0, space), &rank) &&
        rank == r) {
      addresses[r] = body->substr(space + 1);
    }
  }
  if (reached.ok()) {
    const absl::StatusOr<std::optional<std::string>> declared = Fetch(store_keys::kVerdict);
    if (declared.ok() && declared->has_value()) {
      if (std::optional<std::string> body = Opened(kVerdict, **declared)) {
        verdict = DecodeStatus(*body);
      }
    }
  }
  // The next epoch, settled by another process (a record that does not verify changes nothing).
  std::optional<MeshEpoch> next_epoch;
  if (reached.ok() && epochs_.evicts() && !verdict.has_value()) {
    const absl::StatusOr<std::optional<std::string>> record =
        ReadSettled(store_keys::MeshEpochRecord(current.number + 1));
    if (record.ok() && record->has_value()) {
      if (absl::StatusOr<MeshEpoch> next = MeshEpoch::Decode(**record); next.ok()) {
        next_epoch = *std::move(next);
      }
    }
  }
  int lost = kNoProcess;
  std::chrono::milliseconds lost_since{0};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reached.ok()) {
      store_failing_since_ = Clock::time_point::max();
    } else if (store_failing_since_ == Clock::time_point::max()) {
      store_failing_since_ = now;
    }
    for (auto& [r, value] : beats) {
      // A value that does not verify (forged, replayed) is not a beat: it changes nothing; a
      // replica evicted meanwhile is no longer watched.
      if (!current.serves(r / config_.ranks_per_replica())) continue;
      if (value != last_beat_[r] && Opened(kBeat, value).has_value()) {
        last_beat_[r] = value;
        last_change_[r] = now;
      }
    }
    addresses_.insert(addresses.begin(), addresses.end());
    if (down_.ok() && !verdict.has_value()) {
      std::tie(lost, lost_since) = StalledLocked(timing_.lost);
    }
  }
  // A beat stopped for `stalled` at an address that refuses connections: that process is gone,
  // no need to wait for the group's timeout.
  if (lost == kNoProcess && health().ok() && !verdict.has_value()) {
    std::tie(lost, lost_since) = Gone();
  }
  wake_.notify_all();  // a Blame waiting for evidence looks again
  if (next_epoch.has_value()) epochs_.Adopt(*next_epoch);
  if (verdict.has_value()) {
    GoDown(*verdict, /*write=*/false);
  } else if (lost != kNoProcess) {
    DeclareDown(Lost(lost, lost_since, ""));
  }
}

std::pair<int, std::chrono::milliseconds> Liveness::Gone() const {
  std::vector<std::tuple<int, std::chrono::milliseconds, std::string>> stalled;
  std::optional<bool> store_stalled;  // set while a store of its own fails: no beat is read
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    if (store_failing_since_ != Clock::time_point::max() && config_.store_external) {
      store_stalled = now - store_failing_since_ >= timing_.stalled;
    }
  }
  if (store_stalled.has_value()) {  // only the store's own process may be found gone
    if (*store_stalled && Refuses(config_.store_address()))
      return {kStoreProcess, std::chrono::milliseconds(-1)};
    return {kNoProcess, std::chrono::milliseconds(0)};
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    for (const auto& [rank, changed] : last_change_) {
      const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - changed);
      auto address = addresses_.find(rank);
      if (since >= timing_.stalled && address != addresses_.end()) {
        stalled.emplace_back(rank, since, address->second);
      }
    }
  }
  for (const auto& [rank, since, address] : stalled) {
    if (Refuses(address)) return {rank, since};
  }
  return {kNoProcess, std::chrono::milliseconds(0)};
}

void Liveness::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    Beat();
    lock.lock();
    wake_.wait_for(lock, timing_.beat, [this] { return stop_; });
  }
}

}  // namespace remotehead::server
