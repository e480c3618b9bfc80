// SPDX-License-Identifier: BSD-3-Clause
// NCHW -> NHWC transpose (layout.h): per image, 32 x 32 tiles of (channel, pixel) through shared
// memory, both global sides coalesced (reads along pixels, writes along channels).
#include "layout.h"

namespace gnext {
namespace layout {

namespace {

constexpr int kTile = 32, kRows = 8;  // tile edge; threads per block: kTile x kRows

template <typename T>
__global__ void __launch_bounds__(kTile * kRows) nchw_to_nhwc_kernel(const T* __restrict__ in, T* __restrict__ out,
                                                                     int64_t C, int64_t HxW) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t n = blockIdx.z;
  const int64_t p0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  const T* src = in + n * C * HxW;
  T* dst = out + n * C * HxW;
#pragma unroll
  for (int i = threadIdx.y; i < kTile; i += kRows) {  // rows of the tile: channels c0 + i
    const int64_t c = c0 + i, p = p0 + threadIdx.x;
    if (c < C && p < HxW) tile[i][threadIdx.x] = src[c * HxW + p];
  }
  __syncthreads();
#pragma unroll
  for (int i = threadIdx.y; i < kTile; i += kRows) {  // rows of the output: pixels p0 + i
    const int64_t p = p0 + i, c = c0 + threadIdx.x;
    if (c < C && p < HxW) dst[p * C + c] = tile[threadIdx.x][i];
  }
}

}  // namespace

cudaError_t nchw_to_nhwc(const void* in, void* out, int64_t N, int64_t C, int64_t HxW, int elem_bytes,
                         cudaStream_t stream) {
  const int64_t gx = (HxW + kTile - 1) / kTile, gy = (C + kTile - 1) / kTile;
  if (N > 65535 || gy > 65535 || gx > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid{unsigned(gx), unsigned(gy), unsigned(N)}, block{unsigned(kTile), unsigned(kRows)};
  if (elem_bytes == 4)
    nchw_to_nhwc_kernel<uint32_t><<<grid, block, 0, stream>>>(static_cast<const uint32_t*>(in),
                                                              static_cast<uint32_t*>(out), C, HxW);
  else if (elem_bytes == 2)
    nchw_to_nhwc_kernel<uint16_t><<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(in),
                                                              static_cast<uint16_t*>(out), C, HxW);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace layout
}  // namespace gnext
