// SPDX-License-Identifier: BSD-3-Clause
// Interface between the host glue of group_norm_act_logsumexp (group_norm_act_lse_cuda.cpp) and its
// kernels (group_norm_act_lse_kernels.cu). Plain types only, as in group_norm/group_norm_launch.h.
//
// The kernels walk pixels: CTA n*K + k takes pixels [k*chunk, (k+1)*chunk) of image n. Element (n, c, p)
// is at x[n*C*HxW + c*sC + p*sP] (NCHW: sC = HxW, sP = 1; channels_last: sC = 1, sP = C). Two kernels:
//  * lanes (tpp > 0; channels innermost, C % 8 == 0, C <= 256, 16-byte aligned): tpp lanes per pixel,
//    8 channels each; per-channel sums in registers;
//  * pixel (tpp == 0; any layout): a thread per pixel loops over the channels; per-channel sums through
//    warp shuffles.
// Per element:
//   v = x + shift[c],  y = rstd*gamma*(v - mean) + beta,  r = [residual] v + act(y).
// Phases:
//   kLseForward:   out[n, p] = logsumexp_c r (online max/sum, one pass over the channels)
//   kLseGradStats: with dr = grad[n, p] * exp(r - out[n, p]) and dy = dr * act'(y), per-channel sums
//                  (sum dy*(v - mean), sum dy) of the CTA's pixels -> partial float2 [(n*K + k)*C + c]
//                  (the layout of the GroupNorm backward finalize)
//   kLseGradInput: dx = [residual] dr + rstd*gamma*dy + c2*(v - mean) + c3 (coef from the finalize), and
//                  per-channel sums of dx -> partial float [(n*K + k)*C + c] (for grad input_bias) if non-null
// Per-channel sums are combined in a fixed order (no atomics): bitwise deterministic.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../group_norm/group_norm_launch.h"

namespace gnext {
namespace lse {

enum Phase : int { kLseForward = 0, kLseGradStats = 1, kLseGradInput = 2 };

constexpr int kLseThreads = 256;
constexpr int kLanesCpt = 8;  // lanes kernel: channels per thread (one or two 16-byte accesses)

struct LseArgs {
  int64_t N, C, G, HxW, sC, sP;
  int tpp;                // lanes kernel: lanes per pixel (a power of 2 <= 32, tpp * kLanesCpt >= C); 0: pixel kernel
  int act;                // ActKind (common/pointwise.h)
  bool residual;          // add v to act(y)
  gn::ScalarKind t;       // x, out, grad, dx
  const void* x;
  const float* shift;     // (C,) float32 or null
  const float* mean;      // (N, G)
  const float* rstd;      // (N, G)
  const float* gamma;     // (C,) float32 or null
  const float* beta;      // (C,) float32 or null
  void* out;              // forward: (N, HxW); backward: read
  const void* grad;       // backward: dL/dout (N, HxW)
  const float4* coef;     // kLseGradInput: (mean, c2, rstd*gamma, c3) per (n, c)
  float* partial;         // kLseGradStats (float2) / kLseGradInput (float, may be null)
  void* dx;               // kLseGradInput
  int64_t K, chunk;       // CTAs per image, pixels per CTA
  int threads;
  size_t smem;
};

// Shared memory of a launch with `threads` threads: the pixel kernel keeps the per-channel parameters
// (and coef) and per-warp sums there, the lanes kernel only per-pixel-slot sums.
inline size_t lse_smem_bytes(int phase, int64_t C, int threads, int tpp) {
  const size_t acc = phase == kLseGradStats ? 8 : phase == kLseGradInput ? 4 : 0;  // bytes per channel and row
  const size_t Cs = static_cast<size_t>(C);
  if (tpp > 0) return static_cast<size_t>(threads / tpp) * Cs * acc;
  return Cs * 16 * (phase == kLseGradInput ? 2 : 1) + static_cast<size_t>(threads / 32) * Cs * acc;
}

cudaError_t launch_lse(int phase, const LseArgs& a, cudaStream_t stream);

}  // namespace lse
}  // namespace gnext
