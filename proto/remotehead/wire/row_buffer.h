// Buffers for the rows of a whole call (a step's dX on the client, its staging on the server):
// CPU tensors backed by transparent huge pages where the kernel lets a program ask for them.
// A fresh 128 MiB tensor written once costs 32,768 page faults with 4 KiB pages — on a virtual
// machine each takes locks and a memory-cgroup charge, and together they cost more CPU than the
// bytes' copy — and 64 with 2 MiB pages.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace remotehead::wire {

// An uninitialised contiguous CPU tensor of `sizes` and `dtype`. From 2 MiB up its memory is a
// mapping of its own, 2 MiB-aligned and advised MADV_HUGEPAGE (ignored where THP is off: then
// it is plain 4 KiB pages, as torch::empty's); below that, torch::empty. A mapping given back
// (the tensor freed) is kept for the next buffer of its size — up to 256 MiB of them per
// process, the least recently freed unmapped first — so that a loop of calls of one shape
// writes into memory already faulted in (its old bytes are not cleared: the tensor is
// uninitialised, as torch::empty's).
torch::Tensor EmptyRows(const std::vector<int64_t>& sizes, torch::ScalarType dtype);

}  // namespace remotehead::wire
