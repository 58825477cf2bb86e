// Torch binding of the fused pack/unpack kernels (pack_kernels.cu).
//
//   pack(row_bases, row_strides, block_ids, chunk, segment_bytes, stream)
//   unpack(row_bases, row_strides, block_ids, chunk, segment_bytes, stream)
//   fold64(chunk, out, stream)     (checksum_kernels.cu: out = int64 CUDA tensor [1])
//
// row_bases / row_strides: int64 CUDA tensors [rows], byte addresses and block
// strides of each (layer, segment) row; block_ids: int64 CUDA tensor [n];
// chunk: contiguous uint8 CUDA tensor of at least rows * n * segment_bytes
// bytes; stream: the cudaStream_t as an integer (torch's `.cuda_stream`).
// The launch is asynchronous on that stream.
// NOTE: ATen + torch's pybind casters only, not <torch/extension.h>: the whole
// C++ frontend would triple the build time for no use here.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/cuda/CUDAGuard.h>

#include "checksum_kernels.h"
#include "pack_kernels.h"

namespace {

void check_table(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D tensor");
}

void copy_blocks(const at::Tensor& row_bases, const at::Tensor& row_strides,
                 const at::Tensor& block_ids, const at::Tensor& chunk,
                 int64_t segment_bytes, int64_t stream, fabric::CopyDirection direction) {
  check_table(row_bases, "row_bases");
  check_table(row_strides, "row_strides");
  check_table(block_ids, "block_ids");
  TORCH_CHECK(chunk.is_cuda(), "chunk must be a CUDA tensor");
  TORCH_CHECK(chunk.scalar_type() == at::kByte, "chunk must be uint8");
  TORCH_CHECK(chunk.dim() == 1 && chunk.is_contiguous(), "chunk must be contiguous 1-D");
  TORCH_CHECK(segment_bytes > 0, "segment_bytes must be > 0, got ", segment_bytes);
  TORCH_CHECK(row_bases.numel() == row_strides.numel(), "row_bases has ", row_bases.numel(),
              " rows but row_strides has ", row_strides.numel());
  for (const at::Tensor* t : {&row_strides, &block_ids, &row_bases}) {
    TORCH_CHECK(t->device() == chunk.device(), "all tensors must be on ", chunk.device());
  }
  const int64_t rows = row_bases.numel();
  const int64_t blocks = block_ids.numel();
  TORCH_CHECK(chunk.numel() >= rows * blocks * segment_bytes, "chunk holds ", chunk.numel(),
              " bytes, ", rows, " rows x ", blocks, " blocks x ", segment_bytes, " need more");
  const c10::cuda::CUDAGuard guard(chunk.device());
  const cudaError_t err = fabric::launch_block_copy(
      row_bases.data_ptr<int64_t>(), row_strides.data_ptr<int64_t>(),
      block_ids.data_ptr<int64_t>(), chunk.data_ptr<uint8_t>(), rows, blocks, segment_bytes,
      direction, reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "fabric block copy launch failed: ", cudaGetErrorString(err));
}

void pack(const at::Tensor& row_bases, const at::Tensor& row_strides,
          const at::Tensor& block_ids, const at::Tensor& chunk, int64_t segment_bytes,
          int64_t stream) {
  copy_blocks(row_bases, row_strides, block_ids, chunk, segment_bytes, stream,
              fabric::CopyDirection::kPack);
}

void unpack(const at::Tensor& row_bases, const at::Tensor& row_strides,
            const at::Tensor& block_ids, const at::Tensor& chunk, int64_t segment_bytes,
            int64_t stream) {
  copy_blocks(row_bases, row_strides, block_ids, chunk, segment_bytes, stream,
              fabric::CopyDirection::kUnpack);
}

void fold64(const at::Tensor& chunk, const at::Tensor& out, int64_t stream) {
  TORCH_CHECK(chunk.is_cuda(), "chunk must be a CUDA tensor");
  TORCH_CHECK(chunk.scalar_type() == at::kByte, "chunk must be uint8");
  TORCH_CHECK(chunk.dim() == 1 && chunk.is_contiguous(), "chunk must be contiguous 1-D");
  TORCH_CHECK(out.is_cuda() && out.device() == chunk.device(), "out must be on ", chunk.device());
  TORCH_CHECK(out.scalar_type() == at::kLong && out.numel() == 1 && out.is_contiguous(),
              "out must be one contiguous int64");
  const c10::cuda::CUDAGuard guard(chunk.device());
  const cudaError_t err = fabric::launch_fold64(
      chunk.data_ptr<uint8_t>(), chunk.numel(),
      reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()),
      reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "fabric fold64 launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fabric fused KV block pack/unpack (one launch for every layer)";
  m.def("pack", &pack, "cache blocks -> chunk", py::arg("row_bases"), py::arg("row_strides"),
        py::arg("block_ids"), py::arg("chunk"), py::arg("segment_bytes"), py::arg("stream"));
  m.def("unpack", &unpack, "chunk -> cache blocks", py::arg("row_bases"), py::arg("row_strides"),
        py::arg("block_ids"), py::arg("chunk"), py::arg("segment_bytes"), py::arg("stream"));
  m.def("fold64", &fold64, "fold64 checksum of chunk into out (see fold64.h)", py::arg("chunk"),
        py::arg("out"), py::arg("stream"));
}
