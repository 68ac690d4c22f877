// One schema for a step's options: every rank of a head group receives the request's own
// StepHeader in each step command and reads it with the front's conversion (ReadStepHeader),
// so an option added to the header reaches every rank. The test sets every field of the
// header (by reflection: a field added later is set too) and checks that the group command
// carries it unchanged and that the other ranks read the options the front read.
#include "translate/step_header.h"

#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "replication/group_steps.h"

namespace remotehead {
namespace {

namespace pb = google::protobuf;

// Sets every field of `message` (recursively) to a value other than its default.
void SetEveryField(pb::Message* message) {
  const pb::Descriptor* d = message->GetDescriptor();
  const pb::Reflection* r = message->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_map()) {
      pb::Message* entry = r->AddMessage(message, f);
      SetEveryField(entry);
      continue;
    }
    if (f->is_repeated()) {
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
        r->AddString(message, f, "x-" + f->name());
        r->AddString(message, f, "y-" + f->name());
      } else {
        ADD_FAILURE() << f->full_name() << ": a repeated field; extend SetEveryField";
      }
      continue;
    }
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        SetEveryField(r->MutableMessage(message, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        r->SetString(message, f, "x-" + f->name());
        break;
      case pb::FieldDescriptor::CPPTYPE_INT64:
        r->SetInt64(message, f, 7);
        break;
      case pb::FieldDescriptor::CPPTYPE_INT32:
        r->SetInt32(message, f, 7);
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        r->SetDouble(message, f, 0.25);
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(message, f, true);
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnum(message, f, f->enum_type()->value(f->enum_type()->value_count() - 1));
        break;
      default:
        ADD_FAILURE() << f->full_name() << ": a field type SetEveryField does not set";
    }
  }
}

// The command a front sends for one engine call, as another rank parses it.
v1::GroupStepBatch ThroughTheGroupWire(const v1::StepHeader& header, core::CallMode mode) {
  const core::TokenBatch batch{.hidden = torch::zeros({2, 4})};
  const v1::GroupCommand sent = server::StepBatchCommand(
      /*session=*/3, header, mode, /*accumulate=*/true, {.weight_version = 1, .gradient_window = 2},
      /*first_row=*/5, batch, torch::Tensor());
  v1::GroupCommand received;
  EXPECT_TRUE(received.ParseFromString(sent.SerializeAsString()));
  return received.step_batch();
}

TEST(StepHeaderOnTheGroupWire, EveryFieldOfTheHeaderIsCarried) {
  v1::StepHeader header;
  SetEveryField(&header);
  const pb::Descriptor* d = v1::StepHeader::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    EXPECT_TRUE(f->is_repeated() ? header.GetReflection()->FieldSize(header, f) > 0
                                 : header.GetReflection()->HasField(header, f))
        << f->name();
  }
  const v1::GroupStepBatch b = ThroughTheGroupWire(header, core::CallMode::kFused);
  std::string difference;
  pb::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&difference);
  EXPECT_TRUE(differ.Compare(header, b.header())) << difference;
  EXPECT_EQ(b.head_id(), header.head_id());
  EXPECT_EQ(b.first_row(), 5);
}

// The options a rank reads, field by field (the rank's own: shard, workspace, should_stop).
void ExpectSameOptions(const core::StepOptions& a, const core::StepOptions& b) {
  EXPECT_EQ(a.function, b.function);
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(a.reduction, b.reduction);
  EXPECT_EQ(a.normalizer, b.normalizer);
  EXPECT_EQ(a.ignore_index, b.ignore_index);
  EXPECT_EQ(a.chunk_rows, b.chunk_rows);
  EXPECT_EQ(a.memory_budget_bytes, b.memory_budget_bytes);
  EXPECT_EQ(a.upstream_scale, b.upstream_scale);
  EXPECT_EQ(a.output_dtype, b.output_dtype);
  EXPECT_EQ(a.logits_dtype, b.logits_dtype);
  EXPECT_EQ(a.token_extras, b.token_extras);
}

TEST(StepHeaderOnTheGroupWire, EveryRankReadsTheOptionsTheFrontRead) {
  v1::StepHeader fused;
  fused.set_head_id("lm");
  fused.set_rows(9);
  v1::FunctionSpec* fn = fused.mutable_function();
  fn->set_name("cross_entropy");
  (*fn->mutable_params())["label_smoothing"] = 0.1;
  (*fn->mutable_params())["temperature"] = 0.7;
  fn->set_reduction(v1::REDUCTION_MEAN);
  fn->set_ignore_index(-7);
  fused.set_valid_tokens(6);
  fused.mutable_chunking()->set_chunk_rows(3);
  fused.mutable_chunking()->set_memory_budget_bytes(1 << 20);
  fused.set_upstream_scale(0.5);
  fused.add_token_extras("nll");
  fused.set_logits_dtype(v1::DTYPE_FLOAT32);

  v1::StepHeader logits;
  logits.set_head_id("lm");
  logits.mutable_function()->set_name("logits");
  logits.mutable_function()->set_reduction(v1::REDUCTION_NONE);
  logits.set_output_dtype(v1::DTYPE_BFLOAT16);

  v1::StepHeader backward = fused;
  backward.mutable_function()->set_reduction(v1::REDUCTION_SUM);
  backward.mutable_function()->set_normalizer(11);

  for (const auto& [header, mode] :
       {std::pair{fused, core::CallMode::kFused}, std::pair{logits, core::CallMode::kForward},
        std::pair{backward, core::CallMode::kBackward}}) {
    SCOPED_TRACE(header.ShortDebugString());
    const absl::StatusOr<server::StepCall> front = server::ReadStepHeader(header, mode);
    ASSERT_TRUE(front.ok()) << front.status();
    const v1::GroupStepBatch b = ThroughTheGroupWire(header, mode);
    const absl::StatusOr<server::StepCall> rank =
        server::ReadStepHeader(b.header(), static_cast<core::CallMode>(b.mode()));
    ASSERT_TRUE(rank.ok()) << rank.status();
    ExpectSameOptions(front->options, rank->options);
  }
  // What the header asked for is what was read (not only the same on both sides).
  const server::StepCall read = *server::ReadStepHeader(fused, core::CallMode::kFused);
  EXPECT_EQ(read.options.normalizer, 6);
  EXPECT_EQ(read.options.ignore_index, -7);
  EXPECT_EQ(read.options.chunk_rows, 3);
  EXPECT_EQ(read.options.upstream_scale, 0.5);
  EXPECT_EQ(read.options.token_extras, std::vector<std::string>{"nll"});
  EXPECT_EQ(read.options.logits_dtype, torch::kFloat);
  const server::StepCall read_logits = *server::ReadStepHeader(logits, core::CallMode::kForward);
  EXPECT_EQ(read_logits.options.output_dtype, torch::kBFloat16);
  EXPECT_EQ(read_logits.options.logits_dtype, std::nullopt);  // unset: the head's dtype
}

// The call's own fields (what the session checks against the head) are read into the StepCall,
// the session's only view of the header.
TEST(StepHeaderRead, TheCallsFieldsReachTheSession) {
  v1::StepHeader header;
  header.set_head_id("lm");
  header.set_rows(12);
  header.mutable_function()->set_reduction(v1::REDUCTION_SUM);
  header.set_valid_tokens(10);
  header.set_expected_incarnation("inc-1");
  header.set_expected_weight_version(4);
  header.set_accumulate_weight_grad(true);
  header.mutable_gradient_id()->set_trainer("t0");
  header.mutable_gradient_id()->set_step(3);
  header.mutable_gradient_id()->set_micro_batch(2);
  header.set_grad_hidden_dtype(v1::DTYPE_BFLOAT16);
  const absl::StatusOr<server::StepCall> call =
      server::ReadStepHeader(header, core::CallMode::kFused);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_TRUE(call->accumulate_weight_grad);
  EXPECT_EQ(call->head_id, "lm");
  EXPECT_EQ(call->rows, 12);
  EXPECT_EQ(call->valid_tokens, 10);
  EXPECT_EQ(call->expected_incarnation, "inc-1");
  EXPECT_EQ(call->expected_weight_version, 4);
  ASSERT_TRUE(call->gradient.has_value());
  EXPECT_EQ(*call->gradient, (server::GradientKey{"t0", 3, 2}));
  EXPECT_EQ(call->grad_hidden_dtype, torch::kBFloat16);
  EXPECT_TRUE(call->inputs_handle.empty());
  EXPECT_EQ(call->retain_inputs_seconds, 0);

  v1::StepHeader forward = header;
  forward.set_accumulate_weight_grad(false);  // its gradient_id, still set, names nothing
  forward.set_retain_inputs_seconds(30);
  const absl::StatusOr<server::StepCall> kept =
      server::ReadStepHeader(forward, core::CallMode::kForward);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_FALSE(kept->accumulate_weight_grad);
  EXPECT_FALSE(kept->gradient.has_value());
  EXPECT_EQ(kept->retain_inputs_seconds, 30);

  v1::StepHeader backward = forward;
  backward.set_retain_inputs_seconds(0);
  backward.set_inputs_handle("h-1");
  EXPECT_EQ(server::ReadStepHeader(backward, core::CallMode::kBackward)->inputs_handle, "h-1");

  // An identity without a trainer is none (the session refuses it on an accumulating call,
  // after the incarnation and version checks).
  v1::StepHeader anonymous = header;
  anonymous.mutable_gradient_id()->clear_trainer();
  const absl::StatusOr<server::StepCall> read =
      server::ReadStepHeader(anonymous, core::CallMode::kFused);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->accumulate_weight_grad);
  EXPECT_FALSE(read->gradient.has_value());
}

}  // namespace
}  // namespace remotehead
