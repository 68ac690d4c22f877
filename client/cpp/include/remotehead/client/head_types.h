// What the calls on a head as a whole take and return (Client's head lifecycle, weights,
// gradients, optimizer and tied-embedding calls): a head's info, how it is created or uploaded,
// its weights and gradients, the optimizer step's options, and the pins that tie a call to the
// head state its caller read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "remotehead/core/torch_api.h"

namespace remotehead::client {

struct HeadInfo {
  std::string head_id;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  torch::ScalarType dtype = torch::kFloat;
  bool has_bias = false;
  std::string device;                     // "cpu", "cuda:0"
  int64_t weight_version = 0;             // bumped by every optimizer step
  int64_t accumulated_micro_batches = 0;  // gradient contributions since the last zeroing
  std::string incarnation;                // the server process: a new one after every restart
  std::string state_id;                   // the durable state last saved or restored ("" if none)
  // A head group's processes and each one's rows [offset, offset + rows) of the vocabulary, by
  // rank (1 and empty for a head on one server).
  int group_size = 1;
  std::vector<std::pair<int64_t, int64_t>> shards;
  // A frozen head takes no dW and no optimizer step (a distillation teacher, a reference model);
  // teacher_of: the heads whose steps named it as their teacher (StepSpec::teacher_head_id) on
  // this server, sorted.
  bool frozen = false;
  std::vector<std::string> teacher_of;
  // The dW (and db) accumulators' dtype: float32 (float64 for a float64 head), or the head's own
  // half-precision dtype (the memory mode, InitSpec::grad_dtype).
  torch::ScalarType grad_dtype = torch::kFloat;
};

// A head initialised on the server: W ~ N(0, init_std²), bias 0.
struct InitSpec {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  bool bias = false;
  uint64_t seed = 0;
  double init_std = 0.02;
  torch::ScalarType dtype = torch::kFloat;
  bool frozen = false;  // HeadInfo::frozen: read only, may serve as a teacher
  // The dW (and db) accumulators' dtype. Unset: float32 (float64 for a float64 head), exact over
  // many micro-batches. The head's own bf16 / fp16: the memory mode — half the gradient memory;
  // each chunk's dW GEMM computes in fp32 and rounds once as it adds (docs/engine.md).
  std::optional<torch::ScalarType> grad_dtype;
};

// A head read from a safetensors file on the server (single file or a sharded checkpoint's
// *.safetensors.index.json).
struct SafetensorsSource {
  std::string path;                             // relative to the server's --checkpoint_dir
  std::string weight_name = "lm_head.weight";   // "model.embed_tokens.weight" for tied models
  std::string bias_name;                        // empty: no bias
  std::optional<torch::ScalarType> dtype;       // unset: the file's dtype
  bool frozen = false;                          // HeadInfo::frozen: read only, may be a teacher
  std::optional<torch::ScalarType> grad_dtype;  // as InitSpec::grad_dtype
};

// How UploadHead stores the uploaded weights.
struct UploadOptions {
  bool frozen = false;  // HeadInfo::frozen; with replace, must equal the existing head's
  // As InitSpec::grad_dtype; with replace, unset or the existing head's.
  std::optional<torch::ScalarType> grad_dtype;
  // New weights for the existing head (same shape, dtype and bias; no accumulated dW): its
  // optimizer state is reset and its weight_version goes up by one. Creates it if it is absent.
  bool replace = false;
};

struct HeadWeights {
  torch::Tensor weight;  // [V, D]
  torch::Tensor bias;    // [V], undefined when the head has none
};

struct HeadGradients {
  torch::Tensor weight_grad;  // [V, D]
  torch::Tensor bias_grad;    // [V], undefined when the head has no bias
  HeadInfo info;              // the head state these gradients belong to
};

// ----- optimizer -----

struct Sgd {
  double lr = 0;
  double momentum = 0;
  double weight_decay = 0;
};

struct AdamW {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// One rank's part of the optimizer step of `world_size` data-parallel trainer processes, each
// of which added its own micro-batches' dW under its own GradientId::trainer. The server holds
// the call until every rank in [0, world_size) asked for `step`, checks that they all asked
// for the same step (INVALID_ARGUMENT naming the field otherwise, nothing applied), applies it
// once with the summed dW scaled by grad_scale / world_size (as DDP averages gradients) and
// answers every rank with the same HeadInfo. A rank that does not come within the server's
// --sync_step_timeout_seconds fails every waiting rank with ABORTED naming the missing ranks.
struct SynchronousStep {
  int64_t step = 0;    // the trainers' global step, >= 0
  int rank = 0;        // this trainer's rank, in [0, world_size)
  int world_size = 1;  // the trainers that step together, >= 1
};

struct OptimizerStepOptions {
  std::variant<Sgd, AdamW> optimizer;
  // Multiplies the accumulated gradient. A synchronous step divides it by world_size on top.
  std::optional<double> grad_scale;
  bool zero_gradients = false;  // zero the accumulators (and the ledger) after the step
  // HeadInfo::incarnation seen by the trainer: FAILED_PRECONDITION once the server restarted
  // (its dW is gone). Empty: unchecked.
  std::string expected_incarnation;
  // HeadInfo::weight_version the trainer holds: FAILED_PRECONDITION, nothing applied, if the
  // head is at another. Unset: unchecked.
  std::optional<int64_t> expected_weight_version;
  // Set: this call is one rank's part of a synchronous step (SynchronousStep).
  std::optional<SynchronousStep> synchronous;
};

// What an export must be of (ExportWeights): unset / empty fields are unchecked.
struct ExportPin {
  std::string expected_incarnation;                // HeadInfo::incarnation seen by the caller
  std::optional<int64_t> expected_weight_version;  // HeadInfo::weight_version seen by the caller
};

// A tied embedding's rows W[ids] (Client::EmbeddingLookup), on the CPU.
struct EmbeddingRows {
  torch::Tensor rows;          // [n, D]
  int64_t weight_version = 0;  // the version they are of: the gradient's expected version
};

struct EmbeddingGradientResult {
  bool replayed = false;  // the gradient id had been applied already: nothing was added
  HeadInfo info;
};

}  // namespace remotehead::client
