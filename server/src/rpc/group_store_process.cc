#include "rpc/group_store_process.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <thread>

namespace remotehead::server {

int ServeGroupStore(const GroupConfig& config, const std::string& listen,
                    const std::shared_ptr<grpc::ServerCredentials>& credentials,
                    const std::atomic<int>& signal, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::unique_ptr<KeyValueStore>> store = ServeStore(config);
  if (!store.ok()) {
    err << "remotehead-server: --serve_group_store: " << store.status().message() << std::endl;
    return 2;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, credentials, &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    err << "remotehead-server: cannot listen on " << listen << std::endl;
    return 2;
  }
  // SERVING while the store answers: a probe of it (no key is ever read or written here).
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(true);
  out << "remotehead-server: serving the group's store on " << config.listen_host() << ":"
      << config.store_port << " (--group_store_external on every rank dials it)" << std::endl;
  out << "remotehead-server: listening on port " << port << " (health only)" << std::endl;
  bool serving = true;
  while (signal.load() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const bool answers = (*store)->Exists("probe").ok();
    if (answers != serving) health->SetServingStatus(answers);
    serving = answers;
  }
  health->SetServingStatus(false);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  out << "remotehead-server: the group's store stops (signal " << signal.load()
      << "): a mesh that uses it is down from now on" << std::endl;
  return 0;
}

}  // namespace remotehead::server
