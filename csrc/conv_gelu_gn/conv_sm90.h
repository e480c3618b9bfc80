// Interface between the fused op's host glue (conv_gelu_gn_cuda.cpp) and its Hopper kernels
// (conv_sm90.cu, nvcc + CUTLASS). Plain types only, like group_norm/group_norm_launch.h.
//
// Stage 2 of the fused ConvTranspose2d + GELU + GroupNorm op, float32 with TF32 tensor cores (opt-in,
// GNEXT_CONV=cutlass: at L2#19 on the H100 it measured 6.0 ms forward against the cuDNN path's 5.7):
//  1. flip_filter: the transposed conv's weight (C_in, C_out, kH, kW) becomes the filter of the
//     equivalent stride-1 forward conv, (C_out, kH, kW, C_in), spatially flipped.
//  2. conv_stats: z = conv2d(x, filter, padding kH-1-p) as an implicit GEMM on Hopper tensor cores
//     (CUTLASS 3 TMA-im2col mainloop, NHWC, GEMM M = N*P*Q output pixels, N = C_out, K = kH*kW*C_in).
//     Its epilogue stores z (without the conv bias, like the ATen path) and, from the same registers,
//     reduces a = GELU(z + bias[c]) and a^2 over each 128-row tile: partial[t][c] = (sum a, sum a^2).
//  3. stats_finalize: per (n, g) mean and rstd from the partials of the tiles that lie inside image n;
//     the rows of the (at most two) tiles that straddle an image boundary are recomputed from z.
//     Also writes coef (n, c) = (mean, rstd * gamma[c], 0, beta[c]) for gnext's affine kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace gnext {
namespace conv_sm90 {

// True when this build contains the kernels (CUTLASS headers found and sm_90a compiled).
bool available();

#ifndef GNEXT_CONV_TILE_M
#define GNEXT_CONV_TILE_M 128
#endif
constexpr int kTileM = GNEXT_CONV_TILE_M;  // GEMM rows (output pixels) per CTA tile: one partial per tile and channel
constexpr int kTileN = 64;   // channels per CTA tile

struct ConvProblem {
  int N, H, W, C;    // input, NHWC
  int K, R, S;       // filter: K output channels, R x S taps (forward-conv filter, KRSC)
  int pad_h, pad_w;  // forward-conv padding (both sides)
  int P, Q;          // output height, width
};

inline int64_t num_tiles(const ConvProblem& p) { return (int64_t(p.N) * p.P * p.Q + kTileM - 1) / kTileM; }
inline int64_t padded_channels(const ConvProblem& p) { return (int64_t(p.K) + kTileN - 1) / kTileN * kTileN; }

// Problem sizes the conv kernel takes (alignment of channels, int32 coordinates, sizes); the caller
// also needs 16-byte aligned pointers.
bool supports(const ConvProblem& p);

// weight (C_in, C_out, R, S) of a transposed conv -> filter (C_out, R, S, C_in), flipped in R and S.
cudaError_t flip_filter(const float* weight, float* filter, int C_in, int C_out, int R, int S, cudaStream_t stream);

// z (N, P, Q, K) = conv(x, filter); partial_sum / partial_sq (num_tiles, padded_channels) per-tile
// sums of a = GELU(z + bias) and a^2 (gelu_kind: PreKind of common/pointwise.h; bias may be null).
// Returns cudaErrorNotSupported when the kernel cannot run the problem.
cudaError_t conv_stats(const ConvProblem& p, const float* x, const float* filter, const float* bias, int gelu_kind,
                       float* z, float* partial_sum, float* partial_sq, cudaStream_t stream);

// mean, rstd (N, G) and coef (N, K, 4) from the partials; gamma / beta float32 (K,) or null.
cudaError_t stats_finalize(const ConvProblem& p, int G, const float* partial_sum, const float* partial_sq,
                           const float* z, const float* bias, int gelu_kind, const float* gamma, const float* beta,
                           float eps, float* mean, float* rstd, float* coef, cudaStream_t stream);

}  // namespace conv_sm90
}  // namespace gnext
