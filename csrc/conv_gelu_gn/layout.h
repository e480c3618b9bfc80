// SPDX-License-Identifier: BSD-3-Clause
// NCHW -> NHWC copy for the fused conv op's input (host glue: conv_gelu_gn_cuda.cpp; kernel:
// layout_kernels.cu). The ATen copy (x.contiguous(memory_format=torch.channels_last)) reaches ~1.95 TB/s
// on the H100 at L2#19's 2.1 GB input; this tiled transpose is the op's own, used in its forward and
// again in its backward (the conv's weight gradient needs the input in channels_last).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace gnext {
namespace layout {

// out (N, HxW, C) = in (N, C, HxW), elements of elem_bytes (2 or 4) bytes.
cudaError_t nchw_to_nhwc(const void* in, void* out, int64_t N, int64_t C, int64_t HxW, int elem_bytes,
                         cudaStream_t stream);

}  // namespace layout
}  // namespace gnext
