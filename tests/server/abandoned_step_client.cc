// A trainer that dies mid-step, for server_binary_test: it opens a ForwardBackward that
// accumulates dW under gradient id "killed/rank-0", sends the header and the first 16 of 64
// rows (their dX never comes: their batch waits for the rest), says so, and then waits to be
// killed.
//
//   abandoned-step-client 127.0.0.1:PORT
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "remotehead/v1/head_service.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: abandoned-step-client HOST:PORT" << std::endl;
    return 2;
  }
  namespace v1 = remotehead::v1;
  auto stub =
      v1::HeadService::NewStub(grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  auto stream = stub->ForwardBackward(&context);
  v1::StepRequest header;
  header.mutable_header()->set_head_id("lm");
  header.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_SUM);
  header.mutable_header()->set_rows(64);
  header.mutable_header()->set_accumulate_weight_grad(true);
  header.mutable_header()->mutable_gradient_id()->set_trainer("killed/rank-0");
  v1::StepRequest rows;
  rows.mutable_rows()->set_row_offset(0);
  v1::Tensor* hidden = rows.mutable_rows()->mutable_hidden();
  hidden->set_dtype(v1::DTYPE_FLOAT32);
  hidden->add_shape(16);
  hidden->add_shape(16);
  const float ones[16 * 16] = {1.0f};
  hidden->set_data(reinterpret_cast<const char*>(ones), sizeof(ones));
  v1::Tensor* targets = rows.mutable_rows()->mutable_targets();
  targets->set_dtype(v1::DTYPE_INT64);
  targets->add_shape(16);
  const int64_t labels[16] = {7};
  targets->set_data(reinterpret_cast<const char*>(labels), sizeof(labels));
  if (!stream->Write(header) || !stream->Write(rows)) {
    std::cerr << "abandoned-step-client: the stream failed: " << stream->Finish().error_message()
              << std::endl;
    return 1;
  }
  std::cout << "abandoned-step-client: streaming" << std::endl;
  std::this_thread::sleep_for(std::chrono::minutes(5));
  return 0;
}
