// fold64 checksum of a chunk in device memory (see fold64.h for the definition).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fabric {

// Write fold64 of data[0, nbytes) to *out (device memory) on `stream`:
// zeroes *out, sums every word's term, then finishes in place. Asynchronous;
// returns the launch status.
cudaError_t launch_fold64(const uint8_t* data, int64_t nbytes, unsigned long long* out,
                          cudaStream_t stream);

}  // namespace fabric
