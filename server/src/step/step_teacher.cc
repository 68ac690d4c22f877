#include "step/step_teacher.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

constexpr char kField[] = "header.teacher_head_id";

// An incompatible teacher: `code`'s status naming `field` of the teacher, both values, `why`.
absl::Status Incompatible(absl::StatusCode code, const std::string& teacher,
                          const std::string& field, const std::string& expected,
                          const std::string& actual, const std::string& why) {
  return core::WithReason(
      absl::Status(code, absl::StrCat(kField, ": teacher head \"", teacher, "\": ", field,
                                      ": expected ", expected, "; got ", actual, " (", why, ")")),
      core::reason::kTeacherIncompatible,
      {{"teacher", teacher}, {"field", field}, {"expected", expected}, {"actual", actual}});
}

std::string RangesText(const std::vector<core::ShardRange>& shards) {
  if (shards.empty()) return "one server (no shards)";
  return absl::StrCat("[",
                      absl::StrJoin(shards, ", ",
                                    [](std::string* out, const core::ShardRange& r) {
                                      absl::StrAppend(out, "[", r.offset, ", ", r.offset + r.rows,
                                                      ")");
                                    }),
                      "]");
}

bool SameRanges(const std::vector<core::ShardRange>& a, const std::vector<core::ShardRange>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].offset != b[i].offset || a[i].rows != b[i].rows) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::shared_ptr<HeadEntry>> ResolveTeacher(const HeadRegistry& registry,
                                                          const HeadEntry& student,
                                                          const std::string& teacher_id) {
  if (teacher_id.empty()) return std::shared_ptr<HeadEntry>();
  if (teacher_id == student.id()) {
    return Incompatible(absl::StatusCode::kInvalidArgument, teacher_id, "teacher_head_id",
                        absl::StrCat("a head other than the student \"", student.id(), "\""),
                        absl::StrCat("\"", teacher_id, "\""), "a head cannot be its own teacher");
  }
  absl::StatusOr<std::shared_ptr<HeadEntry>> teacher = registry.Get(teacher_id);
  if (!teacher.ok()) {
    return core::WithReason(
        absl::NotFoundError(absl::StrCat(kField,
                                         ": expected the id of a frozen head on this server; "
                                         "got \"",
                                         teacher_id, "\", which it does not have")),
        core::reason::kHeadNotFound, {{"head", teacher_id}, {"field", kField}});
  }
  if (!(*teacher)->frozen()) {
    return Incompatible(absl::StatusCode::kFailedPrecondition, teacher_id, "frozen", "true",
                        "false",
                        "only a frozen head may be a teacher: create or upload it with frozen");
  }
  const HeadDescription s = student.Describe();
  const HeadDescription t = (*teacher)->Describe();
  if (t.vocab_size != s.vocab_size) {
    return Incompatible(absl::StatusCode::kInvalidArgument, teacher_id, "vocab_size",
                        absl::StrCat(s.vocab_size), absl::StrCat(t.vocab_size),
                        absl::StrCat("the student \"", s.id,
                                     "\"'s vocabulary size: the two "
                                     "distributions are compared token by token"));
  }
  if (!SameRanges(t.shards, s.shards)) {
    return Incompatible(
        absl::StatusCode::kInvalidArgument, teacher_id, "shards", RangesText(s.shards),
        RangesText(t.shards),
        absl::StrCat("the student \"", s.id, "\"'s rows on every rank of the head group"));
  }
  return *std::move(teacher);
}

absl::StatusOr<PlannedTeacher> PlanTeacher(const HeadRegistry& registry, const HeadEntry& student,
                                           const std::string& teacher_id) {
  PlannedTeacher planned;
  ASSIGN_OR_RETURN(planned.entry, ResolveTeacher(registry, student, teacher_id));
  if (planned.entry == nullptr) return planned;
  planned.entry->Read([&](const core::Head& teacher) {
    planned.version = teacher.version();
    planned.hidden_size = teacher.hidden_size();
    planned.dtype = teacher.dtype();
    planned.device = teacher.device();
    planned.row_bytes =
        teacher.hidden_size() * static_cast<int64_t>(c10::elementSize(teacher.dtype()));
  });
  return planned;
}

absl::Status CheckTeacherRows(const core::TokenBatch& b) {
  const torch::Tensor& th = b.teacher_hidden;
  if (!th.defined() || !b.hidden.defined() || b.hidden.dim() < 1) return absl::OkStatus();
  const int64_t rows = th.dim() >= 1 ? th.size(0) : 1;
  if (rows == b.hidden.size(0) && th.dim() >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rows.teacher_hidden: expected ", b.hidden.size(0),
                   " rows (as many as rows.hidden in the same message); got ",
                   th.dim() >= 1 ? absl::StrCat(rows, " rows") : std::string("a 0-d tensor")));
}

}  // namespace remotehead::server
