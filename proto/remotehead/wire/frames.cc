#include "remotehead/wire/frames.h"

#include <utility>

namespace remotehead::wire {

namespace {

constexpr uint32_t kLengthDelimited = 2;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void PutTag(int field, std::string* out) {
  PutVarint((static_cast<uint64_t>(field) << 3) | kLengthDelimited, out);
}

size_t TagSize(int field) { return VarintSize(static_cast<uint64_t>(field) << 3); }

// A length-delimited field of `length` bytes, whole.
size_t FieldSize(int field, size_t length) { return TagSize(field) + VarintSize(length) + length; }

}  // namespace

std::string Frames::Open(const std::vector<int>& outer, int field, size_t length) {
  // Lengths from the inside out: each enclosing field holds the next one whole.
  std::vector<size_t> lengths(outer.size() + 1);
  lengths.back() = length;
  for (size_t i = outer.size(); i-- > 0;) {
    const int inner = i + 1 < outer.size() ? outer[i + 1] : field;
    lengths[i] = FieldSize(inner, lengths[i + 1]);
  }
  std::string out;
  for (size_t i = 0; i < outer.size(); ++i) {
    PutTag(outer[i], &out);
    PutVarint(lengths[i], &out);
  }
  PutTag(field, &out);
  PutVarint(length, &out);
  return out;
}

void Frames::AppendMessage(const google::protobuf::MessageLite& message) {
  AppendOwned(message.SerializeAsString());
}

void Frames::AppendTensorData(const std::vector<int>& outer, int data_field, RowBytes bytes,
                              std::shared_ptr<const void> owner) {
  if (bytes.size == 0) return;  // an empty bytes field is no field
  AppendOwned(Open(outer, data_field, bytes.size));
  AppendExternal(bytes, std::move(owner));
}

void Frames::AppendMapTensor(const std::vector<int>& outer, int map_field, const std::string& key,
                             const v1::Tensor& head, RowBytes bytes,
                             std::shared_ptr<const void> owner) {
  constexpr int kKey = 1, kValue = 2;
  std::string value_head = head.SerializeAsString();
  const size_t data_size =
      bytes.size == 0 ? 0 : FieldSize(v1::Tensor::kDataFieldNumber, bytes.size);
  const size_t value_size = value_head.size() + data_size;
  const size_t entry_size = FieldSize(kKey, key.size()) + FieldSize(kValue, value_size);
  std::string framing = Open(outer, map_field, entry_size);
  PutTag(kKey, &framing);
  PutVarint(key.size(), &framing);
  framing += key;
  PutTag(kValue, &framing);
  PutVarint(value_size, &framing);
  framing += value_head;
  if (bytes.size > 0) {
    PutTag(v1::Tensor::kDataFieldNumber, &framing);
    PutVarint(bytes.size, &framing);
  }
  AppendOwned(std::move(framing));
  if (bytes.size > 0) AppendExternal(bytes, std::move(owner));
}

std::string Frames::Flatten() const {
  std::string out;
  out.reserve(size_);
  for (const Piece& p : pieces_) out.append(p.data, p.size);
  return out;
}

void Frames::AppendOwned(std::string bytes) {
  if (bytes.empty()) return;
  owned_.push_back(std::move(bytes));
  pieces_.push_back({owned_.back().data(), owned_.back().size()});
  size_ += owned_.back().size();
}

void Frames::AppendExternal(RowBytes bytes, std::shared_ptr<const void> owner) {
  pieces_.push_back({bytes.data, bytes.size});
  size_ += bytes.size;
  owners_.push_back(std::move(owner));
}

std::shared_ptr<const void> Holding(const torch::Tensor& t) {
  return std::make_shared<const torch::Tensor>(t);
}

namespace {

// A slice's hold on its frames: released when gRPC is done with the slice.
void ReleaseFrames(void* hold) { delete static_cast<std::shared_ptr<const Frames>*>(hold); }

}  // namespace

grpc::ByteBuffer ToByteBuffer(const std::shared_ptr<const Frames>& frames) {
  std::vector<grpc::Slice> slices;
  slices.reserve(frames->pieces().size());
  for (const Frames::Piece& piece : frames->pieces()) {
    slices.emplace_back(const_cast<char*>(piece.data), piece.size, ReleaseFrames,
                        new std::shared_ptr<const Frames>(frames));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

bool ReceivedPieces(grpc::ByteBuffer& buffer, std::vector<grpc::Slice>* slices,
                    std::vector<BytePiece>* pieces) {
  if (!buffer.Dump(slices).ok()) return false;
  pieces->clear();
  pieces->reserve(slices->size());
  for (const grpc::Slice& s : *slices) {
    pieces->push_back({reinterpret_cast<const char*>(s.begin()), s.size()});
  }
  return true;
}

}  // namespace remotehead::wire
