// fold64: the chunk checksum of pools in device memory (VRAM).
//
// xxh3 (the host pools' checksum) is a sequential hash; a GPU wants a sum.
// fold64 mixes every 64-bit little-endian word w_i of the chunk with its index
// i through splitmix64's finalizer, adds the results mod 2^64 (any order, so
// one atomic add per CTA is enough) and mixes the sum with the byte count:
//
//   word(i)  = bytes [8i, 8i + 8) as a little-endian uint64, the tail zero-padded
//   fold64   = finish(sum_i mix(word(i) ^ (i * kPos)), nbytes)
//
// mix is a bijection of its input, so a change to any one word always changes
// the sum; the index term makes moved or swapped words count.
// fabric/kv/fold64.py is the same definition in torch (any device); the two
// must agree bit for bit (tests/kv/test_fold64.py compiles this header on the
// host and compares).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FABRIC_HD __host__ __device__ __forceinline__
#else
#define FABRIC_HD inline
#endif

namespace fabric {

constexpr uint64_t kFoldPos = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kFoldMul1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kFoldMul2 = 0x94D049BB133111EBull;

FABRIC_HD uint64_t fold64_mix(uint64_t x) {
  x = (x ^ (x >> 30)) * kFoldMul1;
  x = (x ^ (x >> 27)) * kFoldMul2;
  return x ^ (x >> 31);
}

// The term word i adds to the sum.
FABRIC_HD uint64_t fold64_term(uint64_t word, uint64_t index) {
  return fold64_mix(word ^ (index * kFoldPos));
}

// The checksum from the sum of every word's term and the chunk's length.
FABRIC_HD uint64_t fold64_finish(uint64_t sum, uint64_t nbytes) {
  return fold64_mix(sum ^ fold64_mix(nbytes + kFoldPos));
}

}  // namespace fabric
