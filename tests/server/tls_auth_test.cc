// TLS, mTLS and bearer-token auth of the real remotehead-server on loopback. A throwaway PKI (two
// CAs, a server certificate for 127.0.0.1/localhost, client certificates) is made with the
// openssl CLI in a temporary directory at the start of the suite.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_context.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <vector>

#include "core/reference.h"
#include "remotehead/server/rpc/credentials.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "remotehead/wire/tensor_codec.h"
#include "support/child_process.h"
#include "support/http_client.h"

namespace remotehead {
namespace {

namespace fs = std::filesystem;

constexpr char kToken[] = "rh-test-token-7f3a9c0e";
constexpr char kExpectedBearer[] =
    "authorization: expected a bearer token (call metadata \"authorization: Bearer <token>\" "
    "matching the server's --auth_token_file); got ";

// The binary with the preloaded test head and `args`.
class ServerProcess : public testing::ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> args)
      : testing::ServerProcess(WithDefaults(std::move(args))) {}

 private:
  static std::vector<std::string> WithDefaults(std::vector<std::string> args) {
    args.insert(args.begin(), {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                               "--head=lm:257:16:float32:3"});
    return args;
  }
};

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteText(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

class TlsAuthTest : public ::testing::Test {
 protected:
  // The PKI, made once for the suite.
  static void SetUpTestSuite() {
    char dir_template[] = "/tmp/remotehead-tls-XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    dir_ = dir_template;
    MakeCa("ca");
    MakeCa("other_ca");
    Issue("server", "ca", "127.0.0.1",
          "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n");
    Issue("client", "ca", "trainer-1", "extendedKeyUsage=clientAuth\n");
    Issue("rogue_client", "other_ca", "trainer-1", "extendedKeyUsage=clientAuth\n");
    WriteText(dir_ / "token", std::string(kToken) + "\n");
    WriteText(dir_ / "empty_token", "\n");
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static void OpenSsl(const std::string& args) {
    const std::string log = (dir_ / "openssl.log").string();
    const std::string command = "openssl " + args + " >" + log + " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << command << "\n" << ReadText(log);
  }
  static void MakeCa(const std::string& name) {
    OpenSsl("req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -keyout " +
            Path(name + ".key") + " -out " + Path(name + ".pem") + " -subj /CN=" + name +
            " -addext basicConstraints=critical,CA:TRUE"
            " -addext keyUsage=critical,keyCertSign,cRLSign");
  }
  static void Issue(const std::string& name, const std::string& ca, const std::string& cn,
                    const std::string& extensions) {
    WriteText(dir_ / (name + ".ext"), "basicConstraints=CA:FALSE\n" + extensions);
    OpenSsl("req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout " +
            Path(name + ".key") + " -out " + Path(name + ".csr") + " -subj /CN=" + cn);
    OpenSsl("x509 -req -days 2 -set_serial " + std::to_string(++serial_) + " -in " +
            Path(name + ".csr") + " -CA " + Path(ca + ".pem") + " -CAkey " + Path(ca + ".key") +
            " -extfile " + Path(name + ".ext") + " -out " + Path(name + ".pem"));
  }
  static std::string Path(const std::string& name) { return (dir_ / name).string(); }
  static std::string Pem(const std::string& name) { return ReadText(dir_ / name); }

  static std::shared_ptr<grpc::ChannelCredentials> Ssl(const std::string& ca,
                                                       const std::string& client = "") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = Pem(ca + ".pem");
    if (!client.empty()) {
      options.pem_private_key = Pem(client + ".key");
      options.pem_cert_chain = Pem(client + ".pem");
    }
    return grpc::SslCredentials(options);
  }
  static std::shared_ptr<grpc::ChannelCredentials> SslWithToken(const std::string& token) {
    return grpc::CompositeChannelCredentials(Ssl("ca"), grpc::AccessTokenCredentials(token));
  }
  static std::unique_ptr<v1::HeadService::Stub> Stub(
      const ServerProcess& server, const std::shared_ptr<grpc::ChannelCredentials>& creds) {
    return v1::HeadService::NewStub(grpc::CreateChannel(server.target(), creds));
  }

  static void SetDeadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  }
  // ListHeads: the preloaded head, or the call's status.
  static grpc::Status ListHeads(v1::HeadService::Stub* stub) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ListHeadsResponse response;
    const grpc::Status status = stub->ListHeads(&context, v1::ListHeadsRequest(), &response);
    if (status.ok()) {
      EXPECT_EQ(response.heads_size(), 1);
      if (response.heads_size() == 1) {
        EXPECT_EQ(response.heads(0).head_id(), "lm");
      }
    }
    return status;
  }
  // A small ForwardBackward; its status, with the summary and dX checked when OK.
  static grpc::Status ForwardBackward(v1::HeadService::Stub* stub) {
    auto head = core::Head::Initialize({.vocab_size = 257, .hidden_size = 16, .seed = 3}, {});
    EXPECT_TRUE(head.ok());
    const core::TokenBatch batch =
        reference::MakeTestBatch(**head, 8, "cross_entropy", core::Reduction::kSum);
    grpc::ClientContext context;
    SetDeadline(&context);
    auto stream = stub->ForwardBackward(&context);
    v1::StepRequest header;
    header.mutable_header()->set_head_id("lm");
    header.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_SUM);
    header.mutable_header()->set_rows(8);
    v1::StepRequest rows;
    EXPECT_TRUE(wire::EncodeTensor(batch.hidden, rows.mutable_rows()->mutable_hidden()).ok());
    EXPECT_TRUE(wire::EncodeTensor(batch.targets, rows.mutable_rows()->mutable_targets()).ok());
    if (stream->Write(header)) stream->Write(rows);
    stream->WritesDone();
    v1::StepResponse response;
    bool summary = false;
    int64_t dx_rows = 0;
    while (stream->Read(&response)) {
      summary |= response.has_summary();
      if (response.has_grad_hidden()) {
        dx_rows += wire::DecodeTensor(response.grad_hidden().values(), "dx")->size(0);
      }
    }
    const grpc::Status status = stream->Finish();
    if (status.ok()) {
      EXPECT_TRUE(summary);
      EXPECT_EQ(dx_rows, 8);
    }
    return status;
  }
  // grpc.health.v1.Health/Check for the whole server (empty request), through a generic stub;
  // on OK, expects SERVING (field 1 = 1).
  static grpc::Status HealthCheck(const ServerProcess& server,
                                  const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                  const std::string& method = "/grpc.health.v1.Health/Check") {
    grpc::GenericStub stub(grpc::CreateChannel(server.target(), creds));
    grpc::ClientContext context;
    SetDeadline(&context);
    grpc::ByteBuffer request(nullptr, 0);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status status = done.get_future().get();
    if (status.ok()) {
      std::vector<grpc::Slice> slices;
      EXPECT_TRUE(response.Dump(&slices).ok());
      std::string bytes;
      for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // status: SERVING
    }
    return status;
  }

  static inline fs::path dir_;
  static inline int serial_ = 0;
};

TEST_F(TlsAuthTest, TlsServesClientsThatTrustItsCaOnly) {
  ServerProcess server({"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key")});
  ASSERT_GT(server.port(), 0) << server.log();
  EXPECT_NE(server.log().find("remotehead-server: security: TLS (server certificate only), "
                              "bearer-token auth off"),
            std::string::npos)
      << server.log();

  EXPECT_TRUE(ListHeads(Stub(server, Ssl("ca")).get()).ok());
  EXPECT_TRUE(ForwardBackward(Stub(server, Ssl("ca")).get()).ok());
  EXPECT_TRUE(HealthCheck(server, Ssl("ca")).ok());
  // The certificate names localhost as well as 127.0.0.1.
  auto by_name = v1::HeadService::NewStub(
      grpc::CreateChannel("localhost:" + std::to_string(server.port()), Ssl("ca")));
  EXPECT_TRUE(ListHeads(by_name.get()).ok());

  // Plaintext against TLS: no connection.
  EXPECT_EQ(ListHeads(Stub(server, grpc::InsecureChannelCredentials()).get()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA refuses the server's certificate.
  EXPECT_EQ(ListHeads(Stub(server, Ssl("other_ca")).get()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsAuthTest, MutualTlsRequiresACertificateSignedByTheClientCa) {
  ServerProcess server({"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key"),
                        "--tls_client_ca=" + Path("ca.pem")});
  ASSERT_GT(server.port(), 0) << server.log();
  EXPECT_NE(server.log().find("remotehead-server: security: mTLS (client certificate required), "
                              "bearer-token auth off"),
            std::string::npos)
      << server.log();

  EXPECT_EQ(ListHeads(Stub(server, Ssl("ca")).get()).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ListHeads(Stub(server, Ssl("ca", "rogue_client")).get()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(ListHeads(Stub(server, Ssl("ca", "client")).get()).ok());
  EXPECT_TRUE(ForwardBackward(Stub(server, Ssl("ca", "client")).get()).ok());
}

TEST_F(TlsAuthTest, OptionalClientCertificateIsVerifiedWhenPresented) {
  ServerProcess server({"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key"),
                        "--tls_client_ca=" + Path("ca.pem"), "--tls_require_client_cert=false"});
  ASSERT_GT(server.port(), 0) << server.log();
  EXPECT_NE(server.log().find("mTLS (client certificate verified if presented)"), std::string::npos)
      << server.log();
  EXPECT_TRUE(ListHeads(Stub(server, Ssl("ca")).get()).ok());
  EXPECT_TRUE(ListHeads(Stub(server, Ssl("ca", "client")).get()).ok());
  EXPECT_EQ(ListHeads(Stub(server, Ssl("ca", "rogue_client")).get()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsAuthTest, BearerTokenIsRequiredOnEveryCallButHealthChecks) {
  ServerProcess server({"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key"),
                        "--auth_token_file=" + Path("token")});
  ASSERT_GT(server.port(), 0) << server.log();
  EXPECT_NE(server.log().find("remotehead-server: security: TLS (server certificate only), "
                              "bearer-token auth on (health checks exempt)"),
            std::string::npos)
      << server.log();

  // No token.
  grpc::Status status = ListHeads(Stub(server, Ssl("ca")).get());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status.error_message(), std::string(kExpectedBearer) + "none");
  // A wrong one, and one that differs only in its last character; neither is echoed.
  for (const std::string wrong : {"not-the-token", "rh-test-token-7f3a9c0f", "rh-test-token"}) {
    status = ListHeads(Stub(server, SslWithToken(wrong)).get());
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << wrong;
    EXPECT_EQ(status.error_message(), std::string(kExpectedBearer) + "a different token");
  }
  // Another scheme.
  {
    auto stub = Stub(server, Ssl("ca"));
    grpc::ClientContext context;
    SetDeadline(&context);
    context.AddMetadata("authorization", std::string("Basic ") + kToken);
    v1::ListHeadsResponse response;
    status = stub->ListHeads(&context, v1::ListHeadsRequest(), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(status.error_message(),
              std::string(kExpectedBearer) + "a value that is not \"Bearer <token>\"");
  }
  // The right token (the file's trailing newline is not part of it).
  EXPECT_TRUE(ListHeads(Stub(server, SslWithToken(kToken)).get()).ok());

  // A streaming RPC: refused without the token, served with it.
  status = ForwardBackward(Stub(server, Ssl("ca")).get());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status.error_message(), std::string(kExpectedBearer) + "none");
  status = ForwardBackward(Stub(server, SslWithToken(kToken)).get());
  EXPECT_TRUE(status.ok()) << status.error_message();

  // Health checks pass without a token (probes rarely have it); only that service is exempt.
  status = HealthCheck(server, Ssl("ca"));
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(HealthCheck(server, SslWithToken(kToken)).ok());
  status = HealthCheck(server, Ssl("ca"), "/grpc.health.v1.HealthX/Check");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  status = HealthCheck(server, Ssl("ca"),
                       "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);

  EXPECT_EQ(server.log().find(kToken), std::string::npos) << server.log();
}

TEST_F(TlsAuthTest, MutualTlsAndTokenTogether) {
  ServerProcess server({"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key"),
                        "--tls_client_ca=" + Path("ca.pem"), "--auth_token_file=" + Path("token")});
  ASSERT_GT(server.port(), 0) << server.log();
  EXPECT_NE(server.log().find("mTLS (client certificate required), bearer-token auth on"),
            std::string::npos)
      << server.log();
  EXPECT_EQ(ListHeads(Stub(server, Ssl("ca", "client")).get()).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ListHeads(Stub(server, grpc::CompositeChannelCredentials(
                                         Ssl("ca", "client"), grpc::AccessTokenCredentials(kToken)))
                            .get())
                  .ok());
  EXPECT_EQ(ListHeads(Stub(server, SslWithToken(kToken)).get()).error_code(),
            grpc::StatusCode::UNAVAILABLE);  // the token does not replace the certificate
}

struct BadFlags {
  std::vector<std::string> args;  // "@name" stands for the path of that file in the PKI dir
  std::string message;            // the whole line on stderr, paths substituted the same way
};

TEST_F(TlsAuthTest, BadSecurityFlagsStopTheServerWithAClearMessage) {
  const std::vector<BadFlags> cases = {
      {{"--auth_token_file=@token"},
       "--auth_token_file: expected --tls_cert and --tls_key as well (bearer tokens are not sent "
       "in plaintext; gRPC clients refuse to attach them to insecure channels); got no server "
       "certificate"},
      {{"--tls_cert=@missing.pem", "--tls_key=@server.key"},
       "--tls_cert: no such file: @missing.pem"},
      {{"--tls_cert=@server.pem", "--tls_key=@missing.key"},
       "--tls_key: no such file: @missing.key"},
      {{"--tls_cert=@server.pem"},
       "--tls_key: expected a PEM private key file with --tls_cert; got none"},
      {{"--tls_cert=@server.pem", "--tls_key=@client.key"},
       "--tls_key: expected the private key of the certificate in @server.pem; got a different key "
       "in @client.key"},
      {{"--tls_cert=@server.key", "--tls_key=@server.key"},
       "--tls_cert: expected a PEM certificate (\"-----BEGIN CERTIFICATE-----\") in @server.key; "
       "got none that parses"},
      {{"--tls_client_ca=@ca.pem"},
       "--tls_client_ca: expected --tls_cert and --tls_key as well (mTLS is TLS with client "
       "certificates); got no server certificate"},
      {{"--tls_cert=@server.pem", "--tls_key=@server.key", "--tls_client_ca=@missing_ca.pem"},
       "--tls_client_ca: no such file: @missing_ca.pem"},
      {{"--tls_cert=@server.pem", "--tls_key=@server.key", "--auth_token_file=@empty_token"},
       "--auth_token_file: expected one bearer token in @empty_token; got an empty file"},
      {{"--tls_cert=@server.pem", "--tls_key=@server.key", "--auth_token_file=@missing_token"},
       "--auth_token_file: no such file: @missing_token"},
  };
  const auto substitute = [](std::string s) {
    for (size_t at = s.find('@'); at != std::string::npos; at = s.find('@', at)) {
      s.replace(at, 1, dir_.string() + "/");
    }
    return s;
  };
  for (const BadFlags& c : cases) {
    std::vector<std::string> args;
    for (const auto& a : c.args) args.push_back(substitute(a));
    ServerProcess server(args);
    EXPECT_EQ(server.port(), 0);
    EXPECT_EQ(server.ExitCode(), 2) << server.log();
    EXPECT_EQ(server.log(), "remotehead-server: " + substitute(c.message) + "\n");
  }
}

// The metrics port (plain HTTP) next to TLS: with the token, /metrics needs it too; without one,
// only a loopback --metrics_address is accepted.
int MetricsPort(const std::string& log) {
  const size_t at = log.find("remotehead-server: metrics on port ");
  return at == std::string::npos ? 0 : std::atoi(log.c_str() + at + 35);
}

TEST_F(TlsAuthTest, MetricsNeedTheTokenWhenOneIsSet) {
  ServerProcess server({"--tls_cert=" + Path("server.pem"), "--tls_key=" + Path("server.key"),
                        "--auth_token_file=" + Path("token"), "--metrics_address=0.0.0.0:0"});
  ASSERT_GT(server.port(), 0) << server.log();
  const int port = MetricsPort(server.log());
  ASSERT_GT(port, 0) << server.log();
  EXPECT_NE(server.log().find("(/metrics, bearer token required)"), std::string::npos);
  for (const std::string& headers : {std::string(""), std::string("Authorization: Bearer x\r\n")}) {
    const testing::Response refused = testing::Get(port, "/metrics", headers);
    EXPECT_EQ(refused.status, 401) << refused.text;
    EXPECT_EQ(refused.text.find("remotehead_head"), std::string::npos) << refused.text;
  }
  const testing::Response served =
      testing::Get(port, "/metrics", std::string("Authorization: Bearer ") + kToken + "\r\n");
  EXPECT_EQ(served.status, 200) << served.text;
  EXPECT_NE(served.text.find("head=\"lm\""), std::string::npos) << served.text;
  EXPECT_EQ(server.log().find(kToken), std::string::npos) << server.log();
}

TEST_F(TlsAuthTest, MetricsStayOnLoopbackWithTlsAndNoToken) {
  const std::vector<std::string> tls = {"--tls_cert=" + Path("server.pem"),
                                        "--tls_key=" + Path("server.key")};
  {
    std::vector<std::string> args = tls;
    args.push_back("--metrics_address=0.0.0.0:0");
    ServerProcess server(args);
    EXPECT_EQ(server.port(), 0);
    EXPECT_EQ(server.ExitCode(), 2) << server.log();
    EXPECT_NE(server.log().find("remotehead-server: --metrics_address: expected a loopback "
                                "address (127.0.0.1:PORT) when TLS is on without "
                                "--auth_token_file"),
              std::string::npos)
        << server.log();
  }
  std::vector<std::string> args = tls;
  args.push_back("--metrics_address=127.0.0.1:0");
  ServerProcess server(args);
  ASSERT_GT(server.port(), 0) << server.log();
  const int port = MetricsPort(server.log());
  ASSERT_GT(port, 0) << server.log();
  EXPECT_EQ(testing::Get(port).status, 200);
}

// The processor alone: what gRPC hands it (the call's initial metadata, :path included).
TEST(BearerTokenProcessor, ChecksTheAuthorizationEntryAndExemptsHealth) {
  server::BearerTokenProcessor processor(kToken);
  EXPECT_FALSE(processor.IsBlocking());
  const std::string bearer = std::string("Bearer ") + kToken;
  const std::string lower = std::string("bearer ") + kToken;
  const auto process = [&](std::vector<std::pair<std::string, std::string>> entries,
                           grpc::AuthMetadataProcessor::OutputMetadata* consumed) {
    grpc::AuthMetadataProcessor::InputMetadata md;
    for (const auto& [k, v] : entries) md.emplace(k, v);
    grpc::AuthMetadataProcessor::OutputMetadata response;
    return processor.Process(md, nullptr, consumed, &response);
  };
  grpc::AuthMetadataProcessor::OutputMetadata consumed;
  const std::string list = "/remotehead.v1.HeadService/ListHeads";
  EXPECT_TRUE(process({{":path", list}, {"authorization", bearer}}, &consumed).ok());
  // Consumed, so handlers never see it.
  EXPECT_EQ(consumed.count("authorization"), 1u);
  consumed.clear();
  EXPECT_TRUE(process({{":path", list}, {"authorization", lower}}, &consumed).ok());
  EXPECT_EQ(process({{":path", list}}, &consumed).error_message(),
            std::string(kExpectedBearer) + "none");
  EXPECT_EQ(process({{":path", list}, {"authorization", bearer + "x"}}, &consumed).error_message(),
            std::string(kExpectedBearer) + "a different token");
  EXPECT_EQ(process({{":path", list}, {"authorization", "Bearer "}}, &consumed).error_message(),
            std::string(kExpectedBearer) + "a different token");
  EXPECT_EQ(process({{":path", list}, {"authorization", "Bearer"}}, &consumed).error_message(),
            std::string(kExpectedBearer) + "a value that is not \"Bearer <token>\"");
  EXPECT_EQ(
      process({{":path", list}, {"authorization", bearer}, {"authorization", bearer}}, &consumed)
          .error_message(),
      std::string(kExpectedBearer) + "more than one authorization entry");
  EXPECT_EQ(process({{":path", list}}, &consumed).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // Health is exempt; a look-alike service is not; no :path at all is not.
  EXPECT_TRUE(process({{":path", "/grpc.health.v1.Health/Check"}}, &consumed).ok());
  EXPECT_TRUE(process({{":path", "/grpc.health.v1.Health/Watch"}}, &consumed).ok());
  EXPECT_FALSE(process({{":path", "/grpc.health.v1.HealthX/Check"}}, &consumed).ok());
  EXPECT_FALSE(process({}, &consumed).ok());
}

TEST(BuildServerCredentials, StatusCodes) {
  EXPECT_TRUE(server::BuildServerCredentials({}).ok());
  EXPECT_EQ(server::BuildServerCredentials(
                {.cert_file = "/nonexistent/c.pem", .key_file = "/nonexistent/k.pem"})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(server::BuildServerCredentials({.token_file = "/nonexistent/token"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      server::BuildServerCredentials({.cert_file = "/tmp", .key_file = "/tmp"}).status().message(),
      "--tls_cert: expected a file; got a directory: /tmp");
  EXPECT_EQ(server::DescribeSecurityMode({}),
            "insecure (plaintext, no TLS), bearer-token auth off");
}

// Files the operator names by a flag (TLS files, the token, the group's secret) are read by one
// reader: a FIFO, a device or a directory is refused before it is opened (a start never
// blocks), as is a file over the size limit; each error names the flag and the path.
TEST(OperatorFiles, OnlyRegularFilesAreReadAndNothingBlocks) {
  const fs::path dir =
      fs::temp_directory_path() / ("rh_operator_files_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  struct Case {
    std::string path;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {fifo, absl::StatusCode::kInvalidArgument,
       "--auth_token_file: expected a regular file; got a FIFO, socket or device: " + fifo},
      {"/dev/zero", absl::StatusCode::kInvalidArgument,
       "--auth_token_file: expected a regular file; got a FIFO, socket or device: /dev/zero"},
      {dir.string(), absl::StatusCode::kInvalidArgument,
       "--auth_token_file: expected a file; got a directory: " + dir.string()},
      {(dir / "missing").string(), absl::StatusCode::kNotFound,
       "--auth_token_file: no such file: " + (dir / "missing").string()},
  };
  for (const Case& c : cases) {
    const auto token = server::ReadBearerToken(c.path);
    EXPECT_EQ(token.status().code(), c.code) << c.path;
    EXPECT_EQ(token.status().message(), c.message);
  }
  const std::string big = write("big", std::string(5000, 'x'));
  EXPECT_EQ(server::ReadOperatorFile("tls_cert", big, 4096).status().message(),
            "--tls_cert: expected at most 4096 bytes; got 5000: " + big);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));

  // The group's and the states' secrets: 16 to 4096 bytes once trimmed, through the same
  // reader, the errors naming the flag.
  for (const std::string flag : {"group_secret_file", "state_secret_file"}) {
    auto secret = server::ReadSecretFile(flag, write("good", "  0123456789abcdef0123\n"));
    ASSERT_TRUE(secret.ok()) << secret.status();
    EXPECT_EQ(*secret, "0123456789abcdef0123");
    for (const std::string& bad : {write("short", "tooshort\n"), big, fifo, dir.string()}) {
      const auto refused = server::ReadSecretFile(flag, bad);
      EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_TRUE(refused.status().message().rfind("--" + flag + ": expected", 0) == 0)
          << refused.status();
    }
    EXPECT_EQ(server::ReadSecretFile(flag, (dir / "missing").string()).status().code(),
              absl::StatusCode::kNotFound);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace remotehead
