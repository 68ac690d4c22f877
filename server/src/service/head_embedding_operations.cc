// HeadOperations' tied-embedding parts: the rows of W a model's input ids read, and their
// gradient added into the same dW as the head's steps (one parameter, one accumulator).
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "service/head_expectations.h"
#include "service/head_operations.h"

namespace remotehead::server {
namespace {

// The positions of `ids` that this rank's rows [offset, offset + rows) hold, and those ids as
// indices into its rows.
struct OwnIds {
  torch::Tensor positions;  // int64 [m]
  torch::Tensor local;      // int64 [m]
};

OwnIds Own(const torch::Tensor& ids, int64_t offset, int64_t rows) {
  const torch::Tensor local = ids - offset;
  const torch::Tensor positions = ((local >= 0) & (local < rows)).nonzero().reshape({-1});
  return {positions, local.index_select(0, positions)};
}

}  // namespace

absl::StatusOr<HeadSnapshot> HeadOperations::LookupEmbedding(
    const std::string& id, torch::Tensor ids, std::optional<torch::ScalarType> dtype) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  {
    std::vector<torch::Tensor> shared = {ids.to(device_)};
    RETURN_IF_ERROR(placement_.Share(shared));  // the front's ids on every rank
    ids = shared[0];
  }
  const int64_t offset = OwnOffset(entry->Describe());
  int64_t version = 0;  // of the rows read, under the same lock
  torch::Tensor rows = entry->Read([&](const core::Head& head) {
    version = head.version();
    const torch::ScalarType out = dtype.value_or(head.dtype());
    const OwnIds own = Own(ids.to(head.device()), offset, head.vocab_size());
    // Every id among this rank's rows (always, on a head held whole): the rows themselves.
    if (own.positions.size(0) == ids.size(0)) {
      return head.weight().index_select(0, own.local).to(out);
    }
    // Zeros where another rank holds the id: the front's sum is then exact.
    torch::Tensor part =
        torch::zeros({ids.size(0), head.hidden_size()}, head.weight().options().dtype(out));
    part.index_copy_(0, own.positions, head.weight().index_select(0, own.local).to(out));
    return part;
  });
  ASSIGN_OR_RETURN(rows, placement_.SumToFront(rows));
  HeadSnapshot snapshot;
  if (rows.defined()) snapshot.matrix = rows.cpu();
  snapshot.description = entry->Describe();
  snapshot.description.weight_version = version;
  return snapshot;
}

absl::StatusOr<EmbeddingGradientOutcome> HeadOperations::AddEmbeddingGradient(
    const std::string& id, torch::Tensor ids, torch::Tensor rows, const GradientKey& key,
    std::optional<int64_t> expected_weight_version, const std::string& version_field) {
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  {
    std::vector<torch::Tensor> shared = {ids.to(device_), rows.to(device_)};
    RETURN_IF_ERROR(placement_.Share(shared));  // the front's ids and rows on every rank
    ids = shared[0];
    rows = shared[1];
  }
  const HeadDescription before = entry->Describe();
  if (before.frozen) return HeadFrozenError(id, "header.gradient_id", "accumulating dW");
  RETURN_IF_ERROR(CheckWeightVersion(expected_weight_version, version_field, before));
  const int64_t own_rows = before.shards.empty()
                               ? before.vocab_size
                               : entry->Read([](const core::Head& h) { return h.vocab_size(); });
  const OwnIds own = Own(ids, OwnOffset(before), own_rows);
  const RowGradients gradient{own.local, rows.index_select(0, own.positions)};
  // Pinned to the version checked above: an optimizer step in between refuses the commit.
  HeadPin pin = entry->Pin();
  pin.weight_version = expected_weight_version.value_or(before.weight_version);
  StepCommit commit{.pin = pin, .key = key};
  commit.rows = &gradient;
  ASSIGN_OR_RETURN(const CommitResult result, entry->Commit(commit));
  return EmbeddingGradientOutcome{.replayed = result.replayed, .description = entry->Describe()};
}

}  // namespace remotehead::server
