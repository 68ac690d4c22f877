// Child processes for tests against real binaries: spawned with stdout and stderr on one pipe,
// their output read line by line (a test waits until they say they are ready), and killed when
// the test ends.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace remotehead::testing {

// A loopback TCP port that was free a moment ago (for a server that must be told its port, such
// as a head group's store), below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range): a port of that range may be taken, before the server
// binds it, by any connection's or listener's own port (a head group's Gloo pairs), the kernel's
// choice. The same rule as the Python client's local_server.free_port.
inline int FreePort() {
  int low = 0;
  if (FILE* range = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r"); range != nullptr) {
    if (fscanf(range, "%d", &low) != 1) low = 0;
    fclose(range);
  }
  std::random_device seed;
  std::mt19937 random(seed());
  for (int attempt = 0; attempt < (low > 2048 ? 1000 : 1); ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = low > 2048
                        ? htons(std::uniform_int_distribution<int>(std::max(1024, low - 12000),
                                                                   low - 1)(random))
                        : 0;  // not Linux: the kernel's choice
    const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    close(fd);
    if (bound) return ntohs(addr.sin_port);
  }
  return 0;
}

class ChildProcess {
 public:
  // Starts argv[0] and waits until `ready` returns true for a line of its output (or it exits).
  // A thread reads the output for the process's whole life: a pipe nobody reads fills (64 KiB)
  // and then blocks the process in its next log line, in the middle of whatever it was doing.
  ChildProcess(const std::vector<std::string>& argv,
               const std::function<bool(const std::string&)>& ready) {
    int fds[2];
    if (pipe(fds) != 0) {
      ended_ = true;
      return;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    reader_ = std::thread([this] { ReadOutput(); });
    WaitFor(ready);
  }
  // Waits for a line not yet seen by a WaitFor for which `ready` returns true (it becomes
  // ready_line()); false if the output ended first.
  bool WaitFor(const std::function<bool(const std::string&)>& ready) {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      while (seen_ < lines_.size()) {
        const std::string& line = lines_[seen_++];
        if (ready(line)) {
          ready_line_ = line;
          return true;
        }
      }
      if (ended_) return false;
      output_.wait(lock);
    }
  }
  ~ChildProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (reader_.joinable()) reader_.join();  // the pipe ends with the process
    if (out_ != nullptr) fclose(out_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Sends `signal` (unless it is 0), waits for the rest of the output and returns the exit
  // code, or -N if the process died of signal N.
  int Wait(int signal = 0) {
    if (pid_ <= 0) return -1;
    if (signal != 0) kill(pid_, signal);
    if (reader_.joinable()) reader_.join();
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  // Everything the process printed so far.
  std::string log() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string all;
    for (const std::string& line : lines_) all += line;
    return all;
  }
  // The line that made the process ready (empty if it never did).
  const std::string& ready_line() const { return ready_line_; }

 private:
  void ReadOutput() {
    char line[1024];
    while (out_ != nullptr && fgets(line, sizeof(line), out_) != nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(line);
      output_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    output_.notify_all();
  }

  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  std::thread reader_;
  mutable std::mutex mu_;
  std::condition_variable output_;
  std::vector<std::string> lines_;  // guarded by mu_: the output so far, as read
  size_t seen_ = 0;                 // lines_ a WaitFor has looked at
  bool ended_ = false;              // guarded by mu_: the output reached its end
  std::string ready_line_;
};

// remotehead-server on a loopback port of its choosing (it logs "listening on port N").
class ServerProcess : public ChildProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& argv)
      : ChildProcess(argv, [](const std::string& line) { return ParsePort(line) > 0; }) {}
  // SIGTERM: drain and exit.
  int Terminate() { return Wait(SIGTERM); }
  // For a server that refused to start: its exit code.
  int ExitCode() { return Wait(); }
  int port() const { return ParsePort(ready_line()); }
  std::string target() const { return "127.0.0.1:" + std::to_string(port()); }

  // The port of a "listening on port N" line (0 for any other line).
  static int ParsePort(const std::string& line) {
    int port = 0;
    return sscanf(line.c_str(), "remotehead-server: listening on port %d", &port) == 1 ? port : 0;
  }
};

// A file holding a head group's secret for the groups this test process starts (written once,
// readable by this user only).
inline std::string GroupSecretFile() {
  const std::string path = "/tmp/remotehead_group_secret_" + std::to_string(getpid());
  if (access(path.c_str(), R_OK) != 0) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const std::string secret = "test-group-secret-" + std::to_string(getpid()) + "-0123456789";
    if (fd >= 0) {
      if (write(fd, secret.data(), secret.size()) < 0) perror("GroupSecretFile");
      close(fd);
    }
  }
  return path;
}

// The ranks of a head group of remotehead-server processes on loopback: `argv` is every rank's
// command line, to which the group flags (size, rank, a store on a free port, the secret of
// GroupSecretFile) are added. Every
// rank is started before any is waited for (each waits for the others to join), then each is
// read until it listens (its ready_line()) or ends (its ready_line() then has no port).
inline std::vector<std::unique_ptr<ChildProcess>> StartHeadGroup(
    int size, const std::function<std::vector<std::string>(int rank)>& argv) {
  const std::string store = "--group_store=127.0.0.1:" + std::to_string(FreePort());
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int rank = 0; rank < size; ++rank) {
    std::vector<std::string> args = argv(rank);
    args.push_back("--group_size=" + std::to_string(size));
    args.push_back("--group_rank=" + std::to_string(rank));
    args.push_back(store);
    args.push_back("--group_secret_file=" + GroupSecretFile());
    ranks.push_back(std::make_unique<ChildProcess>(args, [](const std::string& line) {
      return line.find("joining head group") != std::string::npos ||
             line.find("joining a mesh") != std::string::npos;
    }));
  }
  for (auto& rank : ranks) {
    rank->WaitFor([](const std::string& line) { return ServerProcess::ParsePort(line) > 0; });
  }
  return ranks;
}

}  // namespace remotehead::testing
