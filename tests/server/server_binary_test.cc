// The real remotehead-server process on loopback: it starts with a preloaded head (on the CPU,
// and on CUDA when the machine has a GPU), serves a ForwardBackward whose result equals the
// engine's, keeps serving after a bad request, and on SIGTERM drains and exits 0; --device
// refuses a device the machine lacks and --memory_budget_bytes=-1 plans with the GPU's free
// memory; --checkpoint_dir reaches the service (and a bad one stops it).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "remotehead/wire/tensor_codec.h"
#include "support/child_process.h"
#include "support/devices.h"

namespace remotehead {
namespace {

using testing::ServerProcess;

class ServerBinaryOnDevice : public ::testing::TestWithParam<std::string> {};

TEST_P(ServerBinaryOnDevice, ServesForwardBackwardAndDrainsOnSigterm) {
  const torch::Device device(GetParam());
  REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device);
  ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                        "--device=" + device.str(), "--head=lm:257:16:float32:3"});
  ASSERT_GT(server.port(), 0) << server.log();
  auto stub = v1::HeadService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials()));

  grpc::ClientContext describe_context;
  v1::HeadRef ref;
  ref.set_head_id("lm");
  v1::HeadInfo info;
  ASSERT_TRUE(stub->DescribeHead(&describe_context, ref, &info).ok());
  EXPECT_EQ(info.vocab_size(), 257);
  EXPECT_EQ(info.device(), device.str());

  // The same head locally (same seed, same init), to compare with.
  auto local = core::Head::Initialize({.vocab_size = 257, .hidden_size = 16, .seed = 3}, {});
  ASSERT_TRUE(local.ok());
  const core::TokenBatch batch =
      reference::MakeTestBatch(**local, 20, "cross_entropy", core::Reduction::kSum);
  auto expected =
      core::FusedForwardBackward(**local, batch, {.reduction = core::Reduction::kSum}, nullptr);
  ASSERT_TRUE(expected.ok());

  for (const bool corrupt : {true, false}) {
    grpc::ClientContext context;
    auto stream = stub->ForwardBackward(&context);
    v1::StepRequest header;
    header.mutable_header()->set_head_id("lm");
    header.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_SUM);
    header.mutable_header()->set_rows(20);
    ASSERT_TRUE(stream->Write(header));
    v1::StepRequest rows;
    ASSERT_TRUE(wire::EncodeTensor(batch.hidden, rows.mutable_rows()->mutable_hidden()).ok());
    ASSERT_TRUE(wire::EncodeTensor(batch.targets, rows.mutable_rows()->mutable_targets()).ok());
    if (corrupt) rows.mutable_rows()->mutable_hidden()->set_dtype(v1::DTYPE_FLOAT64);
    stream->Write(rows);
    stream->WritesDone();
    v1::StepResponse response;
    double loss = NAN;
    torch::Tensor dx;
    while (stream->Read(&response)) {
      if (response.has_summary()) loss = response.summary().loss();
      if (response.has_grad_hidden()) {
        dx = *wire::DecodeTensor(response.grad_hidden().values(), "dx");
      }
    }
    const grpc::Status status = stream->Finish();
    if (corrupt) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_EQ(status.error_message(),
                "rows.hidden: expected 2560 bytes for Double [20, 16]; got 1280");
      continue;
    }
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_LE(reference::RelativeError(loss, expected->loss), 1e-5);
    EXPECT_LE(reference::RelativeError(dx, expected->grad_hidden), 1e-5);
  }

  EXPECT_EQ(server.Terminate(), 0);
  EXPECT_NE(server.log().find("remotehead-server: stopped"), std::string::npos) << server.log();
}

INSTANTIATE_TEST_SUITE_P(Devices, ServerBinaryOnDevice, ::testing::ValuesIn(testing::TestDevices()),
                         [](const auto& info) { return testing::DeviceLabel(info.param); });

// A device the machine does not have stops the server before it loads anything, with the flag,
// the device and what the machine has in the message (on any machine: none has 64 GPUs).
TEST(ServerBinary, DeviceTheMachineLacksIsRefused) {
  for (const std::string name : {"cuda:63", "tpu:0"}) {
    ServerProcess refused(
        {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=" + name, "--head=lm:257:16"});
    EXPECT_EQ(refused.ExitCode(), 2) << refused.log();
    const std::string expected =
        name == "tpu:0" ? "--device: expected auto, cpu, cuda or cuda:N; got \"tpu:0\""
        : torch::cuda::is_available()
            ? "--device: expected an available device (cuda:0 to cuda:"
            : "--device: expected an available device; got cuda:63 but CUDA is not available";
    EXPECT_NE(refused.log().find(expected), std::string::npos) << refused.log();
  }
}

// --memory_budget_bytes=-1 on the last GPU (--device=cuda:N): the server plans with 90% of that
// device's free memory (after its own CUDA context) plus its heads, as its start-up line says.
TEST(ServerBinary, AutoBudgetOnCudaIsTheDevicesFreeMemory) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const torch::Device last(torch::kCUDA,
                           static_cast<c10::DeviceIndex>(torch::cuda::device_count() - 1));
  const int64_t free_before = *core::AvailableMemoryBytes(last);
  ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=" + last.str(),
                        "--memory_budget_bytes=-1", "--head=lm:32000:1024:bfloat16:3"});
  ASSERT_GT(server.port(), 0) << server.log();
  const std::string marker = "admission: memory budget ";
  const size_t at = server.log().find(marker);
  ASSERT_NE(at, std::string::npos) << server.log();
  int64_t budget_mib = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      server.log().substr(at + marker.size(),
                          server.log().find(' ', at + marker.size()) - at - marker.size()),
      &budget_mib))
      << server.log();
  // W bf16 + dW fp32: 6 bytes a weight. The server's own context takes some of what was free.
  const int64_t head_mib = (int64_t{32000} * 1024 * 6) >> 20;
  EXPECT_LE(budget_mib, (free_before / 10 * 9 >> 20) + head_mib) << server.log();
  EXPECT_GE(budget_mib, ((free_before - (int64_t{2} << 30)) / 10 * 9 >> 20)) << server.log();
  EXPECT_NE(server.log().find("(device " + last.str() + ")"), std::string::npos) << server.log();
  EXPECT_EQ(server.Terminate(), 0) << server.log();
}

// A trainer killed (SIGKILL) in the middle of a step: the server notices the broken stream, adds
// nothing to dW, frees the request's admission (here the only slot: --max_active_requests=1,
// no queue), and the same gradient id then runs as a fresh contribution.
TEST(ServerBinary, ClientKilledMidStreamLeavesGradientsUntouched) {
  ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                        "--head=lm:257:16:float32:3", "--max_active_requests=1",
                        "--max_queued_requests=0"});
  ASSERT_GT(server.port(), 0) << server.log();
  testing::ChildProcess client(
      {REMOTEHEAD_ABANDONED_CLIENT, server.target()}, [](const std::string& line) {
        return line.find("abandoned-step-client: streaming") != std::string::npos;
      });
  ASSERT_NE(client.ready_line(), "") << client.log();
  EXPECT_EQ(client.Wait(SIGKILL), -SIGKILL);

  auto stub = v1::HeadService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  auto local = core::Head::Initialize({.vocab_size = 257, .hidden_size = 16, .seed = 3}, {});
  ASSERT_TRUE(local.ok());
  const core::TokenBatch batch =
      reference::MakeTestBatch(**local, 64, "cross_entropy", core::Reduction::kSum);
  core::GradientBuffers expected = (*local)->NewGradientBuffers();
  ASSERT_TRUE(
      core::FusedForwardBackward(**local, batch, {.reduction = core::Reduction::kSum}, &expected)
          .ok());

  // The server may take a moment to see the connection drop; until then the slot is taken.
  grpc::Status status;
  v1::StepSummary summary;
  for (int attempt = 0; attempt < 50; ++attempt) {
    grpc::ClientContext context;
    auto stream = stub->ForwardBackward(&context);
    v1::StepRequest header;
    header.mutable_header()->set_head_id("lm");
    header.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_SUM);
    header.mutable_header()->set_rows(64);
    header.mutable_header()->set_accumulate_weight_grad(true);
    header.mutable_header()->mutable_gradient_id()->set_trainer("killed/rank-0");
    v1::StepRequest rows;
    ASSERT_TRUE(wire::EncodeTensor(batch.hidden, rows.mutable_rows()->mutable_hidden()).ok());
    ASSERT_TRUE(wire::EncodeTensor(batch.targets, rows.mutable_rows()->mutable_targets()).ok());
    stream->Write(header);
    stream->Write(rows);
    stream->WritesDone();
    v1::StepResponse response;
    while (stream->Read(&response)) {
      if (response.has_summary()) summary = response.summary();
    }
    status = stream->Finish();
    if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(summary.replayed()) << "the killed request must not have been recorded";

  // dW on the server is exactly this one contribution.
  grpc::ClientContext fetch_context;
  v1::FetchGradientsRequest fetch;
  fetch.set_head_id("lm");
  auto reader = stub->FetchGradients(&fetch_context, fetch);
  torch::Tensor dw = torch::full({257, 16}, NAN);
  v1::FetchGradientsResponse part;
  while (reader->Read(&part)) {
    if (part.has_weight_grad_rows()) {
      torch::Tensor values = *wire::DecodeTensor(part.weight_grad_rows().values(), "dw");
      dw.narrow(0, part.weight_grad_rows().row_offset(), values.size(0)).copy_(values);
    }
    if (part.has_info()) {
      EXPECT_EQ(part.info().accumulated_micro_batches(), 1);
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_LE(reference::RelativeError(dw, expected.weight), 1e-5);
  EXPECT_EQ(server.Terminate(), 0);
}

// --head is repeatable, in both spellings, and each occurrence may be a comma list: every head
// named is loaded (Abseil alone would keep only the last occurrence).
TEST(ServerBinary, EveryHeadFlagLoadsAHead) {
  ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                        "--head=a:17:8", "--head", "b:19:8:float32:1,c:23:8", "-head=d:29:8"});
  ASSERT_GT(server.port(), 0) << server.log();
  auto stub = v1::HeadService::NewStub(
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::ListHeadsResponse list;
  ASSERT_TRUE(stub->ListHeads(&context, {}, &list).ok());
  std::map<std::string, int64_t> vocab;
  for (const v1::HeadInfo& h : list.heads()) vocab[h.head_id()] = h.vocab_size();
  EXPECT_EQ(vocab, (std::map<std::string, int64_t>{{"a", 17}, {"b", 19}, {"c", 23}, {"d", 29}}));
  EXPECT_EQ(server.Terminate(), 0);
}

TEST(ServerBinary, CheckpointDirConfinesTheFileRpcs) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("remotehead_binary_ckpt_" + std::to_string(getpid()));
  fs::create_directories(dir);
  {
    ServerProcess refused({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                           "--checkpoint_dir=" + (dir / "absent").string()});
    EXPECT_EQ(refused.ExitCode(), 2) << refused.log();
    EXPECT_NE(refused.log().find("--checkpoint_dir: checkpoint directory \"" +
                                 (dir / "absent").string() + "\": cannot open it"),
              std::string::npos)
        << refused.log();
  }
  for (const bool with_dir : {false, true}) {
    std::vector<std::string> argv = {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                                     "--device=cpu", "--head=lm:257:16:float32:3"};
    if (with_dir) argv.push_back("--checkpoint_dir=" + dir.string());
    ServerProcess server(argv);
    ASSERT_GT(server.port(), 0) << server.log();
    auto stub = v1::HeadService::NewStub(
        grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::SaveWeightsRequest save;
    save.set_head_id("lm");
    save.set_path("lm.safetensors");
    v1::SaveWeightsResponse saved;
    const grpc::Status status = stub->SaveWeights(&context, save, &saved);
    if (with_dir) {
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(saved.bytes_written(), static_cast<int64_t>(fs::file_size(dir / "lm.safetensors")));
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
      EXPECT_FALSE(fs::exists(dir / "lm.safetensors"));
    }
    EXPECT_EQ(server.Terminate(), 0) << server.log();
    EXPECT_NE(server.log().find(with_dir ? "checkpoints: read and written in " + dir.string()
                                         : std::string("checkpoints: no --checkpoint_dir")),
              std::string::npos)
        << server.log();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace remotehead
