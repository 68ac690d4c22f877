// The HeadService on a loopback port with one small head, and a raw-stub client that streams a
// step call in pieces: shared by the service's test files (one per concern).
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/rpc/head_service.h"
#include "remotehead/wire/tensor_codec.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

namespace remotehead {

using wire::DecodeTensor;
using wire::EncodeTensor;

constexpr int64_t kVocab = 300;
constexpr int64_t kHidden = 32;
constexpr int64_t kRows = 50;

class ServiceFixture : public ::testing::Test {
 protected:
  // Starts the service on a loopback port with head "lm" [kVocab, kHidden] + bias and a test
  // batch of kRows rows.
  void StartService(server::ServiceOptions options) {
    server_ = std::make_unique<testing::InProcessServer>(options);
    ASSERT_TRUE(server_->started());
    stub_ = v1::HeadService::NewStub(
        grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
    v1::CreateHeadRequest create;
    create.set_head_id("lm");
    create.mutable_init()->set_vocab_size(kVocab);
    create.mutable_init()->set_hidden_size(kHidden);
    create.mutable_init()->set_bias(true);
    create.mutable_init()->set_seed(5);
    create.mutable_init()->set_init_std(1.0 / std::sqrt(double(kHidden)));
    grpc::ClientContext context;
    v1::HeadInfo info;
    ASSERT_TRUE(stub_->CreateHead(&context, create, &info).ok());
    entry_ = *registry().Get("lm");
    batch_ = reference::MakeTestBatch(testing::HeadOf(*entry_), kRows, "cross_entropy",
                                      core::Reduction::kMean);
  }

  grpc::Status Drop(const std::string& id) {
    grpc::ClientContext context;
    v1::HeadRef ref;
    ref.set_head_id(id);
    v1::DropHeadResponse dropped;
    return stub_->DropHead(&context, ref, &dropped);
  }

  // Streams W (and b, if defined) as UploadHead `id` in 64-row chunks; `corrupt` may edit each
  // message before it is sent.
  grpc::Status Upload(const std::string& id, const torch::Tensor& w, const torch::Tensor& b,
                      bool replace = false,
                      const std::function<void(v1::UploadHeadRequest&)>& corrupt = nullptr,
                      v1::HeadInfo* info = nullptr) {
    grpc::ClientContext context;
    v1::HeadInfo ignored;
    auto writer = stub_->UploadHead(&context, info != nullptr ? info : &ignored);
    std::vector<v1::UploadHeadRequest> messages(1);
    auto* h = messages[0].mutable_header();
    h->set_head_id(id);
    h->set_vocab_size(w.size(0));
    h->set_hidden_size(w.size(1));
    h->set_dtype(*wire::ToWireDtype(w.scalar_type(), "w"));
    h->set_has_bias(b.defined());
    h->set_replace(replace);
    for (int64_t offset = 0; offset < w.size(0); offset += 64) {
      const int64_t n = std::min<int64_t>(64, w.size(0) - offset);
      v1::UploadHeadRequest m;
      m.mutable_weight_rows()->set_row_offset(offset);
      EXPECT_TRUE(
          EncodeTensor(w.narrow(0, offset, n), m.mutable_weight_rows()->mutable_values()).ok());
      messages.push_back(std::move(m));
    }
    if (b.defined()) {
      v1::UploadHeadRequest bias;
      EXPECT_TRUE(EncodeTensor(b, bias.mutable_bias_rows()->mutable_values()).ok());
      messages.push_back(std::move(bias));
    }
    for (auto& m : messages) {
      if (corrupt) corrupt(m);
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  server::HeadRegistry& registry() { return server_->registry(); }
  server::HeadService& service() { return server_->service(); }

  struct StepOutcome {
    grpc::Status status;
    torch::Tensor grad_hidden;  // assembled from the streamed chunks
    torch::Tensor outputs;      // per-token outputs (Forward, reduction NONE)
    v1::StepSummary summary;
    v1::DType grad_hidden_wire_dtype = v1::DTYPE_UNSPECIFIED;  // as dX chunks arrived
  };

  enum class Rpc { kForwardBackward, kForward, kBackward };

  // The messages of a step on the test batch: the header, then the rows in pieces of `piece`
  // rows; `grad_output` ([N]) is sent with the rows (Backward with reduction NONE).
  std::vector<v1::StepRequest> StepMessages(const std::string& trainer, int64_t micro_batch,
                                            int64_t piece, Rpc rpc,
                                            const torch::Tensor& grad_output = {}) {
    v1::StepRequest header;
    v1::StepHeader* h = header.mutable_header();
    h->set_head_id("lm");
    h->mutable_function()->set_name("cross_entropy");
    h->mutable_function()->set_reduction(v1::REDUCTION_MEAN);
    h->set_rows(kRows);
    h->set_valid_tokens((batch_.targets != -100).sum().item<int64_t>());
    h->set_accumulate_weight_grad(rpc != Rpc::kForward);
    h->mutable_gradient_id()->set_trainer(trainer);
    h->mutable_gradient_id()->set_micro_batch(micro_batch);
    h->mutable_chunking()->set_chunk_rows(8);
    std::vector<v1::StepRequest> messages = {header};
    for (int64_t offset = 0; offset < kRows; offset += piece) {
      const int64_t n = std::min(piece, kRows - offset);
      v1::StepRequest rows;
      rows.mutable_rows()->set_row_offset(offset);
      EXPECT_TRUE(
          EncodeTensor(batch_.hidden.narrow(0, offset, n), rows.mutable_rows()->mutable_hidden())
              .ok());
      EXPECT_TRUE(
          EncodeTensor(batch_.targets.narrow(0, offset, n), rows.mutable_rows()->mutable_targets())
              .ok());
      if (grad_output.defined()) {
        EXPECT_TRUE(EncodeTensor(grad_output.narrow(0, offset, n),
                                 rows.mutable_rows()->mutable_grad_output())
                        .ok());
      }
      messages.push_back(std::move(rows));
    }
    return messages;
  }

  // Sends StepMessages on one stream; `corrupt` may alter messages.
  StepOutcome Step(const std::string& trainer, int64_t micro_batch, int64_t piece = 17,
                   std::function<void(v1::StepRequest&)> corrupt = nullptr,
                   Rpc rpc = Rpc::kForwardBackward, const torch::Tensor& grad_output = {}) {
    grpc::ClientContext context;
    if (step_deadline_) context.set_deadline(std::chrono::system_clock::now() + *step_deadline_);
    auto stream = rpc == Rpc::kForward    ? stub_->Forward(&context)
                  : rpc == Rpc::kBackward ? stub_->Backward(&context)
                                          : stub_->ForwardBackward(&context);
    std::vector<v1::StepRequest> messages =
        StepMessages(trainer, micro_batch, piece, rpc, grad_output);
    StepOutcome outcome;
    outcome.grad_hidden = torch::full({kRows, kHidden}, NAN);
    outcome.outputs = torch::full({kRows}, NAN);
    std::thread reader([&] {
      v1::StepResponse response;
      while (stream->Read(&response)) {
        if (response.has_grad_hidden()) {
          const auto& chunk = response.grad_hidden();
          outcome.grad_hidden_wire_dtype = chunk.values().dtype();
          torch::Tensor values = *DecodeTensor(chunk.values(), "grad_hidden");
          outcome.grad_hidden.narrow(0, chunk.row_offset(), values.size(0)).copy_(values);
        } else if (response.has_outputs()) {
          const auto& chunk = response.outputs();
          torch::Tensor values = *DecodeTensor(chunk.values(), "outputs");
          outcome.outputs.narrow(0, chunk.row_offset(), values.size(0)).copy_(values);
        } else if (response.has_summary()) {
          outcome.summary = response.summary();
        }
      }
    });
    for (auto& m : messages) {
      if (corrupt) corrupt(m);
      if (m.part_case() == v1::StepRequest::PART_NOT_SET) continue;  // dropped by `corrupt`
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    reader.join();
    outcome.status = stream->Finish();
    return outcome;
  }

  // The header of a ForwardBackward of kRows rows on "lm" that accumulates dW as `trainer`.
  static v1::StepRequest AccumulatingHeader(const std::string& trainer) {
    v1::StepRequest header;
    header.mutable_header()->set_head_id("lm");
    header.mutable_header()->set_rows(kRows);
    header.mutable_header()->set_valid_tokens(1);
    header.mutable_header()->set_accumulate_weight_grad(true);
    header.mutable_header()->mutable_gradient_id()->set_trainer(trainer);
    return header;
  }

  // Admission's figures for the Step() requests (chunk_rows 8) on a head shaped like "lm", from
  // core's memory model: what one engine call holds, the rows and results in flight, and the
  // scratch dW of a request that accumulates.
  static int64_t EngineBytes(const std::string& function, core::Reduction reduction,
                             core::CallMode mode) {
    auto head =
        core::Head::Initialize({.vocab_size = kVocab, .hidden_size = kHidden, .bias = true}, {});
    auto plan =
        core::PlanCall(**head, {.function = function, .reduction = reduction, .chunk_rows = 8});
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan->Memory(8, mode).total();
  }
  static constexpr int64_t kPipelineBytes = 2 * kRows * kHidden * 4;  // X in flight, dX waiting
  static constexpr int64_t kScratchBytes = (kVocab * kHidden + kVocab) * 4;
  // What head "lm" holds in the memory budget: W and b, dW and db, all float32.
  static constexpr int64_t kHeadBytes = 2 * kScratchBytes;

  // Waits (up to 5 s) until no request is admitted or queued any more and the bytes still held
  // (retained inputs) are `held_bytes`: a call's admission is released when its reactor goes,
  // which may be after the client has seen its status.
  void ExpectAdmissionSettles(int64_t held_bytes) {
    for (int i = 0; i < 500; ++i) {
      const server::AdmissionStats stats = service().admission().Stats();
      if (stats.active == 0 && stats.queued == 0 && stats.bytes_in_use == held_bytes) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    const server::AdmissionStats stats = service().admission().Stats();
    ADD_FAILURE() << "admission never settled at " << held_bytes << " bytes: " << stats.active
                  << " active, " << stats.queued << " queued, " << stats.bytes_in_use << " bytes";
  }
  void ExpectAdmissionDrains() { ExpectAdmissionSettles(0); }

  torch::Tensor HeadWeightGrad() { return testing::HeadOf(*entry_).grads().weight.clone(); }

  // When set, every Step gets this deadline.
  std::optional<std::chrono::milliseconds> step_deadline_;
  std::unique_ptr<testing::InProcessServer> server_;
  std::unique_ptr<v1::HeadService::Stub> stub_;
  std::shared_ptr<server::HeadEntry> entry_;
  core::TokenBatch batch_;
};

}  // namespace remotehead
