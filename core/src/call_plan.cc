#include "remotehead/core/call_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "fused/fused_block.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/sampler_kept_set.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace {

// Per-token bookkeeping, measured: per chunk row the prepared targets, validity mask, token
// weights, outputs, upstream gradients and fp64 partial sums (~100 bytes with aux inputs); per
// row of the whole call the input checks' masks and the valid-token count (a few bytes).
constexpr int64_t kTokenBytesPerChunkRow = 128;
constexpr int64_t kTokenBytesPerRow = 16;
// The function block's declared buffers are measured on one LibTorch build; the estimate keeps
// 10% on top for temporaries whose lifetimes overlap differently elsewhere (the tightest case
// measured here, entropy, peaks at 0.98 of the declared block).
constexpr double kBlockMargin = 1.1;

// StepOptions::fused_blocks on a call the fused kernel covers: its function and params, one
// server's head (a group's shards combine their reductions through collectives the kernel does
// not make), no teacher, rows that are not coupled.
bool FusedApplies(const StepOptions& options, const CallPlan& plan) {
  return options.fused_blocks && options.shard == nullptr && options.teacher == nullptr &&
         !plan.couples_rows && plan.function->output == OutputKind::kPerToken &&
         fused::Covers(*plan.function, plan.params);
}

// The call's budget: as given, or the default of the head's device under the plan's rules.
int64_t BudgetBytes(const Head& head, const StepOptions& options) {
  return options.memory_budget_bytes > 0
             ? options.memory_budget_bytes
             : DefaultMemoryBudgetBytes(head.device(), options.plan_rules);
}

absl::Status CheckChunkOptions(const Head& head, const StepOptions& options) {
  if (options.chunk_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_rows: expected >= 1 (or 0 to derive it from memory_budget_bytes); got ",
                     options.chunk_rows));
  }
  if (options.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_budget_bytes: expected >= 1 (or 0 for the default ",
                     DefaultMemoryBudgetBytes(head.device(), options.plan_rules), "); got ",
                     options.memory_budget_bytes));
  }
  if (options.block_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_rows: expected >= 1 (or 0 for the default); got ", options.block_rows));
  }
  return absl::OkStatus();
}

// StepOptions::logits_dtype: unset or float32 (the only dtype a GEMM of any head's dtype can be
// asked to form its logits in besides the head's own).
absl::Status CheckLogitsDtype(const Head& head, const StepOptions& options) {
  if (!options.logits_dtype.has_value() || *options.logits_dtype == torch::kFloat) {
    return absl::OkStatus();
  }
  const std::string got = DtypeName(*options.logits_dtype);
  return WithReason(
      absl::InvalidArgumentError(absl::StrCat(
          "logits_dtype: expected float32 (fp32 logits from the head's ", DtypeName(head.dtype()),
          " weights) or unset (logits in the head's dtype); got ", got)),
      reason::kInvalidField, {{"field", "logits_dtype"}, {"expected", "float32"}, {"actual", got}});
}

// The logits columns chunks and blocks are sized for: the head's rows, or on a head group the
// largest shard's, so that every rank runs the same chunks and blocks.
int64_t PlannedColumns(const Head& head, const StepOptions& options) {
  return options.shard != nullptr ? std::max(options.shard->largest_rows(), head.vocab_size())
                                  : head.vocab_size();
}

// The per-row costs of the head's dtype and the function's options.
void SetRowCosts(const Head& head, const StepOptions& options, CallPlan& plan) {
  plan.vocab_size = PlannedColumns(head, options);
  const double vocab = static_cast<double>(plan.vocab_size);
  const double hidden = static_cast<double>(head.hidden_size());
  plan.hidden_size = head.hidden_size();
  plan.head_elem_bytes = static_cast<int64_t>(c10::elementSize(head.dtype()));
  plan.logits_elem_bytes = static_cast<int64_t>(c10::elementSize(LogitsDtype(head)));
  const double elem = static_cast<double>(plan.head_elem_bytes);
  const double logits_elem = static_cast<double>(plan.logits_elem_bytes);
  // The chunk logits buffer's element: the head's, or fp32 with StepOptions::logits_dtype.
  const double gemm_elem = static_cast<double>(c10::elementSize(plan.gemm_dtype));
  const bool half = head.dtype() != LogitsDtype(head);
  // Per block row: the upcast logits (when the chunk buffer is not already fp32), their
  // gradient, what the logit transforms save for autograd, and the function's own workspace —
  // all in fp32.
  // The head's health (engine_health.cc, a call that trains) takes its two temporaries from
  // the transformed logits before the function runs: the block holds the larger of the two.
  const bool health = plan.function->output == OutputKind::kPerToken && options.head_health;
  double block_buffers =
      1.0 + std::max(plan.function->workspace_logit_buffers, health ? kHealthWorkspaceBuffers : 0.0);
  if (half && !plan.fp32_logits_of_half_head) block_buffers += 1;
  if (plan.params.at(kSoftcapParam) > 0) block_buffers += 2;
  if (plan.params.at(kTemperatureParam) != 1.0) block_buffers += 1;
  if (plan.params.at(kLogitScaleParam) != 1.0) block_buffers += 1;
  // A per-token function scoring a sampled token (sampler_kept_set.h): the sampler's threshold
  // and masked logits. "sample" counts its own in its workspace.
  if (plan.function->output == OutputKind::kPerToken) {
    const int64_t ranks = options.shard != nullptr ? std::ssize(options.shard->ranges) : 1;
    block_buffers += SamplerWorkspaceBuffers(plan.params, plan.vocab_size, ranks);
  }
  const bool teacher = plan.function->needs_teacher && options.teacher != nullptr;
  // A two-head function's teacher: its fp32 logits (alive for the whole block) and one
  // temporary while they are formed (the upcast or a transform's result); no autograd.
  if (teacher) block_buffers += 2;
  plan.block_row_bytes = vocab * logits_elem * block_buffers;
  // A fused chunk has no block: no upcast copy, no temporaries, its gradient written over the
  // logits buffer (BlockRowsWanted, SetChunkSizes).
  if (plan.fused) plan.block_row_bytes = 0;
  // Per chunk row: the logits buffer in the GEMM's dtype (which the gradient overwrites) and the
  // X / dX rows; for a half-precision head also the fp32 copy of X_c for the dW GEMM (and the
  // logits GEMM of fp32 logits) and the fp32 dX (the half-precision GEMMs' fp32 scratch, or the
  // fp32 sum over W's slices of fp32 logits), and with half-precision logits a separate fp32
  // gradient.
  plan.chunk_row_bytes = vocab * gemm_elem + 2.0 * hidden * elem;
  plan.chunk_row_bytes_forward = vocab * gemm_elem;
  if (plan.fused) {
    const double fused_row =
        fused::RowBytes(plan.vocab_size, LogitsDtype(head), !head.weight().device().is_cpu());
    plan.chunk_row_bytes += fused_row;
    plan.chunk_row_bytes_forward += fused_row;
  }
  // …and a two-head function's second logits buffer, the teacher's, in its GEMM's dtype.
  if (teacher) {
    const torch::ScalarType teacher_gemm =
        GemmLogitsDtype(options.teacher->dtype(), options.logits_dtype);
    double teacher_row = vocab * static_cast<double>(c10::elementSize(teacher_gemm));
    // fp32 logits of a half-precision teacher: the fp32 copy of its X_c for the GEMM.
    if (teacher_gemm != options.teacher->dtype()) {
      teacher_row += static_cast<double>(options.teacher->hidden_size()) * 4.0;
    }
    plan.chunk_row_bytes += teacher_row;
    plan.chunk_row_bytes_forward += teacher_row;
  }
  // A generation output on a head group works on whole rows: each chunk's shards all-gathered
  // (every rank's columns padded to the largest) and put back together (engine_generation.cc),
  // then transformed over the whole vocabulary.
  const bool gathers = options.shard != nullptr && plan.function->output != OutputKind::kPerToken;
  const int64_t row_columns = gathers ? options.shard->vocab_size() : plan.vocab_size;
  if (gathers) {
    const double ranks = static_cast<double>(options.shard->ranges.size());
    plan.chunk_row_bytes_forward += (ranks * vocab + static_cast<double>(row_columns)) * gemm_elem;
    plan.block_row_bytes = static_cast<double>(row_columns) * logits_elem * block_buffers;
  }
  plan.token_extra_row_bytes =
      static_cast<int64_t>(options.token_extras.size()) * plan.logits_elem_bytes;
  switch (plan.function->output) {
    case OutputKind::kPerToken:
      plan.output_row_bytes = plan.logits_elem_bytes;
      break;
    case OutputKind::kLogits:
      plan.output_row_bytes =
          row_columns * static_cast<int64_t>(c10::elementSize(options.output_dtype));
      break;
    case OutputKind::kSample:
      plan.output_row_bytes = int64_t{8} + plan.logits_elem_bytes;  // int64 id + log-prob
      break;
  }
  if (half) {
    plan.chunk_row_bytes += 2.0 * hidden * logits_elem;
    if (!plan.gradient_in_logits) plan.chunk_row_bytes += vocab * logits_elem;
    plan.chunk_row_bytes_forward += hidden * logits_elem;
  }
}

// fp32 logits of a half-precision head: the slices of W upcast at once are bounded by a
// sixteenth of the call's budget, so that they take little from the chunks yet each slice's
// GEMM still has hundreds of columns (at D = 4096 and the CPU's 96 MiB default: 384 rows); at
// least one row of the widest head, at most all its rows.
void SetWeightSlice(const Head& head, const StepOptions& options, CallPlan& plan) {
  const bool teacher = plan.function->needs_teacher && options.teacher != nullptr;
  const bool teacher_upcast =
      teacher &&
      GemmLogitsDtype(options.teacher->dtype(), options.logits_dtype) != options.teacher->dtype();
  if (!plan.fp32_logits_of_half_head && !teacher_upcast) return;
  plan.weight_slice_bytes = BudgetBytes(head, options) / 16;
  const int64_t widest =
      std::max<int64_t>(head.hidden_size(), teacher ? options.teacher->hidden_size() : 0);
  plan.weight_slice_bytes =
      std::clamp<int64_t>(plan.weight_slice_bytes, widest * 4, plan.vocab_size * widest * 4);
}

// Where dL/dz goes (CallPlan::gradient_in_logits), whether the fp32 logits' gradient is split
// (CallPlan::split_gradient), and the slices of it that a CPU's dW GEMM reads in fp32, or the
// split makes: bounded like W's slices (SetWeightSlice).
void SetGradientPlacement(const Head& head, const StepOptions& options, CallPlan& plan) {
  const bool rounded_for_dw =
      UsesCudaRules(head.device(), options.plan_rules) || head.grad_dtype() == head.dtype();
  plan.gradient_in_logits = plan.fused || plan.gemm_dtype == LogitsDtype(head) || rounded_for_dw;
  plan.split_gradient =
      plan.fp32_logits_of_half_head && UsesCudaRules(head.device(), options.plan_rules);
  const bool cpu_upcast = plan.gradient_in_logits && head.device().is_cpu() &&
                          plan.gemm_dtype != LogitsDtype(head) && head.grad_dtype() != head.dtype();
  if (cpu_upcast || plan.split_gradient) {
    plan.gradient_slice_bytes = std::max<int64_t>(BudgetBytes(head, options) / 16, 16);
  }
}

// oneDNN's brgemm kernels (what LibTorch runs a bf16/fp16 GEMM on, on CPUs with AVX512-BF16 or
// AMX) allocate their scratchpad through LibTorch's CPU allocator, so it counts against the
// call. For the dX GEMM (M = chunk rows, K = V, N = D) oneDNN 3.x splits K across the threads
// when M·N is small, and each thread then holds (brgemm_matmul_utils.cpp):
//   C: an fp32 accumulator of M × LDC (LDC ≤ N; ≤ ~1024 columns per thread once N is split),
//   B: its share of W packed into the AMX/VNNI layout, ≤ K_chunk × (N_chunk + padding) × 2,
//   A: a tail copy of dz, 32 rows × K_chunk × 2, and a 4 KiB tile configuration;
// with K_chunk ≤ ceil(K / threads), capped at 4096 rows of K by the blocking. Measured on
// oneDNN 3.13 (LibTorch 2.15), 1–4 threads, V 3000–128000, D 128–4096, M 16–8192: the
// measured scratch stays within this bound, at 1.1–6× of it. fp32 heads run on MKL, whose
// GEMMs allocate nothing through LibTorch; CUDA heads use cuBLAS's one fixed workspace.
void SetGemmWorkspace(const Head& head, CallPlan& plan) {
  // fp32 logits of a half head run every GEMM in fp32 on a CPU (MKL: nothing allocated).
  if (!head.weight().device().is_cpu() || head.dtype() == LogitsDtype(head) ||
      plan.fp32_logits_of_half_head) {
    return;
  }
  constexpr int64_t kMaxColumnsPerThread = 1024;
  constexpr int64_t kMaxKChunk = 4096;
  constexpr int64_t kPackPadding = 64;
  constexpr int64_t kTileConfigBytes = 4096;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t columns = std::min<int64_t>(plan.hidden_size, kMaxColumnsPerThread);
  const int64_t k_chunk = std::min<int64_t>((plan.vocab_size + threads - 1) / threads, kMaxKChunk);
  plan.gemm.row_bytes = static_cast<double>(threads * 4 * columns);
  plan.gemm.fixed_bytes = threads * (2 * (columns + kPackPadding) * k_chunk + kTileConfigBytes);
}

// Rows per function block before the budget's say: as given; under a CPU's rules, what keeps the
// block in the caches; under CUDA's no limit (the budget's quarter, below, is the only one). A
// fused call's block is its chunk (SetChunkSizes).
int64_t BlockRowsWanted(const Head& head, const StepOptions& options, const CallPlan& plan) {
  if (plan.fused) return std::numeric_limits<int64_t>::max();
  if (options.block_rows > 0) return options.block_rows;
  if (UsesCudaRules(head.device(), options.plan_rules)) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(
      1, std::min(kFunctionBlockBytes / (plan.vocab_size * plan.logits_elem_bytes),
                  static_cast<int64_t>(kFunctionBlockWorkingSetBytes / plan.block_row_bytes)));
}

// Chunk and block rows: as given, or the largest that fit the budget (blocks take at most a
// quarter of it; chunks get the rest).
absl::Status SetChunkSizes(const Head& head, const StepOptions& options, CallPlan& plan) {
  const int64_t wanted_block_rows = BlockRowsWanted(head, options, plan);
  if (plan.fused && options.chunk_rows <= 0) {
    const int64_t budget = BudgetBytes(head, options);
    // …less db's column sums of a chunk's dz ([V], CallPlan::Memory), the one block-sized cost.
    const double rest = static_cast<double>(budget) - static_cast<double>(plan.gemm.fixed_bytes) -
                        static_cast<double>(plan.weight_slice_bytes + plan.gradient_slice_bytes) -
                        static_cast<double>(plan.vocab_size * plan.logits_elem_bytes);
    plan.chunk_rows = static_cast<int64_t>(rest / (plan.chunk_row_bytes + plan.gemm.row_bytes));
    plan.block_rows = plan.chunk_rows;
    if (plan.chunk_rows >= 1) return absl::OkStatus();
    const double one_row = plan.chunk_row_bytes + static_cast<double>(plan.gemm.BytesFor(1)) +
                           static_cast<double>(plan.weight_slice_bytes + plan.gradient_slice_bytes);
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_budget_bytes: expected at least ", static_cast<int64_t>(std::ceil(one_row)),
        " (one row of ", plan.function->name, " at V=", plan.vocab_size, ", fused); got ",
        budget));
  }
  if (options.chunk_rows > 0) {
    plan.chunk_rows = options.chunk_rows;
    plan.block_rows = std::min(wanted_block_rows, options.chunk_rows);
    return absl::OkStatus();
  }
  const int64_t budget = BudgetBytes(head, options);
  plan.block_rows = std::min<int64_t>(
      wanted_block_rows,
      static_cast<int64_t>(0.25 * static_cast<double>(budget) / plan.block_row_bytes));
  const double rest =
      static_cast<double>(budget) -
      static_cast<double>(std::max<int64_t>(plan.block_rows, 1)) * plan.block_row_bytes -
      static_cast<double>(plan.gemm.fixed_bytes) -
      static_cast<double>(plan.weight_slice_bytes + plan.gradient_slice_bytes);
  plan.chunk_rows = static_cast<int64_t>(rest / (plan.chunk_row_bytes + plan.gemm.row_bytes));
  if (plan.block_rows < 1 || plan.chunk_rows < 1) {
    const double one_row = 4.0 * plan.block_row_bytes + plan.chunk_row_bytes +
                           static_cast<double>(plan.gemm.BytesFor(1)) +
                           static_cast<double>(plan.weight_slice_bytes + plan.gradient_slice_bytes);
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_budget_bytes: expected at least ", static_cast<int64_t>(std::ceil(one_row)),
        " (one row of ", plan.function->name, " at V=", plan.vocab_size, "); got ", budget));
  }
  plan.block_rows = std::min(plan.block_rows, plan.chunk_rows);
  return absl::OkStatus();
}

}  // namespace

torch::ScalarType LogitsDtype(const Head& head) { return AccumulationDtype(head.dtype()); }

torch::ScalarType GemmLogitsDtype(torch::ScalarType head_dtype,
                                  std::optional<torch::ScalarType> logits_dtype) {
  const bool half = head_dtype == torch::kBFloat16 || head_dtype == torch::kHalf;
  return half && logits_dtype == torch::kFloat ? torch::kFloat : head_dtype;
}

int64_t CallPlan::WeightSliceRows(int64_t vocab, int64_t hidden) const {
  return std::clamp<int64_t>(weight_slice_bytes / std::max<int64_t>(hidden * 4, 1), 1,
                             std::max<int64_t>(vocab, 1));
}

int64_t CallPlan::GradientSliceColumns(int64_t rows, int64_t vocab) const {
  if (gradient_slice_bytes <= 0) return std::max<int64_t>(vocab, 1);  // no bound: one slice
  return std::clamp<int64_t>(
      gradient_slice_bytes / std::max<int64_t>(rows * GradientSliceBytesPerLogit(), 1), 1,
      std::max<int64_t>(vocab, 1));
}

std::string CallMemory::Breakdown() const {
  std::string text =
      absl::StrCat("logits ", FormatMiB(logits_bytes), " + function block ", FormatMiB(block_bytes),
                   " + per-token ", FormatMiB(token_bytes), " + output ", FormatMiB(output_bytes));
  if (gemm_bytes > 0) absl::StrAppend(&text, " + GEMM workspace ", FormatMiB(gemm_bytes));
  return text;
}

int64_t CallPlan::ChunkRowsFor(int64_t rows) const {
  return std::min(chunk_rows, std::max<int64_t>(rows, 1));
}

int64_t CallPlan::BlockRowsFor(int64_t rows) const {
  return std::min(block_rows, ChunkRowsFor(rows));
}

CallMemory CallPlan::Memory(int64_t rows, CallMode mode) const {
  CallMemory m;
  if (rows <= 0) return m;
  const int64_t chunk = ChunkRowsFor(rows);
  const double chunk_row = mode == CallMode::kForward ? chunk_row_bytes_forward : chunk_row_bytes;
  m.logits_bytes =
      static_cast<int64_t>(std::ceil(static_cast<double>(chunk) * chunk_row)) + weight_slice_bytes;
  m.block_bytes = static_cast<int64_t>(
      std::ceil(kBlockMargin * static_cast<double>(BlockRowsFor(rows)) * block_row_bytes));
  // …and, with gradients, db's column sums of the chunk's dz ([V]).
  if (mode != CallMode::kForward) {
    m.block_bytes += vocab_size * logits_elem_bytes;
    // The backward's slices of the gradient (gradient_slice_bytes, at most the whole chunk's)
    // are made once the chunk's blocks are gone: the larger of the two is what is held.
    const int64_t slice =
        std::min<int64_t>(gradient_slice_bytes, chunk * vocab_size * GradientSliceBytesPerLogit());
    m.block_bytes = std::max(m.block_bytes, slice + vocab_size * logits_elem_bytes);
  }
  m.token_bytes = kTokenBytesPerChunkRow * chunk + kTokenBytesPerRow * rows;
  m.output_bytes = (mode == CallMode::kForward ? rows * output_row_bytes
                                               : rows * hidden_size * head_elem_bytes) +
                   rows * token_extra_row_bytes;
  if (mode != CallMode::kForward) m.gemm_bytes = gemm.BytesFor(chunk);
  return m;
}

absl::Status CheckCallMode(const CallPlan& plan, CallMode mode, Reduction reduction) {
  if (plan.function->output == OutputKind::kPerToken) return absl::OkStatus();
  if (mode != CallMode::kForward) {
    return absl::InvalidArgumentError(absl::StrCat("function: \"", plan.function->name,
                                                   "\" is a generation output with no gradient: "
                                                   "expected a Forward; got ",
                                                   CallModeName(mode)));
  }
  if (reduction != Reduction::kNone) {
    return absl::InvalidArgumentError(absl::StrCat(
        "function.reduction: \"", plan.function->name,
        "\" returns rows, not a loss: expected none; got ", std::string(ReductionName(reduction))));
  }
  return absl::OkStatus();
}

absl::StatusOr<CallPlan> PlanCall(const Head& head, const StepOptions& options) {
  const FunctionRegistry& registry =
      options.registry != nullptr ? *options.registry : FunctionRegistry::Builtin();
  CallPlan plan;
  ASSIGN_OR_RETURN(plan.function, registry.Find(options.function));
  if (options.shard != nullptr && !plan.function->vocab_decomposable) {
    return WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "function: expected a vocabulary-decomposable function on a head group of ",
            options.shard->ranges.size(), " ranks; got \"", plan.function->name,
            "\", which reduces over the whole vocabulary itself (run it on a single server)")),
        reason::kNotOnGroup, {{"field", "function"}, {"function", plan.function->name}});
  }
  ASSIGN_OR_RETURN(plan.params, registry.ResolveParams(*plan.function, options.params));
  plan.couples_rows = plan.function->CouplesRows(plan.params);
  // The aux inputs are not known yet: the engine checks their conditions with the rows.
  RETURN_IF_ERROR(CheckTokenExtras(*plan.function, plan.params, nullptr, options.token_extras));
  RETURN_IF_ERROR(CheckChunkOptions(head, options));
  if (!torch::isFloatingType(options.output_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("output_dtype: expected a floating dtype; got ",
                                                   c10::toString(options.output_dtype)));
  }
  RETURN_IF_ERROR(CheckLogitsDtype(head, options));
  plan.logits_dtype = options.logits_dtype;
  plan.gemm_dtype = GemmLogitsDtype(head.dtype(), options.logits_dtype);
  plan.fp32_logits_of_half_head = plan.gemm_dtype != head.dtype();
  plan.fused = FusedApplies(options, plan);
  SetGradientPlacement(head, options, plan);
  SetRowCosts(head, options, plan);
  SetGemmWorkspace(head, plan);
  SetWeightSlice(head, options, plan);
  RETURN_IF_ERROR(SetChunkSizes(head, options, plan));
  return plan;
}

torch::Tensor NewLogitsWorkspace(const Head& head, const CallPlan& plan, int64_t max_rows) {
  return torch::empty({plan.ChunkRowsFor(max_rows), head.vocab_size()},
                      head.weight().options().dtype(plan.gemm_dtype));
}

}  // namespace remotehead::core
