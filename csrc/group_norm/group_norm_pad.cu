// SPDX-License-Identifier: BSD-3-Clause
// The two-pass elementwise pass written into a padded output: out = F.pad(act(GroupNorm(x)), pad, mode), the
// input of a convolution whose padding is not its own (video VAEs' causal 3-D convolutions pad by replication).
// Every output element is computed from its source element (replicate: the clamped index; constant: the pad
// value outside x), so the normalized tensor is written once, halo included, and never read again.
// docs/decisions/padded-output.md.
#include <algorithm>

#include "group_norm_dispatch.cuh"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

namespace {

constexpr int kPadThreads = 256;
constexpr int kPadUnroll = 4;  // elements per thread and trip, loaded before any store

// Source index of padded index i along a dimension of size n with `lo` elements of padding before it:
// replicate clamps; constant gives -1 outside [0, n).
template <bool Replicate>
__device__ __forceinline__ int src_index(int i, int lo, int n) {
  const int s = i - lo;
  if constexpr (Replicate) return min(max(s, 0), n - 1);
  return (s < 0 || s >= n) ? -1 : s;
}

// grid = (CTAs per plane, min(planes, 65535)); a plane is one (n, c, padded d) of Hp x Wp outputs, walked flat so
// that a warp's stores are one contiguous run whatever the row length (rows of Wp are not 16-byte aligned).
template <typename T, int Pw, bool Replicate>
__global__ void __launch_bounds__(kPadThreads)
    affine_pad_kernel(const T* __restrict__ x, T* __restrict__ out, const float4* __restrict__ coef, PadShape s,
                      FastDivmod wp_div, PwArgs pw, float value) {
  pdl_wait();  // launch_dependent: coef is written
  const int64_t planes = s.NC * s.Dp;
  const uint32_t plane_len = static_cast<uint32_t>(s.Hp) * static_cast<uint32_t>(s.Wp);
  const uint32_t per_trip = kPadThreads * kPadUnroll;
  for (int64_t q = blockIdx.y; q < planes; q += gridDim.y) {
    const int64_t nc = q / s.Dp;
    const int d = src_index<Replicate>(static_cast<int>(q - nc * s.Dp), s.fd, static_cast<int>(s.D));
    T* op = out + q * plane_len;
    const T* xp = x + (nc * s.D + (d < 0 ? 0 : d)) * s.H * s.W;
    const float4 k = coef[nc];
    const float pc = pw_channel<false, Pw>(pw, nc % s.C);
    for (uint32_t f0 = blockIdx.x * per_trip + threadIdx.x; f0 < plane_len; f0 += gridDim.x * per_trip) {
      float v[kPadUnroll];
      bool inside[kPadUnroll];
#pragma unroll
      for (int u = 0; u < kPadUnroll; ++u) {
        const uint32_t f = f0 + u * kPadThreads;
        inside[u] = false;
        if (f < plane_len && d >= 0) {
          const uint32_t hp = wp_div.div(f), wp = f - hp * static_cast<uint32_t>(s.Wp);
          const int h = src_index<Replicate>(static_cast<int>(hp), s.ht, static_cast<int>(s.H));
          const int w = src_index<Replicate>(static_cast<int>(wp), s.wl, static_cast<int>(s.W));
          if (h >= 0 && w >= 0) {
            v[u] = to_float(xp[static_cast<int64_t>(h) * s.W + w]);
            inside[u] = true;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kPadUnroll; ++u) {
        const uint32_t f = f0 + u * kPadThreads;
        if (f < plane_len) op[f] = static_cast<T>(inside[u] ? pw_affine<false, Pw>(k, v[u], 0.f, pc) : value);
      }
    }
  }
}

}  // namespace

cudaError_t launch_affine_pad(ScalarKind t, const PadShape& s, const void* x, void* out, const float* coef,
                              const PwArgs& pw, bool replicate, float value, int sm_count, cudaStream_t stream) {
  const int64_t planes = s.NC * s.Dp, plane_len = s.Hp * s.Wp;
  if (planes <= 0 || plane_len <= 0) return cudaSuccess;
  if (plane_len >= (int64_t{1} << 31) || s.Wp >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if (pw_pre(pw.mode) != kPreNone || pw.residual != nullptr) return cudaErrorInvalidValue;
  const int64_t per_trip = kPadThreads * kPadUnroll;
  // One trip per thread where the grid stays within ~16 waves of 8 CTAs per SM; longer planes loop.
  const int64_t per_plane = (plane_len + per_trip - 1) / per_trip;
  const int64_t ys = std::min<int64_t>(planes, 65535);
  const int64_t cap = std::max<int64_t>(1, int64_t{16} * 8 * sm_count / ys);
  const dim3 grid(static_cast<unsigned>(std::min(per_plane, std::max<int64_t>(cap, 1))), static_cast<unsigned>(ys));
  const FastDivmod wp_div(static_cast<uint32_t>(s.Wp));
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    return with_pw(pw.mode, [&](auto pp) -> cudaError_t {
      constexpr int P = decltype(pp)::value;
      if constexpr (pw_pre(P) != kPreNone) {
        return cudaErrorInvalidValue;
      } else {
        auto go = [&](auto kernel) {
          return launch_dependent(kernel, grid, dim3(kPadThreads), 0, stream, static_cast<const T*>(x),
                                  static_cast<T*>(out), reinterpret_cast<const float4*>(coef), s, wp_div, pw, value);
        };
        return replicate ? go(affine_pad_kernel<T, P, true>) : go(affine_pad_kernel<T, P, false>);
      }
    });
  });
}

}  // namespace gn
}  // namespace gnext
