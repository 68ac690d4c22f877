// A serialized message's one large tensor found where its bytes lie — a StepRequest's
// rows.hidden, a StepResponse's dX chunk — so that the receiver copies them once, straight to
// where they are used (the server's staging buffer at their row offset, a client's dX buffer),
// instead of protobuf copying them into a string first.
//
// The message is walked, not parsed: every occurrence of each field on the path (protobuf merges
// a singular message field that occurs several times, and the clients' frames send a tensor's
// bytes as an occurrence of their own: frames.h) down to the Tensor's data field. What is not
// those bytes (row offset, dtype, shape, targets, weights, aux) is returned as a small message
// that parses as the original with that data field empty. Anything unusual — no such data, the
// field twice, a malformed field on the way, another field beside the outermost one (a oneof
// member in both messages walked: it would clear what came before it) — gives nullopt: the
// caller parses the message whole, as before, and names what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remotehead::wire {

// A serialized message as the pieces it arrived in (gRPC's slices).
struct BytePiece {
  const char* data = nullptr;
  size_t size = 0;
};

struct SplitTensor {
  std::string rest;        // the message without the tensor's data field (serialized)
  size_t data_offset = 0;  // where the data field's bytes start in the pieces, put together
  size_t data_size = 0;
};

// A message's one tensor data field: under the singular message fields `path` (field numbers,
// outermost first; every occurrence of each is walked), the bytes field `data_field`.
std::optional<SplitTensor> SplitTensorData(const std::vector<BytePiece>& pieces,
                                           const std::vector<int>& path, int data_field);
// A StepRequest's rows.hidden.data.
std::optional<SplitTensor> SplitHiddenData(const std::vector<BytePiece>& pieces);

// Copies `size` bytes at `offset` of the pieces (put together) to `to`.
void CopyBytes(const std::vector<BytePiece>& pieces, size_t offset, size_t size, char* to);

}  // namespace remotehead::wire
