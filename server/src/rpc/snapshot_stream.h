// The server → client stream of a head snapshot's rows (ExportWeights, FetchGradients, a tied
// embedding's lookup): row chunks sized for the wire, with back-pressure through OnWriteDone.
#pragma once

#include <grpcpp/grpcpp.h>

#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/tensor_codec.h"
#include "service/head_requests.h"
#include "translate/protocol.h"

namespace remotehead::server {

// Streams a HeadSnapshot as row chunks — the matrix, then the vector (when `vector_field` is
// given) — and, when `info_field` is given, the HeadInfo last. One message is built per
// OnWriteDone, so only the snapshot is held. A failed snapshot finishes the call with its status.
template <typename Response>
class SnapshotStreamReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  using ChunkField = v1::TensorChunk* (Response::*)();
  using InfoField = v1::HeadInfo* (Response::*)();

  SnapshotStreamReactor(absl::StatusOr<HeadSnapshot> snapshot, int64_t chunk_bytes,
                        ChunkField matrix_field, ChunkField vector_field, InfoField info_field)
      : matrix_field_(matrix_field), vector_field_(vector_field), info_field_(info_field) {
    if (!snapshot.ok()) {
      this->Finish(ToGrpcStatus(snapshot.status()));
      return;
    }
    snapshot_ = *std::move(snapshot);
    const torch::Tensor& m = snapshot_.matrix;
    for (const wire::RowRange& r :
         wire::PlanRowChunks(m.size(0), m.size(1) * m.element_size(), chunk_bytes)) {
      pieces_.push_back({false, r});
    }
    if (snapshot_.vector.defined() && vector_field_ != nullptr) {
      const torch::Tensor& v = snapshot_.vector;
      for (const wire::RowRange& r :
           wire::PlanRowChunks(v.size(0), v.element_size(), chunk_bytes)) {
        pieces_.push_back({true, r});
      }
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      this->Finish(ToGrpcStatus(absl::CancelledError("the client stopped reading")));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  struct Piece {
    bool vector;
    wire::RowRange rows;
  };

  void WriteNext() {
    response_.Clear();
    if (next_ < pieces_.size()) {
      const Piece& p = pieces_[next_++];
      v1::TensorChunk* chunk = (response_.*(p.vector ? vector_field_ : matrix_field_))();
      chunk->set_row_offset(p.rows.offset);
      const torch::Tensor& source = p.vector ? snapshot_.vector : snapshot_.matrix;
      const absl::Status s = wire::EncodeTensor(source.narrow(0, p.rows.offset, p.rows.count),
                                                chunk->mutable_values());
      if (!s.ok()) {
        this->Finish(ToGrpcStatus(s));
        return;
      }
      this->StartWrite(&response_);
    } else if (info_field_ != nullptr && !info_sent_) {
      info_sent_ = true;
      const absl::Status s = ToWire(snapshot_.description, (response_.*info_field_)());
      if (!s.ok()) {
        this->Finish(ToGrpcStatus(s));
        return;
      }
      this->StartWriteAndFinish(&response_, {}, grpc::Status::OK);
    } else {
      this->Finish(grpc::Status::OK);
    }
  }

  ChunkField matrix_field_;
  ChunkField vector_field_;
  InfoField info_field_;
  HeadSnapshot snapshot_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool info_sent_ = false;
  Response response_;
};

}  // namespace remotehead::server
