// The client's transport options against an in-process server built with the server's own
// credentials (server/credentials.h): TLS with a private CA, a bearer token on top of it,
// mutual TLS. A throwaway PKI is made with the openssl CLI at the start of the suite.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "remotehead/client/client.h"
#include "remotehead/server/rpc/credentials.h"
#include "remotehead/server/rpc/head_service.h"

namespace remotehead {
namespace {

namespace fs = std::filesystem;
namespace rc = client;

constexpr char kToken[] = "client-test-token-31c9";

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class ClientTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char dir_template[] = "/tmp/remotehead-client-tls-XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    dir_ = dir_template;
    OpenSsl("req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -keyout " +
            Path("ca.key") + " -out " + Path("ca.pem") +
            " -subj /CN=ca -addext basicConstraints=critical,CA:TRUE"
            " -addext keyUsage=critical,keyCertSign,cRLSign");
    Issue("server", "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n");
    Issue("client", "extendedKeyUsage=clientAuth\n");
    std::ofstream(dir_ / "token") << kToken << "\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static void OpenSsl(const std::string& args) {
    const std::string command = "openssl " + args + " >" + Path("openssl.log") + " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << command << "\n" << ReadText(dir_ / "openssl.log");
  }
  static void Issue(const std::string& name, const std::string& extensions) {
    std::ofstream(dir_ / (name + ".ext")) << "basicConstraints=CA:FALSE\n" << extensions;
    OpenSsl("req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout " +
            Path(name + ".key") + " -out " + Path(name + ".csr") + " -subj /CN=" + name);
    OpenSsl("x509 -req -days 2 -set_serial " + std::to_string(++serial_) + " -in " +
            Path(name + ".csr") + " -CA " + Path("ca.pem") + " -CAkey " + Path("ca.key") +
            " -extfile " + Path(name + ".ext") + " -out " + Path(name + ".pem"));
  }
  static std::string Path(const std::string& name) { return (dir_ / name).string(); }

  // An in-process server with head "lm" and the given security options.
  void StartServer(server::TlsOptions tls) {
    auto credentials = server::BuildServerCredentials(tls);
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    auto head = core::Head::Initialize({.vocab_size = 64, .hidden_size = 8, .seed = 1}, {});
    ASSERT_TRUE(head.ok());
    ASSERT_TRUE(registry_.Add("lm", *std::move(head)).ok());
    service_ = server::HeadService::Create(&registry_, server::ServiceOptions{});
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port);
    builder.RegisterService(&service_->service());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
    service_.reset();
  }

  // A client of this server; the certificate names "localhost", not the IP we connect to.
  std::shared_ptr<rc::Client> MakeClient(rc::TlsOptions tls, const std::string& token = "") {
    tls.server_name_override = "localhost";
    auto client = rc::Client::Create(
        {.target = target_,
         .tls = tls,
         .bearer_token = token,
         .retry = {.max_attempts = 2, .initial_backoff = std::chrono::milliseconds(10)}});
    EXPECT_TRUE(client.ok()) << client.status();
    return *client;
  }

  // A ForwardBackward without dW: the whole streaming path over the secured channel.
  static absl::Status Step(rc::Client& client) {
    auto r = client.ForwardBackward(
        {.head_id = "lm", .accumulate_weight_grad = false},
        {.hidden = torch::randn({5, 8}), .targets = torch::randint(64, {5}, torch::kLong)});
    if (r.ok()) {
      EXPECT_EQ(r->grad_hidden.sizes(), (std::vector<int64_t>{5, 8}));
    }
    return r.status();
  }

  static inline fs::path dir_;
  static inline int serial_ = 0;
  server::HeadRegistry registry_;
  std::unique_ptr<server::HeadService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
};

TEST_F(ClientTlsTest, BearerTokenOverTls) {
  StartServer({.cert_file = Path("server.pem"),
               .key_file = Path("server.key"),
               .token_file = Path("token")});
  const rc::TlsOptions tls{.root_certs_pem = ReadText(dir_ / "ca.pem")};
  auto client = MakeClient(tls, kToken);
  EXPECT_TRUE(client->DescribeHead("lm").ok());
  EXPECT_TRUE(Step(*client).ok());

  // A wrong or missing token is refused by the server, and not retried.
  for (const std::string token : {"wrong-token", ""}) {
    SCOPED_TRACE(token);
    auto refused = MakeClient(tls, token);
    const absl::Status status = Step(*refused);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
    EXPECT_EQ(refused->stats().attempts, 1);
  }
}

TEST_F(ClientTlsTest, MutualTlsPresentsTheClientCertificate) {
  StartServer({.cert_file = Path("server.pem"),
               .key_file = Path("server.key"),
               .client_ca_file = Path("ca.pem")});
  auto client = MakeClient({.root_certs_pem = ReadText(dir_ / "ca.pem"),
                            .client_cert_pem = ReadText(dir_ / "client.pem"),
                            .client_key_pem = ReadText(dir_ / "client.key")});
  EXPECT_TRUE(Step(*client).ok());
  // Without a certificate the handshake fails (gRPC reports UNAVAILABLE).
  auto anonymous = MakeClient({.root_certs_pem = ReadText(dir_ / "ca.pem")});
  EXPECT_EQ(Step(*anonymous).code(), absl::StatusCode::kUnavailable);
}

TEST_F(ClientTlsTest, ServerNotSignedByTheTrustedRootIsRefused) {
  StartServer({.cert_file = Path("server.pem"), .key_file = Path("server.key")});
  // The server's own certificate is not a CA: nothing it serves chains to it.
  auto client = MakeClient({.root_certs_pem = ReadText(dir_ / "client.pem")});
  EXPECT_EQ(client->DescribeHead("lm").status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace remotehead
