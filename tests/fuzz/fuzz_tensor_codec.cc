// libFuzzer target: the wire codec (remotehead::wire, proto/remotehead/wire/tensor_codec.h) on
// tensors and streamed row chunks the fuzzer writes.
//
// Input: parts separated by fuzz_input.h's separator. Part 0: one control byte, then a
// serialized v1::Tensor for DecodeTensorView / DecodeTensor. Parts 1…: serialized
// v1::TensorChunks, added in order to a RowAssembler whose destination the control byte picks:
// dtype (ctl & 7, of the six wire dtypes), rows ((ctl >> 3) & 7), 3 columns, or 1-D when
// ctl & 0x40; conversion allowed when ctl & 0x80.
//
// The same chunks also go to a RowAssembler in any order (a striped step's results).
//
// Checked, beyond "no crash, no exception, no sanitizer report": a decoded tensor has exactly
// the wire's dtype, shape and bytes, the copy equals the view, and encoding it again gives the
// same message; neither assembler takes more rows than its destination has, the one in any
// order never takes a row twice, and CheckComplete agrees with the rows each took.
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::fuzz {
namespace {

constexpr size_t kMaxChunks = 32;
constexpr torch::ScalarType kDtypes[] = {torch::kFloat,  torch::kBFloat16, torch::kHalf,
                                         torch::kDouble, torch::kLong,     torch::kInt};

std::string Bytes(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

void CheckDecode(const v1::Tensor& wire) {
  auto view = wire::DecodeTensorView(wire, "t");
  auto copy = wire::DecodeTensor(wire, "t");
  if (view.ok() != copy.ok()) Fail("DecodeTensorView and DecodeTensor disagree on validity");
  if (!view.ok()) {
    if (view.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("a bad tensor is not INVALID_ARGUMENT: " + view.status().ToString());
    }
    return;
  }
  auto dtype = wire::FromWireDtype(wire.dtype(), "t");
  if (!dtype.ok() || view->scalar_type() != *dtype || copy->scalar_type() != *dtype) {
    Fail("decoded dtype differs from the wire's");
  }
  const std::vector<int64_t> shape(wire.shape().begin(), wire.shape().end());
  if (view->sizes().vec() != shape || copy->sizes().vec() != shape) {
    Fail("decoded shape differs from the wire's");
  }
  if (static_cast<size_t>(view->nbytes()) != wire.data().size() || Bytes(*view) != wire.data() ||
      Bytes(*copy) != wire.data()) {
    Fail("decoded bytes differ from the wire's");
  }
  v1::Tensor again;
  if (!wire::EncodeTensor(*copy, &again).ok()) Fail("a decoded tensor does not encode");
  // A 0-d tensor is written as shape [] like it came; an empty one keeps its shape.
  if (again.dtype() != wire.dtype() || again.data() != wire.data() ||
      std::vector<int64_t>(again.shape().begin(), again.shape().end()) != shape) {
    Fail("encode(decode(t)) != t");
  }
}

}  // namespace
}  // namespace remotehead::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace remotehead;
  using namespace remotehead::fuzz;
  std::vector<std::string> parts = SplitParts(data, size);
  if (parts.size() > kMaxChunks + 1) parts.resize(kMaxChunks + 1);
  if (parts[0].empty()) return 0;
  const uint8_t ctl = static_cast<uint8_t>(parts[0][0]);
  v1::Tensor tensor;
  if (tensor.ParseFromArray(parts[0].data() + 1, static_cast<int>(parts[0].size() - 1))) {
    CheckDecode(tensor);
  }

  const torch::ScalarType dtype = kDtypes[(ctl & 7) % 6];
  const int64_t rows = (ctl >> 3) & 7;
  const torch::Tensor dst =
      (ctl & 0x40) != 0 ? torch::zeros({rows}, dtype) : torch::zeros({rows, 3}, dtype);
  wire::RowAssembler assembler(dst, "rows", /*convert_dtype=*/(ctl & 0x80) != 0);
  wire::RowAssembler any_order(dst.clone(), "rows", (ctl & 0x80) != 0,
                               wire::RowAssembler::Order::kAnyOrder);
  std::vector<bool> taken(static_cast<size_t>(rows), false);
  for (size_t i = 1; i < parts.size(); ++i) {
    v1::TensorChunk chunk;
    if (!chunk.ParseFromString(parts[i])) continue;
    CheckDecode(chunk.values());
    const int64_t before = assembler.rows_received();
    const absl::Status s = assembler.Add(chunk);
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) {
      Fail("RowAssembler::Add: not INVALID_ARGUMENT: " + s.ToString());
    }
    if (!s.ok() && assembler.rows_received() != before) Fail("a refused chunk counted rows");
    if (assembler.rows_received() > rows) Fail("the assembler took more rows than it has");

    const int64_t any_before = any_order.rows_received();
    const absl::Status a = any_order.Add(chunk);
    if (!a.ok() && a.code() != absl::StatusCode::kInvalidArgument) {
      Fail("RowAssembler::Add (any order): not INVALID_ARGUMENT: " + a.ToString());
    }
    if (!a.ok()) {
      if (any_order.rows_received() != any_before) Fail("a refused chunk counted rows");
      continue;
    }
    const int64_t took = any_order.rows_received() - any_before;
    for (int64_t r = chunk.row_offset(); r < chunk.row_offset() + took; ++r) {
      if (r < 0 || r >= rows || taken[static_cast<size_t>(r)]) Fail("a row taken twice or outside");
      taken[static_cast<size_t>(r)] = true;
    }
  }
  if (any_order.CheckComplete().ok() != (any_order.rows_received() == rows)) {
    Fail("CheckComplete (any order) disagrees with the rows received");
  }
  if (assembler.CheckComplete().ok() != (assembler.rows_received() == rows)) {
    Fail("CheckComplete disagrees with the rows received");
  }
  if (!assembler.tensor().sizes().equals(dst.sizes()) ||
      assembler.tensor().scalar_type() != dtype) {
    Fail("the assembler's tensor changed shape or dtype");
  }
  return 0;
}
