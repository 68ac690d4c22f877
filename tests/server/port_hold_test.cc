// The ports a server is told to listen on are held from its start (rpc/port_hold.h): while held
// no other socket binds them; released, the server's own bind takes them; a port another socket
// already listens on stops the server at once, before a head group's rendezvous, naming the flag.
#include "rpc/port_hold.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "support/child_process.h"

namespace remotehead {
namespace {

// A socket (no SO_REUSEADDR) bound to 127.0.0.1:`port`, listening if `listen`; -1 if the bind
// failed.
int BindLoopback(int port, bool listen) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      (listen && ::listen(fd, 1) != 0)) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(PortHold, KeepsThePortUntilReleased) {
  const int port = testing::FreePort();
  absl::StatusOr<server::PortHold> hold =
      server::PortHold::Hold("127.0.0.1:" + std::to_string(port), "--listen");
  ASSERT_TRUE(hold.ok()) << hold.status();
  EXPECT_TRUE(hold->holds());
  EXPECT_EQ(BindLoopback(port, /*listen=*/false), -1) << "bound while held";
  hold->Release();
  EXPECT_FALSE(hold->holds());
  const int listener = BindLoopback(port, /*listen=*/true);
  EXPECT_GE(listener, 0) << "the port stayed taken after Release";
  close(listener);
}

TEST(PortHold, HoldsNothingForTheKernelsChoiceOrANonTcpAddress) {
  for (const std::string address : {"127.0.0.1:0", "unix:/tmp/remotehead.sock", "", "no-port"}) {
    absl::StatusOr<server::PortHold> hold = server::PortHold::Hold(address, "--listen");
    ASSERT_TRUE(hold.ok()) << address << ": " << hold.status();
    EXPECT_FALSE(hold->holds()) << address;
  }
}

TEST(PortHold, APortAnotherSocketListensOnIsRefusedNamingTheFlag) {
  const int listener = BindLoopback(testing::FreePort(), /*listen=*/true);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  socklen_t length = sizeof(addr);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &length), 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const absl::StatusOr<server::PortHold> hold =
      server::PortHold::Hold(address, "--metrics_address");
  close(listener);
  ASSERT_FALSE(hold.ok());
  EXPECT_EQ(hold.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(hold.status().message(),
            "--metrics_address: cannot listen on " + address + ": Address already in use");
}

// A head group's rank whose --listen port is taken stops before the group's rendezvous (it would
// otherwise join the group, with nobody there to answer it until the group's timeout, and then
// leave it at once): exit 1, the flag and the address named, no "joining" line.
TEST(ServerBinary, AListenPortInUseStopsARankBeforeItsGroupsRendezvous) {
  const int port = testing::FreePort();
  const int listener = BindLoopback(port, /*listen=*/true);
  ASSERT_GE(listener, 0);
  const std::string listen = "127.0.0.1:" + std::to_string(port);
  testing::ServerProcess rank({REMOTEHEAD_SERVER_BINARY, "--listen=" + listen, "--device=cpu",
                               "--head=lm:64:8", "--group_size=2", "--group_rank=1",
                               "--group_timeout_seconds=60",
                               "--group_store=127.0.0.1:" + std::to_string(testing::FreePort()),
                               "--group_secret_file=" + testing::GroupSecretFile()});
  EXPECT_EQ(rank.ExitCode(), 1) << rank.log();
  close(listener);
  EXPECT_NE(rank.log().find("--listen: cannot listen on " + listen), std::string::npos)
      << rank.log();
  EXPECT_EQ(rank.log().find("joining"), std::string::npos) << rank.log();
}

}  // namespace
}  // namespace remotehead
