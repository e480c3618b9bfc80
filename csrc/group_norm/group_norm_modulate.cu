// SPDX-License-Identifier: BSD-3-Clause
// The two-pass elementwise pass with a spatial modulation: out = act(GroupNorm(x) * scale + shift), scale and shift
// tensors of x's shape, or of smaller (h, w) read at each element's nearest-neighbour source (CogVideoX's spatially
// conditioned norm: both convolved from the latents, a pointwise convolution that commutes with nearest upsampling,
// so they can stay at the latents' resolution). One pass reads x, scale and shift and writes out; unfused, the
// normalized tensor, the product and the sum are each written and read again, and full-size scale and shift are
// written first.
#include <algorithm>
#include <cstdint>
#include <type_traits>

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
                           T* __restrict__ out, const float4* __restrict__ coef, int64_t rows, int64_t HxW,
                           OutRows o) {
  pdl_wait();  // launch_dependent: coef is written
  using Raw = typename Pack<T, V>::Raw;
  const int64_t per_trip = int64_t{kModThreads} * kModUnroll * V;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const float4 k = coef[row];
    const int64_t base = row * HxW;
    T* const orow = out + o.offset(row);
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
        float y[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
          y[j] = act_apply<A>(fmaf(channel_affine<false>(k, to_float(px.v[j]), 0.f), to_float(ps.v[j]),
                                   to_float(pb.v[j])));
        store_vec<T, V>(orow + e, y);
      }
    }
  }
}

// Low-resolution scale and shift, (D, h, w) per row against x's (D, H, W): the source of element (d, i, j) is
// (d, min(floor(i * sh), h - 1), min(floor(j * sw), w - 1)) with sh = h / H and sw = w / W in float, as
// F.interpolate(mode="nearest") computes it. Vectors of V elements lie within one W row (W a multiple of V); the
// plane D * H * W fits 32 bits (checked on the host), so the row and column come from 32-bit divisions.
template <typename T, int V, int A>
__global__ void __launch_bounds__(kModThreads)
    affine_modulate_up_kernel(const T* __restrict__ x, const T* __restrict__ scale, const T* __restrict__ shift,
                              T* __restrict__ out, const float4* __restrict__ coef, ModShape m, OutRows o) {
  pdl_wait();  // launch_dependent: coef is written
  using Raw = typename Pack<T, V>::Raw;
  const uint32_t plane = static_cast<uint32_t>(m.D * m.H * m.W), W = static_cast<uint32_t>(m.W),
                 H = static_cast<uint32_t>(m.H);
  const int h = static_cast<int>(m.h), w = static_cast<int>(m.w);
  const int64_t mplane = m.D * m.h * m.w;
  const uint32_t per_trip = uint32_t{kModThreads} * kModUnroll * V;
  for (int64_t row = blockIdx.y; row < m.rows; row += gridDim.y) {
    const float4 k = coef[row];
    const int64_t base = row * static_cast<int64_t>(plane);
    T* const orow = out + o.offset(row);
    const T* const srow = scale + row * mplane;
    const T* const brow = shift + row * mplane;
    for (uint32_t e0 = blockIdx.x * per_trip; e0 < plane; e0 += gridDim.x * per_trip) {
      // x's vectors are loaded first; scale and shift, a small tensor mostly served by L1 and L2, after.
      Raw xr[kModUnroll];
#pragma unroll
      for (int u = 0; u < kModUnroll; ++u) {
        const uint32_t e = e0 + (static_cast<uint32_t>(u) * kModThreads + threadIdx.x) * V;
        if (e < plane) xr[u] = ldg_raw(reinterpret_cast<const Raw*>(x + base + e));
      }
#pragma unroll
      for (int u = 0; u < kModUnroll; ++u) {
        const uint32_t e = e0 + (static_cast<uint32_t>(u) * kModThreads + threadIdx.x) * V;
        if (e >= plane) break;
        const uint32_t q = e / W, j0 = e - q * W, d = q / H, i = q - d * H;
        const int si = min(static_cast<int>(static_cast<float>(i) * m.sh), h - 1);
        const int64_t src = (static_cast<int64_t>(d) * h + si) * w;
        const int first = min(static_cast<int>(static_cast<float>(j0) * m.sw), w - 1);
        const int last = min(static_cast<int>(static_cast<float>(j0 + V - 1) * m.sw), w - 1);
        float sv[V], bv[V];
        if (first == last) {  // the vector's elements share one source (upsampling by V or more)
          const float a = to_float(srow[src + first]), c = to_float(brow[src + first]);
#pragma unroll
          for (int j = 0; j < V; ++j) sv[j] = a, bv[j] = c;
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const int sj = min(static_cast<int>(static_cast<float>(j0 + j) * m.sw), w - 1);
            sv[j] = to_float(srow[src + sj]);
            bv[j] = to_float(brow[src + sj]);
          }
        }
        Pack<T, V> px;
        px.raw = xr[u];
        float y[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
          y[j] = act_apply<A>(fmaf(channel_affine<false>(k, to_float(px.v[j]), 0.f), sv[j], bv[j]));
        store_vec<T, V>(orow + e, y);
      }
    }
  }
}

// The modulated passes' launch: a 2-D grid, CTAs per row of `plane` elements on x (one trip per thread while the
// grid stays within ~16 waves of 8 CTAs per SM; longer rows loop) and up to 65535 rows on y, and the dispatch over
// dtype, output activation and vector width (16-byte vectors where `aligned` and `extent` is a multiple of one).
// go(T{}, integral_constant<V>, integral_constant<A>, grid) launches the kernel.
template <typename Go>
cudaError_t launch_rows(ScalarKind t, int mode, int64_t rows, int64_t plane, bool aligned, int64_t extent,
                        int sm_count, Go go) {
  return with_scalar(t, [&](auto tt) {
    constexpr int VW = 16 / sizeof(decltype(tt));
    const bool wide = aligned && extent % VW == 0;
    const int64_t per_cta = int64_t{kModThreads} * kModUnroll * (wide ? VW : 1);
    const int64_t per_row = (plane + per_cta - 1) / per_cta;
    const int64_t ys = std::min<int64_t>(rows, 65535);
    const int64_t cap = std::max<int64_t>(1, int64_t{16} * 8 * sm_count / ys);
    const dim3 grid(static_cast<unsigned>(std::min(per_row, cap)), static_cast<unsigned>(ys));
    return with_pw(mode, [&](auto pp) -> cudaError_t {
      constexpr int P = decltype(pp)::value;
      if constexpr (pw_pre(P) != kPreNone) {
        return cudaErrorInvalidValue;
      } else {
        using Act = std::integral_constant<int, pw_act(P)>;
        return wide ? go(tt, std::integral_constant<int, VW>{}, Act{}, grid)
                    : go(tt, std::integral_constant<int, 1>{}, Act{}, grid);
      }
    });
  });
}

}  // namespace

cudaError_t launch_affine_modulate_up(ScalarKind t, const ModShape& m, const void* x, const void* scale,
                                      const void* shift, void* out, const OutRows& o, bool aligned,
                                      const float* coef, const PwArgs& pw, int sm_count, cudaStream_t stream) {
  if (m.rows <= 0 || m.D * m.H * m.W <= 0) return cudaSuccess;
  if (pw_pre(pw.mode) != kPreNone || pw.residual != nullptr || m.h <= 0 || m.w <= 0 ||
      m.D * m.H * m.W > int64_t{INT32_MAX} - 4096)
    return cudaErrorInvalidValue;
  // Only x and out are read and written in vectors (along W); the gathers are per element or per vector.
  return launch_rows(t, pw.mode, m.rows, m.D * m.H * m.W, aligned, m.W, sm_count,
                     [&](auto tt, auto v, auto a, dim3 grid) {
                       using T = decltype(tt);
                       return launch_dependent(affine_modulate_up_kernel<T, decltype(v)::value, decltype(a)::value>,
                                               grid, dim3(kModThreads), 0, stream, static_cast<const T*>(x),
                                               static_cast<const T*>(scale), static_cast<const T*>(shift),
                                               static_cast<T*>(out), reinterpret_cast<const float4*>(coef), m, o);
                     });
}

cudaError_t launch_affine_modulate(ScalarKind t, int64_t rows, int64_t HxW, const void* x, const void* scale,
                                   const void* shift, void* out, const OutRows& o, bool aligned, const float* coef,
                                   const PwArgs& pw, int sm_count, cudaStream_t stream) {
  if (rows <= 0 || HxW <= 0) return cudaSuccess;
  if (pw_pre(pw.mode) != kPreNone || pw.residual != nullptr) return cudaErrorInvalidValue;
  return launch_rows(t, pw.mode, rows, HxW, aligned, HxW, sm_count, [&](auto tt, auto v, auto a, dim3 grid) {
    using T = decltype(tt);
    return launch_dependent(affine_modulate_kernel<T, decltype(v)::value, decltype(a)::value>, grid,
                            dim3(kModThreads), 0, stream, static_cast<const T*>(x), static_cast<const T*>(scale),
                            static_cast<const T*>(shift), static_cast<T*>(out), reinterpret_cast<const float4*>(coef),
                            rows, HxW, o);
  });
}

}  // namespace gn
}  // namespace gnext
