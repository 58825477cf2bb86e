// Fused pack/unpack kernels: see pack_kernels.h for the chunk format.
//
// Grid: x = tile of a segment, y = block j of the chunk, z = row
// (layer * segments + segment). y and z stride over the grid so any chunk
// size fits the 65535 limit of those dimensions. Each CTA copies one tile of
// one segment; it takes the 16-byte (uint4) path when both its source and
// destination are 16-byte aligned and the segment is a multiple of 16 bytes,
// else a byte-wise loop. The choice is uniform per CTA, so no warp diverges.
#include "pack_kernels.h"

namespace fabric {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // uint4 loads in flight per thread
constexpr int64_t kVec = sizeof(uint4);
constexpr int64_t kTileBytes = kThreads * kUnroll * kVec;  // 16 KiB
constexpr int64_t kMaxGridYZ = 65535;

__device__ __forceinline__ void copy_tile_vec(const uint8_t* __restrict__ src,
                                              uint8_t* __restrict__ dst, int64_t nbytes) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const int64_t items = nbytes / kVec;
  uint4 regs[kUnroll];
  // NOTE: all loads before any store, so each thread keeps kUnroll 16-byte
  // reads in flight; one pass covers the whole tile.
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (i < items) regs[k] = s[i];
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (i < items) d[i] = regs[k];
  }
}

__device__ __forceinline__ void copy_tile_bytes(const uint8_t* __restrict__ src,
                                                uint8_t* __restrict__ dst, int64_t nbytes) {
  for (int64_t i = threadIdx.x; i < nbytes; i += kThreads) dst[i] = src[i];
}

template <CopyDirection kDirection>
__global__ void __launch_bounds__(kThreads)
    block_copy_kernel(const int64_t* __restrict__ row_bases,
                      const int64_t* __restrict__ row_strides,
                      const int64_t* __restrict__ block_ids, uint8_t* __restrict__ chunk,
                      int64_t num_rows, int64_t num_blocks, int64_t segment_bytes) {
  const int64_t tile_start = static_cast<int64_t>(blockIdx.x) * kTileBytes;
  const int64_t tile_bytes =
      segment_bytes - tile_start < kTileBytes ? segment_bytes - tile_start : kTileBytes;
  if (tile_bytes <= 0) return;
  for (int64_t row = blockIdx.z; row < num_rows; row += gridDim.z) {
    const int64_t base = row_bases[row];
    const int64_t stride = row_strides[row];
    for (int64_t j = blockIdx.y; j < num_blocks; j += gridDim.y) {
      uint8_t* cache = reinterpret_cast<uint8_t*>(base + block_ids[j] * stride) + tile_start;
      uint8_t* packed = chunk + (row * num_blocks + j) * segment_bytes + tile_start;
      const uint8_t* src = kDirection == CopyDirection::kPack ? cache : packed;
      uint8_t* dst = kDirection == CopyDirection::kPack ? packed : cache;
      const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                             static_cast<uintptr_t>(segment_bytes)) %
                            kVec) == 0;
      if (aligned) {
        copy_tile_vec(src, dst, tile_bytes);
      } else {
        copy_tile_bytes(src, dst, tile_bytes);
      }
    }
  }
}

}  // namespace

cudaError_t launch_block_copy(const int64_t* row_bases, const int64_t* row_strides,
                              const int64_t* block_ids, uint8_t* chunk, int64_t num_rows,
                              int64_t num_blocks, int64_t segment_bytes,
                              CopyDirection direction, cudaStream_t stream) {
  if (num_rows < 0 || num_blocks < 0 || segment_bytes < 0) return cudaErrorInvalidValue;
  if (num_rows == 0 || num_blocks == 0 || segment_bytes == 0) return cudaSuccess;
  const int64_t tiles = (segment_bytes + kTileBytes - 1) / kTileBytes;
  if (tiles > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tiles),
                  static_cast<unsigned>(num_blocks < kMaxGridYZ ? num_blocks : kMaxGridYZ),
                  static_cast<unsigned>(num_rows < kMaxGridYZ ? num_rows : kMaxGridYZ));
  if (direction == CopyDirection::kPack) {
    block_copy_kernel<CopyDirection::kPack><<<grid, kThreads, 0, stream>>>(
        row_bases, row_strides, block_ids, chunk, num_rows, num_blocks, segment_bytes);
  } else {
    block_copy_kernel<CopyDirection::kUnpack><<<grid, kThreads, 0, stream>>>(
        row_bases, row_strides, block_ids, chunk, num_rows, num_blocks, segment_bytes);
  }
  return cudaGetLastError();
}

}  // namespace fabric
