// Rows that contribute nothing do not reach the engine. For a function that declares it
// (core::TransformFunction::ignored_rows_contribute_nothing), a row whose target is ignore_index
// has no output, no dX and no dW; the session drops such rows from each message as it arrives,
// before the rows are batched for the engine, and gives them back as zeros in their place. So a
// client that sends every row and one that sends only the contributing rows (both clients do by
// default) feed the engine the same rows in the same order: the same chunks, the same bits.
//
// The rows of a request are numbered as it sent them ("request rows"); the rows kept are
// computed in order, and their results are placed back at their request rows, with zeros at the
// dropped rows between them (dX, per-token outputs, token extras: 0 is what the engine gives an
// ignored row in each).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "remotehead/core/call_plan.h"
#include "remotehead/core/torch_api.h"
#include "step/row_batcher.h"
#include "step/step_call.h"

namespace remotehead::server {

// What each row of a call gives back, so that a dropped row gets zeros of the same kind.
struct RowResultKinds {
  int64_t hidden_size = 0;
  std::optional<torch::ScalarType> grad_hidden;  // dX's dtype, when the call returns dX
  std::optional<torch::ScalarType> outputs;      // a per-token Forward's outputs' dtype
  std::vector<std::string> token_extras;         // names (StepOptions::token_extras)
  torch::ScalarType token_extras_dtype = torch::kFloat;
};

class RowCompaction {
 public:
  // Off: every row is kept and results pass through as they are.
  RowCompaction() = default;
  // On: rows whose target is `ignore_index` are dropped.
  RowCompaction(int64_t ignore_index, RowResultKinds kinds)
      : on_(true), ignore_index_(ignore_index), kinds_(std::move(kinds)) {}

  // A call's: on when its function declares that its ignored rows contribute nothing; its
  // results' kinds from the mode, the reduction, the token extras and the dtypes.
  static RowCompaction For(const core::CallPlan& plan, core::CallMode mode,
                           const core::StepOptions& options,
                           std::optional<torch::ScalarType> grad_hidden_dtype,
                           torch::ScalarType head_dtype);

  bool on() const { return on_; }
  // Request rows [first_row, first_row + rows of part): the part with only its contributing
  // rows (all of them when it carries no targets), their request rows recorded. A part that
  // keeps every row is returned as it is (no copy).
  RowBatcher::Part Compact(RowBatcher::Part part, int64_t first_row);
  // Records request rows [first_row, first_row + n) as kept (a part computed as it is).
  void KeepAll(int64_t first_row, int64_t n);
  // The request rows of the next `n` kept rows to be computed (what the engine's errors name);
  // null when off (the rows are consecutive from given_back()).
  const std::vector<int64_t>* RowNumbers(int64_t n);
  // The results of the next `n` kept rows, computed, placed at their request rows: a block from
  // the first request row not given back yet to the last of them, zeros at the dropped rows.
  StepRowResults Place(StepRowResults computed, int64_t n);
  // Zeros for the dropped rows from the first request row not given back yet up to `end`
  // (exclusive), when every kept row before `end` has been computed; nullopt when there are none.
  std::optional<StepRowResults> FillTo(int64_t end);
  // Request rows whose results have been given back (placed or filled): [0, given_back()).
  int64_t given_back() const { return given_back_; }
  // Rows dropped so far.
  int64_t dropped() const { return dropped_; }

 private:
  bool on_ = false;
  int64_t ignore_index_ = -100;
  RowResultKinds kinds_;
  std::deque<int64_t> kept_;      // request rows of the kept rows not computed yet
  std::vector<int64_t> numbers_;  // RowNumbers' answer
  int64_t given_back_ = 0;
  int64_t dropped_ = 0;
};

}  // namespace remotehead::server
