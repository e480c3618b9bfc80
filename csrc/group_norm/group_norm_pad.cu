// SPDX-License-Identifier: BSD-3-Clause
// The two-pass elementwise pass written into a padded output: out = F.pad(act(GroupNorm(x)), pad, mode), the
// input of a convolution whose padding is not its own (video VAEs' causal 3-D convolutions pad by replication).
// Every output element is computed from its source element (replicate: the clamped index; constant: the pad
// value outside x), so the normalized tensor is written once, halo included, and never read again. Three kernels
// (pad_plan in group_norm_plan.h): source rows staged in shared memory by cp.async (the tile kernel), a warp per
// output row with its own loads (the row kernel), each plane walked flat (short rows).
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


// The tile kernel: each unit is up to a stage of consecutive source rows (n, c, d, h0 .. h0 + rows) whose bytes are a
// multiple of 16, copied into shared memory by cp.async (kPadTileStages stages per CTA: the next units' copies are in
// flight while this one is written, and hold no registers). Each staged row has V slots on either side; with
// replicate padding of at most V elements a side they are filled with the row's first and last elements, so that
// staged row p = V - wl + j holds output element j's source for every j, halo included. The CTA's warps then write
// every output row whose source row is staged (a row's replicated rows and frames from the same stage), from the
// output's first 16-byte boundary: each output vector is two 16-byte stage loads shifted in registers (window16), the
// unaligned ends one element per lane. Constant padding (or wider replicate padding) takes the vectors that touch
// the halo one element at a time. The unit of the first (last) source frame or row also writes the rows before
// (after) it.
constexpr int kPadTileStages = 3;
template <typename T, int Pw, bool Replicate>
struct PadTileTag {};  // raise_smem_limit's per-kernel tag

// Elements per staged row: the row and V slots on either side.
constexpr int64_t pad_tile_row(int64_t W, int64_t V) { return W + 2 * V; }

template <typename T, int Pw, bool Replicate>
__global__ void __launch_bounds__(kPadThreads)
    affine_pad_tile_kernel(const T* __restrict__ x, T* __restrict__ out, const float4* __restrict__ coef,
                           PadShape s, PwArgs pw, float value, FastDivmod vec_div, int stage_elems, int rb, int blocks,
                           int64_t units) {
  constexpr int V = 16 / sizeof(T), kWarps = kPadThreads / 32;
  using Raw = typename Pack<T, V>::Raw;
  extern __shared__ __align__(16) unsigned char pad_smem[];
  T* const stages = reinterpret_cast<T*>(pad_smem);
  pdl_wait();  // launch_dependent: coef is written
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = static_cast<int>(s.W), H = static_cast<int>(s.H), D = static_cast<int>(s.D);
  const int Wp = static_cast<int>(s.Wp), Hp = static_cast<int>(s.Hp), Dp = static_cast<int>(s.Dp);
  const int wl = s.wl, wr = Wp - W - wl, SW = static_cast<int>(pad_tile_row(W, V)), row_vecs = W / V;
  const bool halo = Replicate && wl <= V && wr <= V;  // the staged rows carry their halo
  const T cval = static_cast<T>(value);
  auto load = [&](int stage, int64_t u) {
    if (u < units) {
      const int64_t q = u / blocks;  // q = nc * D + d
      const int h0 = static_cast<int>(u - q * blocks) * rb, n = min(rb, H - h0) * row_vecs;
      const Raw* src = reinterpret_cast<const Raw*>(x + (q * H + h0) * s.W);
      T* dst = stages + stage * stage_elems + V;
      for (int i = threadIdx.x; i < n; i += kPadThreads) {
        const int r = static_cast<int>(vec_div.div(static_cast<uint32_t>(i)));
        cp_async16(dst + r * SW + (i - r * row_vecs) * V, src + i);
      }
    }
    cp_async_commit();
  };
  const int64_t stride = gridDim.x;
#pragma unroll
  for (int k = 0; k < kPadTileStages - 1; ++k) load(k, blockIdx.x + k * stride);
  int stage = 0;
  for (int64_t u = blockIdx.x; u < units; u += stride) {
    load((stage + kPadTileStages - 1) % kPadTileStages, u + (kPadTileStages - 1) * stride);
    cp_async_wait<kPadTileStages - 1>();
    __syncthreads();
    const int64_t q = u / blocks, nc = q / D;
    const int d = static_cast<int>(q - nc * D), h0 = static_cast<int>(u - q * blocks) * rb, nr = min(rb, H - h0);
    T* const st = stages + stage * stage_elems;
    if (halo) {  // each staged row's slots: copies of its first and last elements
      for (int i = threadIdx.x; i < nr * (wl + wr); i += kPadThreads) {
        const int r = i / (wl + wr), k = i - r * (wl + wr);
        T* row = st + r * SW;
        if (k < wl) row[V - 1 - k] = row[V];
        else row[V + W + (k - wl)] = row[V + W - 1];
      }
      __syncthreads();
    }
    // The output frames and rows this unit writes: its own, and the padding before (after) the first (last) ones.
    const int dlo = d == 0 ? 0 : d + s.fd, dhi = d == D - 1 ? Dp : d + s.fd + 1;
    const int hlo = h0 == 0 ? 0 : h0 + s.ht, hhi = h0 + nr == H ? Hp : h0 + nr + s.ht, nh = hhi - hlo;
    const float4 k = coef[nc];
    const float pc = pw_channel<false, Pw>(pw, nc % s.C);
    auto f = [&](T v) { return static_cast<T>(pw_affine<false, Pw>(k, to_float(v), 0.f, pc)); };
    int dp = dlo, hp = hlo + warp;  // the warp's rows: warp, warp + kWarps, ... of (dhi - dlo) x nh, frame-major
    for (; dp < dhi; hp += kWarps) {
      for (; hp >= hhi; ++dp) hp -= nh;
      if (dp >= dhi) break;
      T* orow = out + ((nc * Dp + dp) * Hp + hp) * s.Wp;
      const int sd = src_index<Replicate>(dp, s.fd, D), sh = src_index<Replicate>(hp, s.ht, H);
      if (sd < 0 || sh < 0) {  // constant padding: a row of the pad value
        warp_store_run(orow, Wp, lane, [&](int) { return cval; });
        continue;
      }
      const T* srow = st + (sh - h0) * SW;  // its slots, then the row at V
      const Raw* sv = reinterpret_cast<const Raw*>(srow);
      auto get = [&](int j) {  // output element j of the row
        if (halo) return f(srow[V - wl + j]);
        const int w = src_index<Replicate>(j, wl, W);
        return w < 0 ? cval : f(srow[V + w]);
      };
      const int head = to_aligned16(orow, Wp), nv = (Wp - head) / V, tail = head + nv * V;
      if (lane < head) orow[lane] = get(lane);
      for (int vi = lane; vi < nv; vi += 32) {
        const int j0 = head + vi * V;
        Pack<T, V> pk;
        if (halo || (j0 >= wl && j0 + V <= wl + W)) {  // staged elements p0 .. p0 + V: two stage vectors shifted
          const int p0 = V - wl + j0, lo = p0 / V, off = p0 - lo * V;
          pk.raw = window16<T>(sv[lo], off == 0 ? sv[lo] : sv[lo + 1], off);
#pragma unroll
          for (int j = 0; j < V; ++j) pk.v[j] = f(pk.v[j]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) pk.v[j] = get(j0 + j);
        }
        stg_raw(reinterpret_cast<Raw*>(orow + j0), pk.raw);
      }
      if (tail + lane < Wp) orow[tail + lane] = get(tail + lane);
    }
    __syncthreads();  // the stage is free for the copies issued at the top of the next trip
    stage = (stage + 1) % kPadTileStages;
  }
  cp_async_wait<0>();
}

}  // namespace

cudaError_t launch_affine_pad(ScalarKind t, const PadShape& s, const void* x, void* out, const float* coef,
                              const PwArgs& pw, bool replicate, float value, const PadPlan& plan, int sm_count,
                              cudaStream_t stream) {
  const int64_t planes = s.NC * s.Dp, plane_len = s.Hp * s.Wp;
  if (planes <= 0 || plane_len <= 0) return cudaSuccess;
  if (plane_len >= (int64_t{1} << 31) || s.Wp >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if (pw_pre(pw.mode) != kPreNone || pw.residual != nullptr) return cudaErrorInvalidValue;
  const int64_t esize = t == ScalarKind::Float ? 4 : 2;
  int rb = 0, blocks = 0, stage_elems = 0;
  int64_t units = 0;
  dim3 grid;
  size_t smem = 0;
  switch (plan.kernel) {
    case PadKernel::kTiles: {  // persistent CTAs, as many per SM as the stages' shared memory allows (at most 8)
      if ((s.W * esize) % 16 != 0 || s.W * esize > kPadTileBytes || (reinterpret_cast<uintptr_t>(x) & 15) != 0)
        return cudaErrorInvalidValue;
      rb = static_cast<int>(kPadTileBytes / (s.W * esize));
      blocks = static_cast<int>((s.H + rb - 1) / rb);
      units = s.NC * s.D * blocks;
      stage_elems = static_cast<int>(rb * pad_tile_row(s.W, 16 / esize));
      // One vector of slack: a window's second load may pass the last staged row's slots.
      smem = static_cast<size_t>(kPadTileStages * stage_elems * esize + 16);
      const int64_t per_sm = std::max<int64_t>(1, std::min<int64_t>(8, (224 * 1024) / static_cast<int64_t>(smem + 1024)));
      grid = dim3(static_cast<unsigned>(std::min<int64_t>(units, per_sm * sm_count)));
      break;
    }
    case PadKernel::kRows: {  // persistent warps: up to 16 CTAs of 8 row-walking warps per SM
      if (plan.rows_per_warp != 1 && plan.rows_per_warp != 2) return cudaErrorInvalidValue;
      const int64_t warps = (planes * s.Hp + plan.rows_per_warp - 1) / plan.rows_per_warp;
      grid = dim3(static_cast<unsigned>(std::min<int64_t>((warps + 7) / 8, int64_t{16} * sm_count)));
      break;
    }
    default: {  // one trip per thread where the grid stays within ~16 waves of 8 CTAs per SM; longer planes loop
      const int64_t per_plane = (plane_len + kPadThreads * kPadUnroll - 1) / (kPadThreads * kPadUnroll);
      const int64_t ys = std::min<int64_t>(planes, 65535);
      const int64_t cap = std::max<int64_t>(1, int64_t{16} * 8 * sm_count / ys);
      grid = dim3(static_cast<unsigned>(std::min(per_plane, cap)), static_cast<unsigned>(ys));
    }
  }
  const FastDivmod wp_div(static_cast<uint32_t>(s.Wp));
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    return with_pw(pw.mode, [&](auto pp) -> cudaError_t {
      constexpr int P = decltype(pp)::value;
      if constexpr (pw_pre(P) != kPreNone) {
        return cudaErrorInvalidValue;
      } else {
        const T* xt = static_cast<const T*>(x);
        T* ot = static_cast<T*>(out);
        const float4* k = reinterpret_cast<const float4*>(coef);
        if (plan.kernel == PadKernel::kTiles) {
          auto go = [&](auto kernel, auto tag) {
            const cudaError_t e = raise_smem_limit<decltype(tag)>(kernel, smem);
            if (e != cudaSuccess) return e;
            return launch_dependent(kernel, grid, dim3(kPadThreads), smem, stream, xt, ot, k, s, pw, value,
                                    FastDivmod(static_cast<uint32_t>(s.W * esize / 16)), stage_elems, rb, blocks, units);
          };
          return replicate ? go(affine_pad_tile_kernel<T, P, true>, PadTileTag<T, P, true>{})
                           : go(affine_pad_tile_kernel<T, P, false>, PadTileTag<T, P, false>{});
        }
        if (plan.kernel == PadKernel::kRows) {
          auto go = [&](auto kernel) {
            return launch_dependent(kernel, grid, dim3(kPadThreads), 0, stream, xt, ot, k, s, pw, value);
          };
          if (plan.rows_per_warp == 2)
            return replicate ? go(affine_pad_rows_kernel<T, P, true, 2>) : go(affine_pad_rows_kernel<T, P, false, 2>);
          return replicate ? go(affine_pad_rows_kernel<T, P, true, 1>) : go(affine_pad_rows_kernel<T, P, false, 1>);
        }
        auto go = [&](auto kernel) {
          return launch_dependent(kernel, grid, dim3(kPadThreads), 0, stream, xt, ot, k, s, wp_div, pw, value);
        };
        return replicate ? go(affine_pad_kernel<T, P, true>) : go(affine_pad_kernel<T, P, false>);
      }
    });
  });
}

}  // namespace gn
}  // namespace gnext
