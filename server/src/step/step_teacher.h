// The teacher head of a two-head (distillation) step: StepHeader.teacher_head_id resolved on
// this process and checked against the step's student. The header's reading (step_header.h) has
// already checked that the function takes a teacher (needs_teacher) and that one is named.
//
// Every refusal names the field, the expected and the actual value; the teacher's own
// incompatibilities carry reason TEACHER_INCOMPATIBLE (metadata teacher, field, expected,
// actual).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/service/head_registry.h"

namespace remotehead::server {

// The teacher `teacher_id` of a step on `student` (null for an empty id): NOT_FOUND
// (HEAD_NOT_FOUND) for an id this server does not have; INVALID_ARGUMENT for the student itself,
// another vocabulary size or (on a head group) other shard ranges; FAILED_PRECONDITION for a
// head that is not frozen.
absl::StatusOr<std::shared_ptr<HeadEntry>> ResolveTeacher(const HeadRegistry& registry,
                                                          const HeadEntry& student,
                                                          const std::string& teacher_id);

// The teacher as a step planned it: the version every batch must still see, and the layout of
// its rows (rows.teacher_hidden).
struct PlannedTeacher {
  std::shared_ptr<HeadEntry> entry;  // null: a one-head step (every other field unused)
  int64_t version = 0;
  int64_t hidden_size = 0;
  torch::ScalarType dtype = torch::kFloat;
  torch::Device device = torch::kCPU;
  int64_t row_bytes = 0;  // of one row of teacher hidden states
};
// ResolveTeacher, read once.
absl::StatusOr<PlannedTeacher> PlanTeacher(const HeadRegistry& registry, const HeadEntry& student,
                                           const std::string& teacher_id);

// rows.teacher_hidden (if any): as many rows as rows.hidden in the same message (the engine
// checks the rest); INVALID_ARGUMENT naming it otherwise.
absl::Status CheckTeacherRows(const core::TokenBatch& b);

}  // namespace remotehead::server
