// A rows message in the two forms a server may receive it: built and serialized whole, and
// framed as the clients send it (wire::Frames: the message's head, then each tensor's bytes as
// a field of its own, referenced where they lie; an aux tensor as a whole map entry). For the
// tests of the frames, of the walk to hidden's bytes, and of the server's staging.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::testing {

struct RowsMessage {
  v1::StepRequest whole;
  wire::Frames framed;
};

// Rows [offset, offset + count) of `hidden`, `targets` and each aux tensor.
inline RowsMessage MakeRowsMessage(
    const torch::Tensor& hidden, const torch::Tensor& targets, int64_t offset, int64_t count,
    const std::vector<std::pair<std::string, torch::Tensor>>& aux = {}) {
  RowsMessage m;
  v1::StepRows* rows = m.whole.mutable_rows();
  rows->set_row_offset(offset);
  wire::EncodeRows(hidden, offset, count, rows->mutable_hidden());
  wire::EncodeRows(targets, offset, count, rows->mutable_targets());
  for (const auto& [name, tensor] : aux) {
    wire::EncodeRows(tensor, offset, count, &(*rows->mutable_aux())[name]);
  }
  v1::StepRequest head;
  head.mutable_rows()->set_row_offset(offset);
  const wire::RowBytes h =
      wire::EncodeRowsHead(hidden, offset, count, head.mutable_rows()->mutable_hidden());
  const wire::RowBytes t =
      wire::EncodeRowsHead(targets, offset, count, head.mutable_rows()->mutable_targets());
  m.framed.AppendMessage(head);
  m.framed.AppendTensorData({v1::StepRequest::kRowsFieldNumber, v1::StepRows::kHiddenFieldNumber},
                            v1::Tensor::kDataFieldNumber, h, wire::Holding(hidden));
  m.framed.AppendTensorData({v1::StepRequest::kRowsFieldNumber, v1::StepRows::kTargetsFieldNumber},
                            v1::Tensor::kDataFieldNumber, t, wire::Holding(targets));
  for (const auto& [name, tensor] : aux) {
    v1::Tensor aux_head;
    const wire::RowBytes a = wire::EncodeRowsHead(tensor, offset, count, &aux_head);
    m.framed.AppendMapTensor({v1::StepRequest::kRowsFieldNumber}, v1::StepRows::kAuxFieldNumber,
                             name, aux_head, a, wire::Holding(tensor));
  }
  return m;
}

}  // namespace remotehead::testing
