// The real remotehead-server process on loopback: it starts with a preloaded head, serves a
// ForwardBackward whose result equals the engine's, keeps serving after a bad request, and on
// SIGTERM drains and exits 0.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/tensor_codec.h"
#include "remotehead/v1/head_service.grpc.pb.h"

extern char** environ;

namespace remotehead {
namespace {

// Starts the binary with its stdout on a pipe; reads lines until it says which port it chose.
class ServerProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& args) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[512];
    while (fgets(line, sizeof(line), out_) != nullptr) {
      log_ += line;
      if (sscanf(line, "remotehead-server: listening on port %d", &port_) == 1) break;
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
  }
  // SIGTERM, then the exit status and the rest of the log.
  int Terminate() {
    kill(pid_, SIGTERM);
    char line[512];
    while (fgets(line, sizeof(line), out_) != nullptr) log_ += line;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  int port() const { return port_; }
  const std::string& log() const { return log_; }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
  std::string log_;
};

TEST(ServerBinary, ServesForwardBackwardAndDrainsOnSigterm) {
  ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                        "--head=lm:257:16:float32:3"});
  ASSERT_GT(server.port(), 0) << server.log();
  auto stub = v1::HeadService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials()));

  grpc::ClientContext describe_context;
  v1::HeadRef ref;
  ref.set_head_id("lm");
  v1::HeadInfo info;
  ASSERT_TRUE(stub->DescribeHead(&describe_context, ref, &info).ok());
  EXPECT_EQ(info.vocab_size(), 257);

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
    ASSERT_TRUE(server::EncodeTensor(batch.hidden, rows.mutable_rows()->mutable_hidden()).ok());
    ASSERT_TRUE(server::EncodeTensor(batch.targets, rows.mutable_rows()->mutable_targets()).ok());
    if (corrupt) rows.mutable_rows()->mutable_hidden()->set_dtype(v1::DTYPE_FLOAT64);
    stream->Write(rows);
    stream->WritesDone();
    v1::StepResponse response;
    double loss = NAN;
    torch::Tensor dx;
    while (stream->Read(&response)) {
      if (response.has_summary()) loss = response.summary().loss();
      if (response.has_grad_hidden()) {
        dx = *server::DecodeTensor(response.grad_hidden().values(), "dx");
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
    EXPECT_NEAR(loss, expected->loss, 1e-5 * std::abs(expected->loss));
    EXPECT_LE(reference::MaxAbsDiff(dx, expected->grad_hidden), 1e-6);
  }

  EXPECT_EQ(server.Terminate(), 0);
  EXPECT_NE(server.log().find("remotehead-server: stopped"), std::string::npos) << server.log();
}

}  // namespace
}  // namespace remotehead
