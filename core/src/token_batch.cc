#include "remotehead/core/token_batch.h"

namespace remotehead::core {
int64_t TokenBatch::rows() const {
  return hidden.defined() && hidden.dim() >= 1 ? hidden.size(0) : 0;
}

int64_t TokenBatch::nbytes() const {
  int64_t bytes = 0;
  for (const torch::Tensor* t : {&hidden, &targets, &weights, &teacher_hidden}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  for (const auto& [name, t] : aux) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

TokenBatch TokenBatch::Slice(int64_t start, int64_t n) const {
  return Map([&](const torch::Tensor& t) { return t.narrow(0, start, n); });
}

TokenBatch TokenBatch::Select(const torch::Tensor& index) const {
  return Map([&](const torch::Tensor& t) { return t.index_select(0, index.to(t.device())); });
}

TokenBatch TokenBatch::To(const torch::Device& device) const {
  return Map([&](const torch::Tensor& t) { return t.to(device); });
}

TokenBatch TokenBatch::Clone() const {
  return Map([](const torch::Tensor& t) { return t.clone(); });
}

bool TokenBatch::SameInputs(const TokenBatch& other) const {
  auto same = [](const torch::Tensor& x, const torch::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || x.scalar_type() == y.scalar_type());
  };
  if (!same(targets, other.targets) || !same(weights, other.weights) ||
      !same(teacher_hidden, other.teacher_hidden) || aux.size() != other.aux.size()) {
    return false;
  }
  for (const auto& [name, t] : aux) {
    const auto it = other.aux.find(name);
    if (it == other.aux.end() || !same(t, it->second)) return false;
  }
  return true;
}

namespace {

// Whether `b` continues `a` in memory: the rows after a's, in the same buffer and layout.
bool ContinuesRows(const torch::Tensor& a, const torch::Tensor& b) {
  return b.is_contiguous() && b.scalar_type() == a.scalar_type() && b.device() == a.device() &&
         b.dim() == a.dim() && b.dim() >= 1 && b.sizes().slice(1) == a.sizes().slice(1) &&
         b.storage().is_alias_of(a.storage()) &&
         static_cast<const char*>(b.data_ptr()) ==
             static_cast<const char*>(a.data_ptr()) + a.nbytes();
}

// The rows of `ts` one after another: a view where they already lie so in one buffer (a batch
// of rows the server staged message by message: server/src/rpc/row_staging.h), else a copy.
torch::Tensor ConcatRows(const std::vector<torch::Tensor>& ts) {
  bool adjacent = ts.front().is_contiguous();
  int64_t rows = ts.front().dim() >= 1 ? ts.front().size(0) : 0;
  for (size_t i = 1; adjacent && i < ts.size(); ++i) {
    adjacent = ContinuesRows(ts[i - 1], ts[i]);
    rows += adjacent ? ts[i].size(0) : 0;
  }
  if (!adjacent || ts.front().dim() < 1) return torch::cat(ts);
  std::vector<int64_t> sizes = ts.front().sizes().vec();
  sizes[0] = rows;
  return ts.front().as_strided(sizes, ts.front().strides(), ts.front().storage_offset());
}

}  // namespace

TokenBatch TokenBatch::Concat(const std::vector<TokenBatch>& parts) {
  if (parts.size() == 1) return parts.front();
  auto cat = [&](auto get) {
    std::vector<torch::Tensor> ts;
    for (const auto& p : parts) ts.push_back(get(p));
    return ts.empty() || !ts.front().defined() ? torch::Tensor() : ConcatRows(ts);
  };
  TokenBatch b;
  b.hidden = cat([](const TokenBatch& p) { return p.hidden; });
  b.targets = cat([](const TokenBatch& p) { return p.targets; });
  b.weights = cat([](const TokenBatch& p) { return p.weights; });
  b.teacher_hidden = cat([](const TokenBatch& p) { return p.teacher_hidden; });
  if (!parts.empty()) {
    for (const auto& entry : parts.front().aux) {
      const std::string& name = entry.first;  // (clang 14 cannot capture a structured binding)
      b.aux[name] = cat([&name](const TokenBatch& p) { return p.aux.at(name); });
    }
  }
  return b;
}

int64_t CountValidTokens(const torch::Tensor& targets, int64_t ignore_index, int64_t rows) {
  if (!targets.defined()) return rows;
  torch::NoGradGuard no_grad;
  return (targets != ignore_index).sum().item<int64_t>();
}

torch::Tensor ContributingRows(const torch::Tensor& targets, int64_t ignore_index) {
  torch::NoGradGuard no_grad;
  return (targets.reshape(-1) != ignore_index).nonzero().reshape(-1);
}

}  // namespace remotehead::core
