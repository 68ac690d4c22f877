#include "remotehead/wire/split_rows.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace remotehead::wire {
namespace {

// Protobuf's wire types, and the field numbers walked (head_service.proto).
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
constexpr int kRequestRows = 2, kRowsHidden = 2, kTensorData = 3;

// A forward-only reader over the pieces, at absolute offsets.
class Reader {
 public:
  explicit Reader(const std::vector<BytePiece>& pieces) : pieces_(pieces) {
    for (const BytePiece& p : pieces) total_ += p.size;
  }

  size_t pos() const { return pos_; }
  size_t total() const { return total_; }

  bool Varint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t byte = 0;
      if (!Byte(&byte)) return false;
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // Moves to absolute offset `to` (never backwards, never past the end).
  bool SeekTo(size_t to) {
    if (to < pos_ || to > total_) return false;
    size_t n = to - pos_;
    while (n > 0) {
      const size_t step = std::min(n, pieces_[piece_].size - in_piece_);
      n -= step;
      Advance(step);
    }
    return true;
  }

 private:
  bool Byte(uint8_t* byte) {
    if (pos_ >= total_) return false;
    while (in_piece_ == pieces_[piece_].size) NextPiece();
    *byte = static_cast<uint8_t>(pieces_[piece_].data[in_piece_]);
    Advance(1);
    return true;
  }
  void Advance(size_t n) {
    in_piece_ += n;
    pos_ += n;
    while (piece_ + 1 < pieces_.size() && in_piece_ == pieces_[piece_].size) NextPiece();
  }
  void NextPiece() {
    ++piece_;
    in_piece_ = 0;
  }

  const std::vector<BytePiece>& pieces_;
  size_t total_ = 0, pos_ = 0, piece_ = 0, in_piece_ = 0;
};

// One field: where its tag starts, its number and wire type, and for a length-delimited field
// where its body lies.
struct Field {
  size_t start = 0;
  int number = 0;
  int type = 0;
  size_t body = 0, end = 0;
};

// Reads the next field of a message ending at `end` and moves past it; false where the bytes
// are not a well-formed field (a group, a length past `end`).
bool NextField(Reader& in, size_t end, Field* f) {
  f->start = in.pos();
  uint64_t tag = 0;
  if (!in.Varint(&tag) || in.pos() > end) return false;
  f->number = static_cast<int>(tag >> 3);
  f->type = static_cast<int>(tag & 7);
  uint64_t value = 0;
  switch (f->type) {
    case kVarint:
      if (!in.Varint(&value)) return false;
      break;
    case kFixed64:
      if (!in.SeekTo(in.pos() + 8)) return false;
      break;
    case kFixed32:
      if (!in.SeekTo(in.pos() + 4)) return false;
      break;
    case kLengthDelimited:
      if (!in.Varint(&value) || value > end - std::min(end, in.pos())) return false;
      f->body = in.pos();
      f->end = in.pos() + value;
      return in.SeekTo(f->end);
    default:
      return false;
  }
  f->end = in.pos();
  return in.pos() <= end;
}

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void AppendLengthDelimited(int number, const std::string& body, std::string* out) {
  AppendVarint((static_cast<uint64_t>(number) << 3) | kLengthDelimited, out);
  AppendVarint(body.size(), out);
  out->append(body);
}

void AppendRange(const std::vector<BytePiece>& pieces, size_t from, size_t to, std::string* out) {
  const size_t at = out->size();
  out->resize(at + (to - from));
  CopyBytes(pieces, from, to - from, out->data() + at);
}

// Within [from, to) of `pieces`, the occurrences of field path[level] (all of them: protobuf
// merges a singular message field that occurs several times) down to the one field
// `data_field` of the innermost: `enclosing` gets the occurrence, per level, that holds it.
// False where the bytes are malformed or the field occurs twice.
bool FindData(const std::vector<BytePiece>& pieces, size_t from, size_t to,
              const std::vector<int>& path, size_t level, int data_field,
              std::vector<Field>* enclosing, std::optional<Field>* data) {
  Reader in(pieces);
  if (!in.SeekTo(from)) return false;
  Field f;
  while (in.pos() < to) {
    if (!NextField(in, to, &f)) return false;
    const int wanted = level < path.size() ? path[level] : data_field;
    // The outermost field is a oneof member in both messages walked (StepRequest.part,
    // StepResponse.part): another member between occurrences would clear what came before it.
    if (level == 0 && f.number != wanted) return false;
    if (f.number != wanted) continue;
    if (f.type != kLengthDelimited) return false;
    if (level == path.size()) {
      if (data->has_value()) return false;
      *data = f;
      continue;
    }
    const bool had = data->has_value();
    if (!FindData(pieces, f.body, f.end, path, level + 1, data_field, enclosing, data)) {
      return false;
    }
    if (!had && data->has_value()) (*enclosing)[level] = f;
  }
  return true;
}

}  // namespace

void CopyBytes(const std::vector<BytePiece>& pieces, size_t offset, size_t size, char* to) {
  for (const BytePiece& p : pieces) {
    if (size == 0) return;
    if (offset >= p.size) {
      offset -= p.size;
      continue;
    }
    const size_t n = std::min(size, p.size - offset);
    std::memcpy(to, p.data + offset, n);
    to += n;
    size -= n;
    offset = 0;
  }
}

std::optional<SplitTensor> SplitTensorData(const std::vector<BytePiece>& pieces,
                                           const std::vector<int>& path, int data_field) {
  if (path.empty()) return std::nullopt;
  size_t total = 0;
  for (const BytePiece& p : pieces) total += p.size;
  std::vector<Field> enclosing(path.size());
  std::optional<Field> data;
  if (!FindData(pieces, 0, total, path, 0, data_field, &enclosing, &data) || !data.has_value()) {
    return std::nullopt;
  }
  // The message again without the data field: each enclosing occurrence re-framed, inside out.
  std::string inner;
  AppendRange(pieces, enclosing.back().body, data->start, &inner);
  AppendRange(pieces, data->end, enclosing.back().end, &inner);
  for (size_t level = path.size() - 1; level-- > 0;) {
    std::string outer;
    AppendRange(pieces, enclosing[level].body, enclosing[level + 1].start, &outer);
    AppendLengthDelimited(path[level + 1], inner, &outer);
    AppendRange(pieces, enclosing[level + 1].end, enclosing[level].end, &outer);
    inner = std::move(outer);
  }
  SplitTensor split{.data_offset = data->body, .data_size = data->end - data->body};
  AppendRange(pieces, 0, enclosing.front().start, &split.rest);
  AppendLengthDelimited(path.front(), inner, &split.rest);
  AppendRange(pieces, enclosing.front().end, total, &split.rest);
  return split;
}

std::optional<SplitTensor> SplitHiddenData(const std::vector<BytePiece>& pieces) {
  return SplitTensorData(pieces, {kRequestRows, kRowsHidden}, kTensorData);
}

}  // namespace remotehead::wire
