// fold64 on the device (definition in fold64.h): one pass over the chunk, a
// sum per CTA (warp shuffles, then shared memory), one atomic add per CTA.
#include "checksum_kernels.h"
#include "fold64.h"

namespace fabric {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ uint64_t load_word(const uint8_t* data, int64_t nbytes, int64_t i,
                                              bool aligned) {
  const int64_t start = i * 8;
  if (aligned && start + 8 <= nbytes) return reinterpret_cast<const uint64_t*>(data)[i];
  uint64_t word = 0;
  for (int k = 0; k < 8 && start + k < nbytes; ++k) {
    word |= static_cast<uint64_t>(data[start + k]) << (8 * k);
  }
  return word;
}

__global__ void __launch_bounds__(kThreads)
    fold64_kernel(const uint8_t* __restrict__ data, int64_t nbytes,
                  unsigned long long* __restrict__ sum) {
  const bool aligned = (reinterpret_cast<uintptr_t>(data) % 8) == 0;
  const int64_t words = (nbytes + 7) / 8;
  uint64_t acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    acc += fold64_term(load_word(data, nbytes, i, aligned), static_cast<uint64_t>(i));
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  __shared__ uint64_t warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warps[w];
    atomicAdd(sum, static_cast<unsigned long long>(total));
  }
}

__global__ void fold64_finish_kernel(unsigned long long* sum, int64_t nbytes) {
  *sum = fold64_finish(*sum, static_cast<uint64_t>(nbytes));
}

}  // namespace

cudaError_t launch_fold64(const uint8_t* data, int64_t nbytes, unsigned long long* out,
                          cudaStream_t stream) {
  if (nbytes < 0) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(out, 0, sizeof(unsigned long long), stream);
  if (err != cudaSuccess) return err;
  const int64_t words = (nbytes + 7) / 8;
  if (words > 0) {
    const int64_t wanted = (words + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
    fold64_kernel<<<blocks, kThreads, 0, stream>>>(data, nbytes, out);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  fold64_finish_kernel<<<1, 1, 0, stream>>>(out, nbytes);
  return cudaGetLastError();
}

}  // namespace fabric
