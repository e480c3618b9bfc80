// SPDX-License-Identifier: BSD-3-Clause
// The two-pass elementwise pass with a spatial modulation: out = act(GroupNorm(x) * scale + shift), scale and shift
// tensors of x's shape (CogVideoX's spatially conditioned norm: both convolved from the latents). One pass reads x,
// scale and shift and writes out; unfused, the normalized tensor, the product and the sum are each written and read
// again.
#include <algorithm>
#include <cstdint>

#include "group_norm_dispatch.cuh"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

namespace {

constexpr int kModThreads = 256;
constexpr int kModUnroll = 4;  // vectors per thread and trip, all loaded before any store

// grid = (CTAs per row, min(rows, 65535)); a row is one (n, c) of HxW contiguous elements, V of them per vector
// (HxW a multiple of V, every pointer aligned to V elements).
template <typename T, int V, int A>
__global__ void __launch_bounds__(kModThreads)
    affine_modulate_kernel(const T* __restrict__ x, const T* __restrict__ scale, const T* __restrict__ shift,
                           T* __restrict__ out, const float4* __restrict__ coef, int64_t rows, int64_t HxW) {
  pdl_wait();  // launch_dependent: coef is written
  using Raw = typename Pack<T, V>::Raw;
  const int64_t per_trip = int64_t{kModThreads} * kModUnroll * V;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const float4 k = coef[row];
    const int64_t base = row * HxW;
    for (int64_t e0 = blockIdx.x * per_trip; e0 < HxW; e0 += static_cast<int64_t>(gridDim.x) * per_trip) {
      Raw xr[kModUnroll], sr[kModUnroll], br[kModUnroll];
#pragma unroll
      for (int u = 0; u < kModUnroll; ++u) {
        const int64_t e = e0 + (static_cast<int64_t>(u) * kModThreads + threadIdx.x) * V;
        if (e < HxW) {
          xr[u] = ldg_raw(reinterpret_cast<const Raw*>(x + base + e));
          sr[u] = ldg_raw(reinterpret_cast<const Raw*>(scale + base + e));
          br[u] = ldg_raw(reinterpret_cast<const Raw*>(shift + base + e));
        }
      }
#pragma unroll
      for (int u = 0; u < kModUnroll; ++u) {
        const int64_t e = e0 + (static_cast<int64_t>(u) * kModThreads + threadIdx.x) * V;
        if (e >= HxW) break;
        Pack<T, V> px, ps, pb;
        px.raw = xr[u], ps.raw = sr[u], pb.raw = br[u];
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
          o[j] = act_apply<A>(fmaf(channel_affine<false>(k, to_float(px.v[j]), 0.f), to_float(ps.v[j]),
                                   to_float(pb.v[j])));
        store_vec<T, V>(out + base + e, o);
      }
    }
  }
}

}  // namespace

cudaError_t launch_affine_modulate(ScalarKind t, int64_t rows, int64_t HxW, const void* x, const void* scale,
                                   const void* shift, void* out, bool aligned, const float* coef, const PwArgs& pw,
                                   int sm_count, cudaStream_t stream) {
  if (rows <= 0 || HxW <= 0) return cudaSuccess;
  if (pw_pre(pw.mode) != kPreNone || pw.residual != nullptr) return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    constexpr int VW = 16 / sizeof(T);
    const bool wide = aligned && HxW % VW == 0;
    const int V = wide ? VW : 1;
    // One trip per thread while the grid stays within ~16 waves of 8 CTAs per SM; longer rows loop.
    const int64_t per_row = (HxW + int64_t{kModThreads} * kModUnroll * V - 1) / (int64_t{kModThreads} * kModUnroll * V);
    const int64_t ys = std::min<int64_t>(rows, 65535);
    const int64_t cap = std::max<int64_t>(1, int64_t{16} * 8 * sm_count / ys);
    const dim3 grid(static_cast<unsigned>(std::min(per_row, cap)), static_cast<unsigned>(ys));
    return with_pw(pw.mode, [&](auto pp) -> cudaError_t {
      constexpr int P = decltype(pp)::value;
      if constexpr (pw_pre(P) != kPreNone) {
        return cudaErrorInvalidValue;
      } else {
        constexpr int A = pw_act(P);
        auto go = [&](auto kernel) {
          return launch_dependent(kernel, grid, dim3(kModThreads), 0, stream, static_cast<const T*>(x),
                                  static_cast<const T*>(scale), static_cast<const T*>(shift), static_cast<T*>(out),
                                  reinterpret_cast<const float4*>(coef), rows, HxW);
        };
        return wide ? go(affine_modulate_kernel<T, VW, A>) : go(affine_modulate_kernel<T, 1, A>);
      }
    });
  });
}

}  // namespace gn
}  // namespace gnext
