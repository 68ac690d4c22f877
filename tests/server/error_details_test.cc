// Machine-readable reasons: every failed status carries a google.rpc.ErrorInfo (reason, domain,
// metadata) in its details, made by the one status seam from the reason core/ and server/
// attach (core/error_reason.h); and ListFunctions describes every registered function from the
// registry. Checked on the seam alone and over a real gRPC channel.
#include "remotehead/core/error_reason.h"
#include "remotehead/core/functions.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "service/head_expectations.h"
#include "service_fixture.h"

namespace remotehead {
namespace {

struct Detail {
  v1::RpcStatus status;
  v1::ErrorInfo info;
};

// The status details as a client decodes them: one RpcStatus, one ErrorInfo in it.
Detail DetailsOf(const grpc::Status& status) {
  Detail d;
  EXPECT_TRUE(d.status.ParseFromString(status.error_details())) << status.error_message();
  EXPECT_EQ(d.status.details_size(), 1);
  if (d.status.details_size() == 1) {
    EXPECT_EQ(d.status.details(0).type_url(), server::kErrorInfoTypeUrl);
    EXPECT_TRUE(d.info.ParseFromString(d.status.details(0).value()));
  }
  EXPECT_EQ(d.info.domain(), "remotehead.dev");
  EXPECT_EQ(d.status.code(), static_cast<int>(status.error_code()));
  EXPECT_EQ(d.status.message(), status.error_message());
  return d;
}

TEST(ErrorReason, AttachedReasonsAndTheCodesDefaults) {
  const absl::Status plain = absl::InvalidArgumentError("params[\"beta\"]: expected >= 0; got -1");
  EXPECT_FALSE(core::GetReason(plain).has_value());
  EXPECT_EQ(core::ReasonOf(plain).reason, "INVALID_FIELD");
  EXPECT_EQ(core::ReasonOf(plain).metadata.at("field"), "params[\"beta\"]");
  // A message that names no field first gets no field.
  EXPECT_TRUE(core::ReasonOf(absl::InvalidArgumentError("every rank: x")).metadata.empty());
  EXPECT_EQ(core::ReasonOf(absl::InternalError("x")).reason, "INTERNAL");
  EXPECT_EQ(core::ReasonOf(absl::DeadlineExceededError("x")).reason, "DEADLINE_EXCEEDED");

  const absl::Status tagged =
      core::WithReason(absl::AbortedError("rank 1 missing"), core::reason::kRanksMissing,
                       {{"missing_ranks", "1,3"}, {"head", std::string("a\0:b", 4)}});
  EXPECT_EQ(tagged.message(), "rank 1 missing");
  EXPECT_EQ(core::ReasonOf(tagged).reason, "RANKS_MISSING");
  EXPECT_EQ(core::ReasonOf(tagged).metadata.at("missing_ranks"), "1,3");
  EXPECT_EQ(core::ReasonOf(tagged).metadata.at("head"), std::string("a\0:b", 4));
  // Carried between processes whole (a head group's reply).
  const absl::Status copied = core::WithSerializedReason(absl::AbortedError("rank 1 missing"),
                                                         core::SerializeReason(tagged));
  EXPECT_EQ(copied, tagged);
  EXPECT_EQ(core::SerializeReason(plain), "");
  EXPECT_TRUE(core::WithReason(absl::OkStatus(), "X").ok());
}

TEST(ErrorReason, TheSeamSendsAnErrorInfoWithEveryFailedStatus) {
  for (const absl::Status& s :
       {absl::InvalidArgumentError("targets[3]: expected a token id; got 40"),
        absl::NotFoundError("x"), absl::InternalError("y"), absl::CancelledError("z"),
        core::WithReason(absl::FailedPreconditionError("restarted"), core::reason::kServerRestarted,
                         {{"head", "lm"}})}) {
    const grpc::Status g = server::ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), static_cast<int>(s.code()));
    EXPECT_EQ(g.error_message(), s.message());
    const Detail d = DetailsOf(g);
    EXPECT_EQ(d.info.reason(), core::ReasonOf(s).reason);
    EXPECT_EQ(d.info.metadata().size(), core::ReasonOf(s).metadata.size());
  }
  EXPECT_EQ(DetailsOf(server::ToGrpcStatus(absl::InvalidArgumentError("targets[3]: bad")))
                .info.metadata()
                .at("field"),
            "targets[3]");
  EXPECT_TRUE(server::ToGrpcStatus(absl::OkStatus()).error_details().empty());
}

class ErrorDetailsServiceTest : public ServiceFixture {};

TEST_F(ErrorDetailsServiceTest, RefusalsOverTheWireNameTheirReasonAndSubject) {
  StartService({});
  {
    grpc::ClientContext context;
    v1::HeadRef ref;
    ref.set_head_id("missing");
    v1::HeadInfo info;
    const grpc::Status s = stub_->DescribeHead(&context, ref, &info);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    const Detail d = DetailsOf(s);
    EXPECT_EQ(d.info.reason(), "HEAD_NOT_FOUND");
    EXPECT_EQ(d.info.metadata().at("head"), "missing");
  }
  {
    v1::CreateHeadRequest create;
    create.set_head_id("lm");
    create.mutable_init()->set_vocab_size(10);
    create.mutable_init()->set_hidden_size(4);
    grpc::ClientContext context;
    v1::HeadInfo info;
    const Detail d = DetailsOf(stub_->CreateHead(&context, create, &info));
    EXPECT_EQ(d.info.reason(), "HEAD_EXISTS");
  }
  const int64_t version = entry_->Describe().weight_version;
  // A step pinned to another server process, then to another version: nothing accumulated.
  StepOutcome restarted = Step("t", 0, 17, [](v1::StepRequest& r) {
    if (r.has_header()) r.mutable_header()->set_expected_incarnation("0000000000000000");
  });
  ASSERT_EQ(restarted.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  Detail d = DetailsOf(restarted.status);
  EXPECT_EQ(d.info.reason(), "SERVER_RESTARTED");
  EXPECT_EQ(d.info.metadata().at("head"), "lm");
  EXPECT_EQ(d.info.metadata().at("expected_incarnation"), "0000000000000000");
  EXPECT_EQ(d.info.metadata().at("incarnation"), server::ServerIncarnation());
  EXPECT_EQ(d.info.metadata().at("weight_version"), absl::StrCat(version));

  StepOutcome stale = Step("t", 0, 17, [&](v1::StepRequest& r) {
    if (r.has_header()) r.mutable_header()->set_expected_weight_version(version + 7);
  });
  d = DetailsOf(stale.status);
  EXPECT_EQ(d.info.reason(), "WEIGHT_VERSION_MISMATCH");
  EXPECT_EQ(d.info.metadata().at("expected"), absl::StrCat(version + 7));
  EXPECT_EQ(d.info.metadata().at("actual"), absl::StrCat(version));

  StepOutcome bad = Step("t", 0, 17, [](v1::StepRequest& r) {
    if (r.has_header()) (*r.mutable_header()->mutable_function()->mutable_params())["bogus"] = 1;
  });
  ASSERT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  d = DetailsOf(bad.status);
  EXPECT_EQ(d.info.reason(), "INVALID_FIELD");
  EXPECT_EQ(d.info.metadata().at("field"), "params[\"bogus\"]");
  EXPECT_EQ(entry_->Describe().accumulated_micro_batches, 0);
}

TEST_F(ErrorDetailsServiceTest, ListFunctionsDescribesEveryRegisteredFunction) {
  StartService({});
  grpc::ClientContext context;
  v1::ListFunctionsResponse response;
  ASSERT_TRUE(stub_->ListFunctions(&context, {}, &response).ok());
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  ASSERT_EQ(response.functions_size(), static_cast<int>(registry.Names().size()));
  for (const v1::FunctionDescription& d : response.functions()) {
    SCOPED_TRACE(d.name());
    const core::TransformFunction* fn = *registry.Find(d.name());
    EXPECT_EQ(d.help(), fn->help);
    EXPECT_EQ(d.needs_targets(), fn->needs_targets);
    EXPECT_EQ(std::vector<std::string>(d.required_aux().begin(), d.required_aux().end()),
              fn->required_aux);
    EXPECT_EQ(std::vector<std::string>(d.optional_aux().begin(), d.optional_aux().end()),
              fn->optional_aux);
    const auto& common = core::FunctionRegistry::CommonParams();
    ASSERT_EQ(d.params_size(), static_cast<int>(fn->params.size() + common.size()));
    for (int i = 0; i < d.params_size(); ++i) {
      const core::ParamSpec& spec =
          i < static_cast<int>(fn->params.size()) ? fn->params[i] : common[i - fn->params.size()];
      EXPECT_EQ(d.params(i).name(), spec.name);
      EXPECT_EQ(d.params(i).default_value(), spec.default_value);
      EXPECT_EQ(d.params(i).min_value(), spec.min_value);
      EXPECT_EQ(d.params(i).max_value(), spec.max_value);
      EXPECT_EQ(d.params(i).help(), spec.help);
      EXPECT_EQ(d.params(i).common(), i >= static_cast<int>(fn->params.size()));
    }
    EXPECT_EQ(d.vocab_decomposable(), fn->vocab_decomposable);
    const bool per_token = fn->output == core::OutputKind::kPerToken;
    EXPECT_EQ(d.differentiable(), per_token);
    EXPECT_EQ(d.output_kind(), per_token                                 ? v1::OUTPUT_KIND_PER_TOKEN
                               : fn->output == core::OutputKind::kLogits ? v1::OUTPUT_KIND_LOGITS
                                                                         : v1::OUTPUT_KIND_SAMPLE);
    EXPECT_EQ(d.output_dtype(), v1::DTYPE_FLOAT32);
    EXPECT_EQ(d.output_float64_on_float64_heads(), fn->output != core::OutputKind::kLogits);
  }
}

}  // namespace
}  // namespace remotehead
