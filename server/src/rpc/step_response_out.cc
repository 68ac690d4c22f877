#include "rpc/step_response_out.h"

#include <vector>

namespace remotehead::server {
namespace {

// The values field of a rows chunk, by the fields that lead to it from the response; the data
// lives in it.
std::vector<int> ValuesPath(const v1::StepResponse& message) {
  // A oneof member's case is its field number.
  const int part = static_cast<int>(message.part_case());
  const int values = message.part_case() == v1::StepResponse::kTokenExtra
                         ? static_cast<int>(v1::TokenExtraChunk::kValuesFieldNumber)
                         : static_cast<int>(v1::TensorChunk::kValuesFieldNumber);
  return {part, values};
}

v1::Tensor* Values(v1::StepResponse* message) {
  switch (message->part_case()) {
    case v1::StepResponse::kGradHidden:
      return message->mutable_grad_hidden()->mutable_values();
    case v1::StepResponse::kOutputs:
      return message->mutable_outputs()->mutable_values();
    case v1::StepResponse::kTokenIds:
      return message->mutable_token_ids()->mutable_values();
    case v1::StepResponse::kTokenExtra:
      return message->mutable_token_extra()->mutable_values();
    default:
      return nullptr;
  }
}

}  // namespace

std::shared_ptr<const wire::Frames> StepResponseOut::Frames() const {
  auto frames = std::make_shared<wire::Frames>();
  frames->AppendMessage(message);
  if (rows.defined()) {
    frames->AppendTensorData(ValuesPath(message), v1::Tensor::kDataFieldNumber, bytes,
                             wire::Holding(rows));
  }
  return frames;
}

int64_t StepResponseOut::ByteSize() const {
  return static_cast<int64_t>(message.ByteSizeLong() + bytes.size);
}

v1::StepResponse StepResponseOut::Whole() const {
  v1::StepResponse whole = message;
  if (v1::Tensor* values = Values(&whole); values != nullptr && bytes.size > 0) {
    values->set_data(bytes.data, bytes.size);
  }
  return whole;
}

}  // namespace remotehead::server
