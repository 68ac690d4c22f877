// One serialized message as a list of pieces: framing bytes it owns, and byte ranges of tensors
// it references where they lie (kept alive with it) — so that a tensor's rows reach the
// transport without being copied into a protobuf message and again into gRPC's buffer (the C++
// client sends its row messages so, client/cpp/src/step_frames.h; the server its dX chunks,
// server/src/rpc/step_reactor.cc).
//
// The pieces put together parse as the message: protobuf merges a singular message field that
// occurs twice, so a tensor's bytes may follow the rest of the message as a field of their own
// (AppendTensorData); a map entry is written whole (AppendMapTensor), since a repeated key
// replaces its value instead of merging.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/split_rows.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::wire {

class Frames {
 public:
  using Piece = BytePiece;

  // The bytes of `message`, serialized (owned).
  void AppendMessage(const google::protobuf::MessageLite& message);
  // Under the field path `outer` (field numbers, outermost first, each a singular message
  // field), the bytes field `data_field` holding `bytes`, which are referenced, not copied:
  // `owner` is kept alive with these frames.
  void AppendTensorData(const std::vector<int>& outer, int data_field, RowBytes bytes,
                        std::shared_ptr<const void> owner);
  // Under `outer`, one entry of the map<string, Tensor> field `map_field`: key `key`, value
  // `head` (dtype and shape) with `bytes` as its data (referenced; `owner` kept alive).
  void AppendMapTensor(const std::vector<int>& outer, int map_field, const std::string& key,
                       const v1::Tensor& head, RowBytes bytes, std::shared_ptr<const void> owner);

  const std::vector<Piece>& pieces() const { return pieces_; }
  size_t size() const { return size_; }
  // Every piece in one string (tests, and a transport that takes one buffer).
  std::string Flatten() const;

 private:
  void AppendOwned(std::string bytes);
  void AppendExternal(RowBytes bytes, std::shared_ptr<const void> owner);
  // Length-delimited field `field` of `length` bytes under `outer`: the framing of its start.
  static std::string Open(const std::vector<int>& outer, int field, size_t length);

  std::deque<std::string> owned_;  // a deque: the pieces point into its strings
  std::vector<Piece> pieces_;
  std::vector<std::shared_ptr<const void>> owners_;
  size_t size_ = 0;
};

// A tensor as the owner of bytes it holds (what Frames keeps alive).
std::shared_ptr<const void> Holding(const torch::Tensor& t);

// The frames as gRPC's buffer: one slice per piece, each holding the frames until gRPC is done
// with it (no byte copied).
grpc::ByteBuffer ToByteBuffer(const std::shared_ptr<const Frames>& frames);

// The other way: a received message's pieces as gRPC holds them (`slices` keeps them alive), for
// SplitTensorData; false where gRPC cannot give its slices (then parse the buffer whole).
bool ReceivedPieces(grpc::ByteBuffer& buffer, std::vector<grpc::Slice>* slices,
                    std::vector<BytePiece>* pieces);

}  // namespace remotehead::wire
