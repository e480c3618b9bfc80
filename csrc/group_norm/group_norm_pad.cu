// SPDX-License-Identifier: BSD-3-Clause
// The two-pass elementwise pass written into a padded output: out = F.pad(act(GroupNorm(x)), pad, mode), the
// input of a convolution whose padding is not its own (video VAEs' causal 3-D convolutions pad by replication).
// Every output element is computed from its source element (replicate: the clamped index; constant: the pad
// value outside x), so the normalized tensor is written once, halo included, and never read again.
// docs/decisions/padded-output.md.
#include <algorithm>
#include <cstdint>

#include "group_norm_dispatch.cuh"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

namespace {

constexpr int kPadThreads = 256;
constexpr int kPadUnroll = 4;  // elements per thread and trip, loaded before any store
constexpr int kPadRowsMinW = 256;  // rows of at least this many source elements take the row kernel

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

// Elements to the next 16-byte boundary from p (p is T-aligned), at most n.
template <typename T>
__device__ __forceinline__ int to_aligned16(const T* p, int n) {
  return min(n, static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / sizeof(T)));
}

// Writes o[0, n) = get(i) by one warp: the elements before o's first 16-byte boundary and after its last one one by
// one, the rest in 16-byte vectors (n <= 32 vectors + one of head and tail).
template <typename T, typename Get>
__device__ __forceinline__ void warp_store_run(T* __restrict__ o, int n, int lane, Get&& get) {
  constexpr int V = 16 / sizeof(T);
  const int head = to_aligned16(o, n), nv = (n - head) / V, tail = head + nv * V;
  if (lane < head) o[lane] = get(lane);
  for (int vi = lane; vi < nv; vi += 32) {
    Pack<T, V> pk;
#pragma unroll
    for (int j = 0; j < V; ++j) pk.v[j] = get(head + vi * V + j);
    stg_raw(reinterpret_cast<typename Pack<T, V>::Raw*>(o + head + vi * V), pk.raw);
  }
  if (tail + lane < n) o[tail + lane] = get(tail + lane);
}

// The 16 bytes from element `off` (0 <= off < 16 / sizeof(T)) of the 32-byte window lo ++ hi: a shift by whole
// 32-bit words, then (2-byte T, odd off) by one element across each pair of words.
template <int Q>
__device__ __forceinline__ uint4 shift_words(const uint32_t (&w)[8], bool half_word) {
  uint32_t o[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) o[k] = half_word ? __byte_perm(w[k + Q], w[k + Q + 1], 0x5432) : w[k + Q];
  return make_uint4(o[0], o[1], o[2], o[3]);
}
template <typename T>
__device__ __forceinline__ uint4 window16(const uint4& lo, const uint4& hi, int off) {
  constexpr int kPerWord = 4 / sizeof(T);
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const bool half_word = kPerWord == 2 && (off & 1);
  switch (off / kPerWord) {
    case 0: return shift_words<0>(w, half_word);
    case 1: return shift_words<1>(w, half_word);
    case 2: return shift_words<2>(w, half_word);
    default: return shift_words<3>(w, half_word);
  }
}

// One warp per R consecutive output rows (n, c, padded d, padded h) of Wp elements each, for rows of at least 32
// elements: each source row is read in 16-byte vectors (after its first unaligned elements), normalized into a
// per-warp stage in shared memory (16-byte stores), and written shifted by the left padding: from the output's first
// 16-byte boundary, each output vector is two stage vectors shifted in registers (window16), one 16-byte load and
// store each instead of one per element. The R rows' loads of a segment are all in flight before any of their
// stores: a warp's chain (load, stage, store) otherwise leaves one 16-byte load per lane in flight. The flat kernel
// above moves 2-byte elements one per thread and request.
template <typename T, int Pw, bool Replicate, int R>
__global__ void __launch_bounds__(kPadThreads)
    affine_pad_rows_kernel(const T* __restrict__ x, T* __restrict__ out, const float4* __restrict__ coef, PadShape s,
                           PwArgs pw, float value) {
  pdl_wait();  // launch_dependent: coef is written
  constexpr int V = 16 / sizeof(T), S = 32 * V, kWarps = kPadThreads / 32;
  using Raw = typename Pack<T, V>::Raw;
  __shared__ __align__(16) T stage[kWarps][R][S];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = static_cast<int>(s.W), Wp = static_cast<int>(s.Wp), wl = s.wl, wr = Wp - wl - W;
  const T cval = static_cast<T>(value);
  const int64_t rows = s.NC * s.Dp * s.Hp;
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * R; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.x) * kWarps * R) {
    const T* xrow[R];
    float4 k[R];
    float pc[R];
    int a0[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t r = r0 + j;
      xrow[j] = nullptr;
      a0[j] = 0;
      if (r >= rows) continue;
      const int64_t q = r / s.Hp, nc = q / s.Dp;
      const int h = src_index<Replicate>(static_cast<int>(r - q * s.Hp), s.ht, static_cast<int>(s.H));
      const int d = src_index<Replicate>(static_cast<int>(q - nc * s.Dp), s.fd, static_cast<int>(s.D));
      T* orow = out + r * s.Wp;
      if (d < 0 || h < 0) {  // constant padding: a row of the pad value
        warp_store_run(orow, Wp, lane, [&](int) { return cval; });
        continue;
      }
      xrow[j] = x + ((nc * s.D + d) * s.H + h) * s.W;
      k[j] = coef[nc];
      pc[j] = pw_channel<false, Pw>(pw, nc % s.C);
      auto f = [&](T v) { return static_cast<T>(pw_affine<false, Pw>(k[j], to_float(v), 0.f, pc[j])); };
      // The halo: copies of the row's first and last elements, or the pad value; then the source elements before
      // its first 16-byte boundary.
      for (int i = lane; i < wl + wr; i += 32) {
        const bool left = i < wl;
        orow[left ? i : W + i] = Replicate ? f(xrow[j][left ? 0 : W - 1]) : cval;
      }
      a0[j] = to_aligned16(xrow[j], W);
      if (lane < a0[j]) orow[wl + lane] = f(xrow[j][lane]);
    }
    // Segments of S elements from each row's first 16-byte boundary: every row's vector in flight, then the stores.
    for (int s0 = 0; s0 < W; s0 += S) {
      Raw raw[R];
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int e0 = a0[j] + s0 + lane * V;
        if (xrow[j] != nullptr && e0 + V <= W) raw[j] = ldg_raw(reinterpret_cast<const Raw*>(xrow[j] + e0));
      }
#pragma unroll
      for (int j = 0; j < R; ++j) {
        if (xrow[j] == nullptr || a0[j] + s0 >= W) continue;
        auto f = [&](T v) { return static_cast<T>(pw_affine<false, Pw>(k[j], to_float(v), 0.f, pc[j])); };
        const int n = min(S, W - a0[j] - s0), e0 = lane * V;
        T* st = stage[warp][j];
        if (e0 + V <= n) {
          Pack<T, V> pk;
          pk.raw = raw[j];
#pragma unroll
          for (int i = 0; i < V; ++i) pk.v[i] = f(pk.v[i]);
          *reinterpret_cast<Raw*>(st + e0) = pk.raw;
        } else {
          for (int i = 0; e0 + i < n; ++i) st[e0 + i] = f(xrow[j][a0[j] + s0 + e0 + i]);
        }
        __syncwarp();
        // Written from the output's first 16-byte boundary: `head` elements one by one, then each output vector
        // from two stage vectors (shifted by head), then the tail one by one.
        T* o = out + (r0 + j) * s.Wp + wl + a0[j] + s0;
        const int head = to_aligned16(o, n), nv = (n - head) / V, tail = head + nv * V;
        if (lane < head) o[lane] = st[lane];
        if (lane < nv) {
          const Raw* sv = reinterpret_cast<const Raw*>(st) + lane;
          const Raw v = head == 0 ? sv[0] : window16<T>(sv[0], sv[1], head);
          stg_raw(reinterpret_cast<Raw*>(o + head) + lane, v);
        }
        if (tail + lane < n) o[tail + lane] = st[tail + lane];
      }
      __syncwarp();
    }
  }
}

}  // namespace

cudaError_t launch_affine_pad(ScalarKind t, const PadShape& s, const void* x, void* out, const float* coef,
                              const PwArgs& pw, bool replicate, float value, int rows_per_warp, int sm_count,
                              cudaStream_t stream) {
  const int64_t planes = s.NC * s.Dp, plane_len = s.Hp * s.Wp;
  if (planes <= 0 || plane_len <= 0) return cudaSuccess;
  if (plane_len >= (int64_t{1} << 31) || s.Wp >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if (pw_pre(pw.mode) != kPreNone || pw.residual != nullptr) return cudaErrorInvalidValue;
  const bool by_rows = s.W >= kPadRowsMinW;
  dim3 grid;
  if (by_rows && rows_per_warp != 1 && rows_per_warp != 2) return cudaErrorInvalidValue;
  if (by_rows) {  // persistent warps: up to 16 CTAs of 8 row-walking warps per SM
    const int64_t warps = (planes * s.Hp + rows_per_warp - 1) / rows_per_warp;
    grid = dim3(static_cast<unsigned>(std::min<int64_t>((warps + 7) / 8, int64_t{16} * sm_count)));
  } else {  // one trip per thread where the grid stays within ~16 waves of 8 CTAs per SM; longer planes loop
    const int64_t per_plane = (plane_len + kPadThreads * kPadUnroll - 1) / (kPadThreads * kPadUnroll);
    const int64_t ys = std::min<int64_t>(planes, 65535);
    const int64_t cap = std::max<int64_t>(1, int64_t{16} * 8 * sm_count / ys);
    grid = dim3(static_cast<unsigned>(std::min(per_plane, cap)), static_cast<unsigned>(ys));
  }
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
        if (by_rows) {
          auto rows_go = [&](auto kernel) {
            return launch_dependent(kernel, grid, dim3(kPadThreads), 0, stream, static_cast<const T*>(x),
                                    static_cast<T*>(out), reinterpret_cast<const float4*>(coef), s, pw, value);
          };
          if (rows_per_warp == 2)
            return replicate ? rows_go(affine_pad_rows_kernel<T, P, true, 2>)
                             : rows_go(affine_pad_rows_kernel<T, P, false, 2>);
          return replicate ? rows_go(affine_pad_rows_kernel<T, P, true, 1>)
                           : rows_go(affine_pad_rows_kernel<T, P, false, 1>);
        }
        return replicate ? go(affine_pad_kernel<T, P, true>) : go(affine_pad_kernel<T, P, false>);
      }
    });
  });
}

}  // namespace gn
}  // namespace gnext
