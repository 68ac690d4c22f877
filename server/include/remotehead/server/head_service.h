// The gRPC HeadService (callback API): one reactor per streaming call, protocol handling only;
// every number is computed by core/ and every error mapped in status_mapping.
#pragma once

#include <memory>
#include <ostream>

#include "remotehead/server/admission.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/server/metrics.h"
#include "remotehead/v1/head_service.grpc.pb.h"

namespace remotehead::server {

class ComputePool;
class RetainedInputStore;
struct StepEnvironment;  // what streaming step calls share (head_service.cc)

struct ServiceOptions {
  torch::Device device = torch::kCPU;               // where new heads live
  int64_t response_chunk_bytes = int64_t{1} << 20;  // size of each streamed tensor chunk
  int compute_threads = 1;  // threads running the engine for streaming calls
  // Streaming calls: messages read ahead of the one being computed, and results buffered
  // before compute pauses for a slow reader. Together they bound a call's in-flight bytes.
  int read_ahead_messages = 4;
  int64_t max_pending_response_bytes = int64_t{16} << 20;
  AdmissionOptions admission;     // memory budget and request limits
  double max_retain_seconds = 600;  // cap on StepHeader.retain_inputs_seconds
  // One line per head lifecycle event (created, uploaded, dropped, saved, gradients zeroed,
  // optimizer step); nullptr = silent.
  std::ostream* event_log = nullptr;
  ServerMetrics* metrics = nullptr;  // Prometheus metrics; nullptr = none
};

class HeadServiceImpl final : public v1::HeadService::CallbackService {
 public:
  HeadServiceImpl(HeadRegistry* registry, ServiceOptions options);
  // Call after the grpc::Server has shut down (no call may still be running).
  ~HeadServiceImpl() override;

  AdmissionController& admission() { return *admission_; }

  grpc::ServerUnaryReactor* CreateHead(grpc::CallbackServerContext* context,
                                       const v1::CreateHeadRequest* request,
                                       v1::HeadInfo* response) override;
  grpc::ServerReadReactor<v1::UploadHeadRequest>* UploadHead(grpc::CallbackServerContext* context,
                                                             v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* SaveWeights(grpc::CallbackServerContext* context,
                                        const v1::SaveWeightsRequest* request,
                                        v1::SaveWeightsResponse* response) override;
  grpc::ServerUnaryReactor* DescribeHead(grpc::CallbackServerContext* context,
                                         const v1::HeadRef* request,
                                         v1::HeadInfo* response) override;
  grpc::ServerUnaryReactor* ListHeads(grpc::CallbackServerContext* context,
                                      const v1::ListHeadsRequest* request,
                                      v1::ListHeadsResponse* response) override;
  grpc::ServerUnaryReactor* DropHead(grpc::CallbackServerContext* context,
                                     const v1::HeadRef* request,
                                     v1::DropHeadResponse* response) override;
  grpc::ServerUnaryReactor* ZeroGradients(grpc::CallbackServerContext* context,
                                          const v1::HeadRef* request,
                                          v1::ZeroGradientsResponse* response) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* ForwardBackward(
      grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* Forward(
      grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* Backward(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* OptimizerStep(grpc::CallbackServerContext* context,
                                          const v1::OptimizerStepRequest* request,
                                          v1::OptimizerStepResponse* response) override;
  grpc::ServerWriteReactor<v1::ExportWeightsResponse>* ExportWeights(
      grpc::CallbackServerContext* context, const v1::ExportWeightsRequest* request) override;
  grpc::ServerWriteReactor<v1::FetchGradientsResponse>* FetchGradients(
      grpc::CallbackServerContext* context, const v1::FetchGradientsRequest* request) override;

 private:
  StepEnvironment StepEnv();

  HeadRegistry* registry_;
  ServiceOptions options_;
  std::unique_ptr<AdmissionController> admission_;
  std::unique_ptr<RetainedInputStore> retained_;
  std::unique_ptr<ComputePool> compute_;
};

}  // namespace remotehead::server
