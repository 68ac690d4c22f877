#include "rpc/front_address.h"

#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "translate/group_commands.h"

namespace remotehead::server {
namespace {

constexpr char kHeadServicePrefix[] = "/remotehead.v1.HeadService/";

// The host of HOST:PORT ([v6]:PORT keeps its brackets); "" when there is none.
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return address;
  if (address.find(':') != colon && address.front() != '[') return address;  // bare IPv6
  return address.substr(0, colon);
}

bool IsWildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::";
}

class RefusingReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RefusingReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

class NotTheFrontService final : public grpc::CallbackGenericService {
 public:
  explicit NotTheFrontService(const HeadGroup* group) : group_(group) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    const std::string method = ctx->method();
    if (!absl::StartsWith(method, kHeadServicePrefix)) {
      return new RefusingReactor(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, ""));
    }
    const std::string front = group_->front_address();
    const absl::Status refused = core::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "this server is rank ", group_->rank(), " of a head group of ", group_->size(),
            ", which serves ", method, " only on its front (rank 0): ",
            front.empty() ? std::string("its address is not known here yet; retry shortly")
                          : absl::StrCat("dial ", front))),
        core::reason::kNotTheFront,
        {{"front", front}, {"rank", absl::StrCat(group_->rank())}, {"method", method}});
    return new RefusingReactor(ToGrpcStatus(refused));
  }

 private:
  const HeadGroup* group_;
};

}  // namespace

std::string FrontAddress(const std::string& given, int replica, const std::string& listen,
                         const std::string& store_host, int port) {
  if (!given.empty()) return absl::StrReplaceAll(given, {{"{replica}", absl::StrCat(replica)}});
  std::string host = HostOf(listen);
  if (IsWildcard(host)) host = store_host;
  if (absl::StrContains(host, ':') && host.front() != '[') host = absl::StrCat("[", host, "]");
  return absl::StrCat(host, ":", port);
}

std::string ProcessAddress(const std::string& listen, int port) {
  char name[256] = {};
  const std::string host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
  return FrontAddress("", 0, listen, host, port);
}

absl::Status AnnounceFront(HeadGroup& group, const std::string& address) {
  group.set_front_address(address);
  v1::GroupCommand command;
  command.mutable_front()->set_address(address);
  absl::StatusOr<HeadGroup::Lane> lane = group.Enter();
  if (!lane.ok()) return lane.status();
  return RunCommand(*lane, command, [] { return absl::OkStatus(); });
}

std::unique_ptr<grpc::CallbackGenericService> NewNotTheFrontService(const HeadGroup* group) {
  return std::make_unique<NotTheFrontService>(group);
}

}  // namespace remotehead::server
