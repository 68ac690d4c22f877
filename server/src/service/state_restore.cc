#include "service/state_restore.h"

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "group/exchange.h"
#include "remotehead/core/head_state.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/service/operator_files.h"

namespace remotehead::server {
namespace {

using Listing = std::map<std::string, std::vector<std::string>>;  // head dir -> state ids

// A listing as one string ("<head dir>\t<id>,<id>…" per head) and back; the names hold neither
// '\t' nor ',' (%-escaped head ids, StateStore's ids).
std::string EncodeListing(const Listing& listing) {
  std::vector<std::string> heads;
  for (const auto& [dir, ids] : listing)
    heads.push_back(absl::StrCat(dir, "\t", absl::StrJoin(ids, ",")));
  return PackStrings(heads);
}

absl::StatusOr<Listing> DecodeListing(const std::string& bytes) {
  ASSIGN_OR_RETURN(const std::vector<std::string> heads, UnpackStrings(bytes));
  Listing listing;
  for (const std::string& head : heads) {
    const std::vector<std::string> parts = absl::StrSplit(head, '\t');
    if (parts.size() != 2) return absl::InternalError("--state_dir: a listing that is not one");
    listing[parts[0]] = absl::StrSplit(parts[1], ',', absl::SkipEmpty());
  }
  return listing;
}

// Every rank's outcome (OK, or why it cannot go on) and payload, exchanged: the first failure
// (naming its rank) on every rank, else every rank's payload.
absl::StatusOr<std::vector<std::string>> Exchange(const Cluster& cluster, const absl::Status& mine,
                                                  const std::string& payload) {
  ASSIGN_OR_RETURN(const std::vector<std::string> all,
                   cluster.AllGather(PackStrings({EncodeStatus(mine), payload})));
  std::vector<std::string> payloads;
  for (size_t rank = 0; rank < all.size(); ++rank) {
    ASSIGN_OR_RETURN(const std::vector<std::string> parts, UnpackStrings(all[rank]));
    if (parts.size() != 2) return absl::InternalError("--state_dir: a malformed exchange");
    const absl::Status status = DecodeStatus(parts[0]);
    if (!status.ok()) {
      return all.size() == 1
                 ? status
                 : absl::Status(status.code(), absl::StrCat("rank ", rank, ": ", status.message()));
    }
    payloads.push_back(parts[1]);
  }
  return payloads;
}

// For each head any rank holds: the newest state id every rank holds ("" if there is none).
absl::StatusOr<std::map<std::string, std::string>> NewestCommon(
    const std::vector<std::string>& listings) {
  std::map<std::string, std::map<std::string, size_t>> holders;  // head dir -> id -> ranks
  for (const std::string& bytes : listings) {
    ASSIGN_OR_RETURN(const Listing listing, DecodeListing(bytes));
    for (const auto& [dir, ids] : listing) {
      for (const std::string& id : ids) ++holders[dir][id];
    }
  }
  std::map<std::string, std::string> chosen;
  for (const auto& [dir, ids] : holders) {
    std::string& newest = chosen[dir];
    for (const auto& [id, ranks] : ids) {  // ids begin with their creation time: in order
      if (ranks == listings.size()) newest = id;
    }
  }
  return chosen;
}

// This rank's shard of `state` registered and restored; FAILED_PRECONDITION naming the file
// when the state holds other rows than this rank's (saved by another layout of the group).
absl::Status RestoreOne(const core::HeadState& state, const std::string& file,
                        const Cluster& cluster, const torch::Device& device,
                        HeadRegistry* registry) {
  const int64_t vocab_size = state.vocab_size > 0 ? state.vocab_size : state.weight.size(0);
  std::vector<core::ShardRange> shards;
  int64_t offset = 0;
  if (const Placement placement = cluster.placement(); placement.sharded()) {
    ASSIGN_OR_RETURN(shards, placement.Ranges(vocab_size, "vocab_size"));
    offset = shards.at(static_cast<size_t>(placement.rank())).offset;
  }
  if (const absl::Status rows = core::CheckHeadStateRows(state, vocab_size, offset); !rows.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir: \"", file, "\": ", rows.message()));
  }
  ASSIGN_OR_RETURN(auto head,
                   core::Head::FromTensors(state.weight, state.bias,
                                           {.device = device, .grad_dtype = state.grad_dtype}));
  ASSIGN_OR_RETURN(auto entry, registry->Add(state.head_id, std::move(head), 0, std::move(shards),
                                             state.frozen));
  return entry->RestoreState(state, /*at_start=*/true);
}

}  // namespace

std::string RankStateDir(const std::string& dir, const GroupConfig& config) {
  return config.size > 1 ? absl::StrCat(dir, "/rank-", config.rank) : dir;
}

absl::StatusOr<std::unique_ptr<StateStore>> OpenStateStore(const StateDirOptions& options,
                                                           const GroupConfig& config,
                                                           std::ostream& log) {
  if (options.dir.empty()) {
    if (options.secret_file.empty()) return nullptr;
    return absl::InvalidArgumentError(
        "--state_secret_file: expected with --state_dir (it seals the states saved there); got "
        "no --state_dir");
  }
  core::StateSecret secret;
  if (!options.secret_file.empty()) {
    ASSIGN_OR_RETURN(secret.secret, ReadSecretFile("state_secret_file", options.secret_file));
    secret.origin = "--state_secret_file";
  } else if (config.size > 1 && !config.secret.empty()) {
    secret = {.secret = config.secret, .origin = "the group's --group_secret_file"};
  }
  const std::string dir = RankStateDir(options.dir, config);
  ASSIGN_OR_RETURN(std::unique_ptr<StateStore> store, StateStore::Open(dir, options.keep, secret));
  if (store->sealed()) {
    log << "remotehead-server: state: the states in " << dir << " are sealed under "
        << secret.origin << " (HMAC-SHA256); one that does not verify is refused" << std::endl;
  } else {
    log << "remotehead-server: state: the states in " << dir
        << " are NOT sealed against forgery (a checksum detects damage only): whoever can write "
           "there can plant weights this server loads; --state_secret_file"
        << (config.size > 1 ? " or --group_secret_file" : "") << " seals them" << std::endl;
  }
  return store;
}

absl::Status RestoreHeadsAtStart(const StateStore& store, const Cluster& cluster,
                                 const torch::Device& device, HeadRegistry* registry,
                                 std::ostream& log) {
  const absl::StatusOr<Listing> listing = store.Listing();
  ASSIGN_OR_RETURN(
      const std::vector<std::string> listings,
      Exchange(cluster, listing.status(), listing.ok() ? EncodeListing(*listing) : ""));
  ASSIGN_OR_RETURN(const auto chosen, NewestCommon(listings));
  absl::Status restored = absl::OkStatus();
  std::vector<std::string> lines;
  for (const auto& [dir, state_id] : chosen) {
    if (state_id.empty()) {
      lines.push_back(absl::StrCat("head NOT restored: \"", dir, "\" in ", store.dir(),
                                   ": no state that every rank of the group saved"));
      continue;
    }
    if (!listing->contains(dir)) continue;  // cannot be: every rank holds a common state
    absl::StatusOr<core::HeadState> state = store.LoadAtStart(dir, state_id);
    if (state.ok()) {
      restored =
          RestoreOne(*state, absl::StrCat(store.dir(), "/", dir, "/", state_id, ".safetensors"),
                     cluster, device, registry);
    } else {
      restored = state.status();
    }
    if (!restored.ok()) break;
    lines.push_back(absl::StrCat("head restored: \"", state->head_id, "\" version ",
                                 state->weight_version, " from ", store.dir(), " (state ", state_id,
                                 ")"));
  }
  // Every rank refuses if one cannot restore what they chose: no rank serves a head the others
  // lack or hold at another version.
  RETURN_IF_ERROR(Exchange(cluster, restored, "").status());
  for (const std::string& line : lines) log << "remotehead-server: " << line << std::endl;
  return absl::OkStatus();
}

}  // namespace remotehead::server
