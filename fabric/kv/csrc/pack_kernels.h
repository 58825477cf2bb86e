// Fused pack/unpack of paged KV blocks <-> one contiguous chunk buffer.
//
// Plain CUDA C++ (no torch headers) so it builds with bare nvcc; the torch
// binding lives in pack_binding.cpp.
//
// A chunk of n blocks holds, for every row p = layer * segments + segment,
// the n block segments back to back (see fabric/kv/layout.py):
//
//   chunk offset of (row p, block j) = (p * n + j) * segment_bytes
//   cache address of (row p, block j) = row_bases[p] + block_ids[j] * row_strides[p]
//
//   chunk: | p0 b0 | p0 b1 | .. | p0 b(n-1) | p1 b0 | .. | p(rows-1) b(n-1) |
//
// One launch covers every row and block. All three tables live in device
// memory; addresses and strides are in bytes, so any element size works.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fabric {

enum class CopyDirection : int {
  kPack = 0,    // cache -> chunk
  kUnpack = 1,  // chunk -> cache
};

// Launch the copy of num_rows x num_blocks segments on `stream`.
// Returns the launch status (cudaSuccess, or the error of the launch itself;
// faults inside the kernel surface on the stream as usual).
cudaError_t launch_block_copy(const int64_t* row_bases, const int64_t* row_strides,
                              const int64_t* block_ids, uint8_t* chunk, int64_t num_rows,
                              int64_t num_blocks, int64_t segment_bytes,
                              CopyDirection direction, cudaStream_t stream);

}  // namespace fabric
