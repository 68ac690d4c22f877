// The fixture of the C++ client's suites against an in-process server (client_test.cc,
// client_files_test.cc: one executable): a client whose chunk_bytes (4 KiB) bounds every
// request, a server that accepts nothing larger and streams its results in 1 KiB chunks, a
// checkpoint directory of the test's own, and head "lm" with a bias.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "core/reference.h"
#include "remotehead/client/client.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/engine.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

namespace rc = client;

constexpr int64_t kVocab = 300;
constexpr int64_t kHidden = 32;
constexpr int64_t kRows = 50;
constexpr int64_t kChunkBytes = 4096;

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    target_ = server_.target();
    client_ = *rc::Client::Create({.target = target_, .chunk_bytes = kChunkBytes});

    auto info = client_->CreateHead("lm", rc::InitSpec{.vocab_size = kVocab,
                                                       .hidden_size = kHidden,
                                                       .bias = true,
                                                       .seed = 5,
                                                       .init_std = 1.0 / std::sqrt(kHidden)});
    ASSERT_TRUE(info.ok()) << info.status();
    entry_ = *server_.registry().Get("lm");
    batch_ = reference::MakeTestBatch(Head(), kRows, "cross_entropy", core::Reduction::kMean);
  }

  const core::Head& Head() { return testing::HeadOf(*entry_); }

  torch::Tensor HeadWeightGrad() { return testing::HeadOf(*entry_).grads().weight.clone(); }

  // The spec matching core::StepOptions `options` on head "lm".
  static rc::StepSpec SpecFor(const core::StepOptions& options) {
    rc::StepSpec spec{.head_id = "lm",
                      .function = options.function,
                      .params = options.params,
                      .normalizer = options.normalizer,
                      .chunk_rows = options.chunk_rows,
                      .upstream_scale = options.upstream_scale};
    switch (options.reduction) {
      case core::Reduction::kNone:
        spec.reduction = rc::Reduction::kNone;
        break;
      case core::Reduction::kSum:
        spec.reduction = rc::Reduction::kSum;
        break;
      case core::Reduction::kMean:
        spec.reduction = rc::Reduction::kMean;
        break;
      case core::Reduction::kWeightedSum:
        spec.reduction = rc::Reduction::kWeightedSum;
        break;
    }
    return spec;
  }

  static rc::StepInputs InputsFor(const core::TokenBatch& batch) {
    return {.hidden = batch.hidden,
            .targets = batch.targets,
            .weights = batch.weights,
            .aux = batch.aux};
  }

  // The server's checkpoint directory: a fresh one per test, removed with the fixture.
  struct TempDir {
    TempDir()
        : path(std::filesystem::temp_directory_path() /
               ("remotehead_client_" + std::to_string(getpid()) + "_" +
                ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
      std::filesystem::create_directories(path);
    }
    ~TempDir() { std::filesystem::remove_all(path); }
    std::filesystem::path path;
  };
  TempDir checkpoints_;
  // Accepts no message larger than the client's chunk_bytes.
  testing::InProcessServer server_{
      {.response_chunk_bytes = 1024,
       .checkpoint_dir = *core::CheckpointDir::Open(checkpoints_.path.string())},
      kChunkBytes};
  std::string target_;
  std::shared_ptr<rc::Client> client_;
  std::shared_ptr<server::HeadEntry> entry_;
  core::TokenBatch batch_;
};

}  // namespace
}  // namespace remotehead
