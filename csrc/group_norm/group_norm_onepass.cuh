// SPDX-License-Identifier: BSD-3-Clause
// One-pass GroupNorm kernels, NCHW and NHWC, forward and backward: every element of x (and dy)
// is read from DRAM once. Geometry and arguments: OnePassGeometry / OnePassArgs in
// group_norm_launch.h. NCHW: a group is a contiguous run of D*HxW elements, tiles are whole
// channels or pieces of one. NHWC: a unit is (n, a block of cb channels = whole groups), tiles
// are ranges of `rows` pixels x cb channels, partials are per channel.
//
// A persistent grid of `grid` CTAs walks the tiles (tile i = k * grid + blockIdx.x). A CTA keeps
// `nbuf` tiles in shared memory (cp.async stages). For its k-th tile it
//   1. publishes the statistics of its (k+1)-th tile (once in shared memory): a Welford state
//      (forward) or per-channel (sum dy*(x - mean), sum dy) (backward) to `partial` in global
//      memory, then increments the group's counter;
//   2. waits until the counter of the k-th tile's group reaches T (all of its tiles published),
//      merges the group's partials in a fixed order (every CTA of the group computes the same
//      bits; no float atomics), and normalizes the tile from shared memory;
//   3. starts copying its (k+nbuf)-th tile into the freed stage.
// Step 1 comes first when groups have several tiles (OnePassGeometry::early: the others wait on it),
// last for whole-group tiles (no waits; the (k+1)-th tile's copy then overlaps step 2).
// Deadlock freedom: a group's (unit's) T <= grid tiles lie in at most two consecutive waves k, k+1, and
// every CTA publishes wave k+1 before it waits on wave k; all CTAs are co-resident (cooperative
// launch), so the waits of wave k end once wave k-1's have. With nbuf == 1 every CTA has one tile.
#pragma once
#include <type_traits>

#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

struct OnePassTile {
  bool valid;
  int64_t u;       // group n * G + g
  int64_t j;       // position in the group
  int64_t d0;      // first channel of the group in the tile
  int64_t piece;   // piece of the channel (sub > 1)
  int64_t start;   // element offset
  uint32_t len;    // elements
  int nch;         // channels in the tile
};

__device__ __forceinline__ OnePassTile onepass_tile(int64_t i, int64_t ntiles, const OnePassGeometry& g, int64_t D,
                                                    int64_t HxW) {
  OnePassTile t{};
  t.valid = i < ntiles;
  if (!t.valid) return t;
  t.u = i / g.T;
  t.j = i - t.u * g.T;
  if (g.sub > 1) {
    t.d0 = t.j / g.sub;
    t.piece = t.j - t.d0 * g.sub;
    const int64_t off = t.piece * g.tile;
    t.len = static_cast<uint32_t>(min(g.tile, HxW - off));
    t.nch = 1;
    t.start = (t.u * D + t.d0) * HxW + off;
  } else {
    t.d0 = t.j * g.cpt;
    t.piece = 0;
    t.nch = static_cast<int>(min(g.cpt, D - t.d0));
    t.len = static_cast<uint32_t>(t.nch * HxW);
    t.start = (t.u * D + t.d0) * HxW;
  }
  return t;
}

__device__ __forceinline__ void cp_async_wait_dyn(int pending) {
  if (pending <= 0) {
    cp_async_wait<0>();
  } else if (pending == 1) {
    cp_async_wait<1>();
  } else if (pending == 2) {
    cp_async_wait<2>();
  } else {
    cp_async_wait<3>();
  }
}

// The schedule shared by the NCHW and NHWC kernels (see the top of this file): load(k) starts
// the copy of the CTA's k-th tile, publish(k) posts its statistics, finish(k) waits for its group
// and writes its output. early: publish tile k+1 before finishing tile k (tile k+1 must have arrived
// first, so nothing of this CTA's is in flight while it finishes tile k); otherwise publish it after
// finishing tile k and starting the copy of tile k+nbuf, so that tile k+1's copy overlaps finish(k).
// Both orders are deadlock-free: a group's tiles lie in waves k and k+1, and a CTA whose tile of wave k+1
// is waited for finishes its wave-k tile, whose group lies in waves k-1 and k, without waiting on wave k+1.
template <typename Load, typename Publish, typename Finish>
__device__ __forceinline__ void onepass_pipeline(int nbuf, bool early, int64_t ktiles, Load& load, Publish& publish,
                                                 Finish& finish) {
  for (int b = 0; b < nbuf; ++b) load(b);
  cp_async_wait_dyn(nbuf - 1);
  __syncthreads();
  publish(0);
  for (int64_t k = 0; k < ktiles; ++k) {
    if (nbuf > 1 && early) {
      cp_async_wait_dyn(nbuf - 2);  // the (k+1)-th tile has arrived
      __syncthreads();
      publish(k + 1);
    }
    finish(k);
    __syncthreads();  // stage k % nbuf is free
    load(k + nbuf);
    if (nbuf > 1 && !early && k + 1 < ktiles) {
      cp_async_wait_dyn(nbuf - 1);  // the (k+1)-th tile has arrived; tiles k+2 .. k+nbuf may be in flight
      __syncthreads();
      publish(k + 1);
    }
  }
  cp_async_wait<0>();
}

template <typename T, int V, bool Bwd, int Pw>
__global__ void __launch_bounds__(kOnePassThreads, 1)
    onepass_nchw_kernel(OnePassArgs a, OnePassGeometry geo, int64_t G, int64_t D, int64_t HxW, int64_t ntiles,
                        FastDivmod hwv) {
  constexpr int Pre = pw_pre(Pw), A = pw_act(Pw);  // input prologue / output activation
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ WelfordState wscratch[33];
  __shared__ float2 sscratch[33];
  __shared__ float2 group_stat;  // forward: (mean, rstd) of the current tile's group

  T* const bx = reinterpret_cast<T*>(smem_raw);
  T* const bd = bx + geo.nbuf * geo.tile;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ dy = static_cast<const T*>(a.dy);
  T* __restrict__ out = static_cast<T*>(a.out);
  float2* const partial2 = reinterpret_cast<float2*>(a.partial);
  const int64_t P = gridDim.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int64_t ktiles = (ntiles - 1 - blockIdx.x) / P + 1;  // tiles of this CTA (grid <= ntiles)
  auto tile_k = [&](int64_t k) { return onepass_tile(blockIdx.x + k * P, ntiles, geo, D, HxW); };

  // Start copying the k-th tile into stage k % nbuf (always commits a group, possibly empty).
  auto load = [&](int64_t k) {
    const OnePassTile t = tile_k(k);
    if (t.valid) {
      T* sx = bx + (k % geo.nbuf) * geo.tile;
      T* sd = bd + (k % geo.nbuf) * geo.tile;
      for (uint32_t v = tid; v < t.len / V; v += blockDim.x) {
        cp_async16(sx + v * V, x + t.start + v * V);
        if constexpr (Bwd) cp_async16(sd + v * V, dy + t.start + v * V);
      }
    }
    cp_async_commit();
  };

  // Prologue bias of channel c (0 without a prologue).
  auto pre_bias = [&](int64_t c) { return Pre == kPreNone ? 0.f : load_param(a.pw.bias, a.pw.bias_t, c, 0.f); };

  // Statistics of the k-th tile (in shared memory) to `partial`; then the group's counter.
  auto publish = [&](int64_t k) {
    const OnePassTile t = tile_k(k);
    if (!t.valid) return;
    const T* sx = bx + (k % geo.nbuf) * geo.tile;
    const T* sd = bd + (k % geo.nbuf) * geo.tile;
    const uint32_t nvec = t.len / V;
    const int64_t c0 = (t.u % G) * D + t.d0;  // channel of the tile's first element
    if constexpr (!Bwd) {
      WelfordState s = WelfordOp::identity();
      float pb = pre_bias(c0);
      for (uint32_t v = tid; v < nvec; v += blockDim.x) {
        float xv[V];
        lds_vec<T, V>(sx + v * V, xv);
        if constexpr (Pre != kPreNone) {
          // The prologue's a = act(x + b) replaces x in shared memory (rounded to T, as the unfused
          // PyTorch activation would be): the finish normalizes it without recomputing.
          if (t.nch > 1) pb = pre_bias(c0 + hwv.div(v));
#pragma unroll
          for (int e = 0; e < V; ++e) xv[e] = pre_apply<Pre>(xv[e], pb);
          sts_vec<T, V>(const_cast<T*>(sx) + v * V, xv);
          // the statistics of the stored (rounded) values; float stores exactly, nothing to reload
          if constexpr (!std::is_same_v<T, float>) lds_vec<T, V>(sx + v * V, xv);
        }
        s = welford_merge(s, welford_of<V>(xv));
      }
      s = block_reduce<WelfordOp>(s, wscratch);
      if (tid == 0) {
        float* q = a.partial + (blockIdx.x + k * P) * 3;
        q[0] = s.mean, q[1] = s.m2, q[2] = s.n;
      }
    } else {
      const float mu = a.mean[t.u];
      const float r = A != kActIdentity ? a.rstd[t.u] : 0.f;
      // pb: the channel's prologue bias; epilogue: dy -> dy * act'(n), n = (x - mu) * r * gamma + beta.
      auto acc = [&](float2& s, uint32_t v, float pb, int64_t c) {
        float xv[V], dv[V];
        lds_vec<T, V>(sx + v * V, xv);
        lds_vec<T, V>(sd + v * V, dv);
        float sg = 0.f, sb = 0.f;
        if constexpr (A != kActIdentity) {
          sg = r * load_param(a.gamma, a.wt, c, 1.f);
          sb = load_param(a.beta, a.wt, c, 0.f);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xa = pre_apply<Pre>(xv[e], pb);
          const float d = act_dy<A>(dv[e], xa - mu, sg, sb);
          s.x = fmaf(d, xa - mu, s.x);
          s.y += d;
        }
      };
      float2* q = partial2 + (t.u * D + t.d0) * geo.sub + t.piece;
      if (t.nch == 1) {
        float2 s = Sum2Op::identity();
        const float pb = pre_bias(c0);
        for (uint32_t v = tid; v < nvec; v += blockDim.x) acc(s, v, pb, c0);
        s = block_reduce<Sum2Op>(s, sscratch);
        if (tid == 0) *q = s;
      } else {
        const uint32_t hv = static_cast<uint32_t>(HxW / V);
        if (t.nch <= nwarps) {  // wpc warps per channel, combined through shared memory
          const int wpc = nwarps / t.nch;
          float2 s = Sum2Op::identity();
          if (warp < t.nch * wpc) {
            const uint32_t ch = warp / wpc, part = warp % wpc;
            const float pb = pre_bias(c0 + ch);
            for (uint32_t v = part * 32 + lane; v < hv; v += wpc * 32) acc(s, ch * hv + v, pb, c0 + ch);
          }
          s = warp_reduce<Sum2Op>(s);
          if (lane == 0) sscratch[warp] = s;
          __syncthreads();
          if (tid < t.nch) {
            float2 r = Sum2Op::identity();
            for (int w = 0; w < wpc; ++w) r = Sum2Op::combine(r, sscratch[tid * wpc + w]);
            q[tid * geo.sub] = r;
          }
          __syncthreads();
        } else {  // a warp per channel
          for (int ch = warp; ch < t.nch; ch += nwarps) {
            float2 s = Sum2Op::identity();
            const float pb = pre_bias(c0 + ch);
            for (uint32_t v = lane; v < hv; v += 32) acc(s, ch * hv + v, pb, c0 + ch);
            s = warp_reduce<Sum2Op>(s);
            if (lane == 0) q[ch * geo.sub] = s;
          }
        }
      }
    }
    if (a.counters != nullptr) {
      __syncthreads();  // (the pattern of a cooperative-groups grid sync: barrier, then fence + atomic)
      if (tid == 0) arrive(&a.counters[t.u]);
    }
  };

  // Waits for the k-th tile's group, then normalizes the tile from shared memory.
  auto finish = [&](int64_t k) {
    const OnePassTile t = tile_k(k);
    if (a.counters != nullptr && tid == 0) {
      wait_count(&a.counters[t.u], static_cast<unsigned>(geo.T));
      depart(&a.counters[t.u], static_cast<unsigned>(geo.T));  // left at zero for the next launch
    }
    __syncthreads();
    const T* sx = bx + (k % geo.nbuf) * geo.tile;
    const T* sd = bd + (k % geo.nbuf) * geo.tile;
    const uint32_t nvec = t.len / V;
    const int64_t c0 = (t.u % G) * D + t.d0;  // channel of the tile's first element
    if constexpr (!Bwd) {
      if (warp == 0) {
        // Lane l merges partials l, l + 32, ... in order; 8 loads in flight per lane.
        WelfordState s = WelfordOp::identity();
        const float* base = a.partial + t.u * geo.T * 3;
        for (int64_t j0 = 0; j0 < geo.T; j0 += 8 * 32) {
          WelfordState v[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            const int64_t j = j0 + q * 32 + lane;
            v[q] = j < geo.T ? WelfordState{__ldcg(base + 3 * j), __ldcg(base + 3 * j + 1), __ldcg(base + 3 * j + 2)}
                             : WelfordOp::identity();
          }
#pragma unroll
          for (int q = 0; q < 8; ++q) s = welford_merge(s, v[q]);
        }
        s = warp_reduce<WelfordOp>(s);
        if (lane == 0) {
          const float rstd = rsqrtf(fmaxf(s.m2 / s.n, 0.f) + a.eps);
          group_stat = make_float2(s.mean, rstd);
          if (t.j == 0) {
            a.mean[t.u] = s.mean;
            a.rstd[t.u] = rstd;
          }
        }
      }
      __syncthreads();
      const float mu = group_stat.x, rstd = group_stat.y;
      float scale = rstd * load_param(a.gamma, a.wt, c0, 1.f), shift = load_param(a.beta, a.wt, c0, 0.f);
      auto store = [&](uint32_t v, float* xv) {  // (+ residual) and out
        if (a.pw.residual != nullptr) {
          float rv[V];
          load_vec<T, V>(static_cast<const T*>(a.pw.residual) + t.start + v * V, rv);
#pragma unroll
          for (int e = 0; e < V; ++e) xv[e] += rv[e];
        }
        store_vec<T, V>(out + t.start + v * V, xv);
      };
      // Two loops, so that the common one carries no per-vector branch on the plan.
      if (geo.ragged) {
        // Whole-group tile, HxW not a multiple of V: a vector's elements may lie in several channels.
#pragma unroll 4
        for (uint32_t v = tid; v < nvec; v += blockDim.x) {
          float xv[V];
          lds_vec<T, V>(sx + v * V, xv);
          normalize_straddling<A, V>(xv, v * V, hwv, c0, mu, rstd, a.gamma, a.beta, a.wt);
          store(v, xv);
        }
      } else {
#pragma unroll 4
        for (uint32_t v = tid; v < nvec; v += blockDim.x) {
          float xv[V];
          lds_vec<T, V>(sx + v * V, xv);  // x, or the prologue's a (written by publish)
          if (t.nch > 1) {
            const int64_t c = c0 + hwv.div(v);
            scale = rstd * load_param(a.gamma, a.wt, c, 1.f);
            shift = load_param(a.beta, a.wt, c, 0.f);
          }
#pragma unroll
          for (int e = 0; e < V; ++e) xv[e] = act_apply<A>(fmaf(xv[e] - mu, scale, shift));
          store(v, xv);
        }
      }
    } else {
      // Per-channel sums of the group (fixed order); c2, c3 as in finalize_backward_kernel.
      float2 accg = Sum2Op::identity();
      const int64_t cg0 = (t.u % G) * D;
      for (int64_t d = warp; d < D; d += nwarps) {
        const float2* q = partial2 + (t.u * D + d) * geo.sub;
        float2 s = Sum2Op::identity();
#pragma unroll 4
        for (int64_t j = lane; j < geo.sub; j += 32) s = Sum2Op::combine(s, __ldcg(q + j));
        s = warp_reduce<Sum2Op>(s);
        if (lane == 0) {
          if (a.dsum != nullptr && t.j == 0) reinterpret_cast<float2*>(a.dsum)[t.u * D + d] = s;
          const float w = load_param(a.gamma, a.wt, cg0 + d, 1.f);
          accg.x = fmaf(w, s.x, accg.x);
          accg.y = fmaf(w, s.y, accg.y);
        }
      }
      accg = block_reduce<Sum2Op>(accg, sscratch);
      const float r = a.rstd[t.u], mu = a.mean[t.u];
      const float inv_count = 1.f / static_cast<float>(D * HxW);
      const float c2 = -r * r * r * accg.x * inv_count, c3 = -r * accg.y * inv_count;
      float scale = r * load_param(a.gamma, a.wt, c0, 1.f);
      float pb = pre_bias(c0);
      float beta = A != kActIdentity ? load_param(a.beta, a.wt, c0, 0.f) : 0.f;
#pragma unroll 4
      for (uint32_t v = tid; v < nvec; v += blockDim.x) {
        if (t.nch > 1) {
          const int64_t c = c0 + hwv.div(v);
          scale = r * load_param(a.gamma, a.wt, c, 1.f);
          pb = pre_bias(c);
          if (A != kActIdentity) beta = load_param(a.beta, a.wt, c, 0.f);
        }
        float xv[V], dv[V];
        lds_vec<T, V>(sx + v * V, xv);
        lds_vec<T, V>(sd + v * V, dv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float xa;
          const float g = pre_apply_grad<Pre>(xv[e], pb, xa);
          const float dd = act_dy<A>(dv[e], xa - mu, scale, beta);
          const float d = fmaf(scale, dd, fmaf(c2, xa - mu, c3));
          xv[e] = Pre == kPreNone ? d : d * g;
        }
        store_vec<T, V>(out + t.start + v * V, xv);
      }
    }
  };

  onepass_pipeline(geo.nbuf, geo.early, ktiles, load, publish, finish);
}

// ---------------------------------------------------------------------------------------------
// NHWC (channels_last). Unit u = n * (C / cb) + block; tile j = rows [j*rows, ...) x cb channels,
// held as [rows][cb]. Thread t owns the 16-byte chunk q = t % cpr (channels q*V ...) of rows
// t / cpr, t / cpr + rpi, ... Dynamic shared memory after the stages: red (threads * V float2,
// per-thread per-channel sums) and coef (cb float4, per-channel coefficients).
template <typename T, int V, bool Bwd>
__global__ void __launch_bounds__(kOnePassThreads, 1)
    onepass_nhwc_kernel(OnePassArgs a, OnePassGeometry geo, int64_t C, int64_t G, int64_t D, int64_t HxW,
                        int64_t ntiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t stage_elems = geo.nbuf * geo.tile;
  T* const bx = reinterpret_cast<T*>(smem_raw);
  T* const bd = bx + stage_elems;
  float2* const red = reinterpret_cast<float2*>(smem_raw + stage_elems * sizeof(T) * (Bwd ? 2 : 1));
  float4* const coef = reinterpret_cast<float4*>(red + blockDim.x * V);
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ dy = static_cast<const T*>(a.dy);
  T* __restrict__ out = static_cast<T*>(a.out);
  float2* const partial2 = reinterpret_cast<float2*>(a.partial);
  const int64_t P = gridDim.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int cb = static_cast<int>(geo.cb), cpr = cb / V, rpi = blockDim.x / cpr;
  const int q = tid % cpr, rl = tid / cpr;
  const bool active = rl < rpi;
  const int gb = static_cast<int>(cb / D);  // groups per block
  int rpi_pow2 = 1;
  while (rpi_pow2 < rpi) rpi_pow2 <<= 1;
  // Per-(tile, group) backward partials follow the per-(tile, channel) ones.
  float2* const gpartial2 = partial2 + ntiles * cb;
  const int64_t blocks = C / cb;
  const int64_t ktiles = (ntiles - 1 - blockIdx.x) / P + 1;

  struct Tile {
    bool valid;
    int64_t i, u, j, n, c0, r0;  // c0: first channel of the block
    int R;
  };
  auto tile_k = [&](int64_t k) {
    Tile t{};
    t.i = blockIdx.x + k * P;
    t.valid = t.i < ntiles;
    if (!t.valid) return t;
    t.u = t.i / geo.T;
    t.j = t.i - t.u * geo.T;
    t.n = t.u / blocks;
    t.c0 = (t.u - t.n * blocks) * cb;
    t.r0 = t.j * geo.rows;
    t.R = static_cast<int>(min(geo.rows, HxW - t.r0));
    return t;
  };
  auto gofs = [&](const Tile& t, int64_t r) { return (t.n * HxW + t.r0 + r) * C + t.c0; };  // row r of tile t

  auto load = [&](int64_t k) {
    const Tile t = tile_k(k);
    if (t.valid) {
      T* sx = bx + (k % geo.nbuf) * geo.tile;
      T* sd = bd + (k % geo.nbuf) * geo.tile;
      for (int v = tid; v < t.R * cpr; v += blockDim.x) {
        const int r = v / cpr, qq = v - r * cpr;
        const int64_t off = gofs(t, r) + qq * V;
        cp_async16(sx + v * V, x + off);
        if constexpr (Bwd) cp_async16(sd + v * V, dy + off);
      }
    }
    cp_async_commit();
  };

  // Per-channel sum over the tile's rows of f(x chunk, dy chunk) -> float2 per channel, returned to
  // threads tid < cb (channel tid) in a fixed order (row lanes ascending).
  auto channel_sums = [&](const T* sx, const T* sd, int R, auto f) -> float2 {
    float2 acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = Sum2Op::identity();
    if (active) {
      for (int r = rl; r < R; r += rpi) {
        float xv[V], dv[V];
        lds_vec<T, V>(sx + (r * cpr + q) * V, xv);
        if constexpr (Bwd) lds_vec<T, V>(sd + (r * cpr + q) * V, dv);
#pragma unroll
        for (int e = 0; e < V; ++e) f(acc[e], e, xv[e], Bwd ? dv[e] : 0.f);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) red[tid * V + e] = acc[e];  // = red[rl * cb + channel]
    }
    __syncthreads();
    // Fixed tree over the row lanes: red[rl * cb + c] += red[(rl + h) * cb + c].
    for (int h = rpi_pow2 / 2; h > 0; h >>= 1) {
      if (active && rl < h && rl + h < rpi) {
#pragma unroll
        for (int e = 0; e < V; ++e) red[tid * V + e] = Sum2Op::combine(red[tid * V + e], red[(tid + h * cpr) * V + e]);
      }
      __syncthreads();
    }
    const float2 s = tid < cb ? red[tid] : Sum2Op::identity();
    __syncthreads();
    return s;
  };

  auto publish = [&](int64_t k) {
    const Tile t = tile_k(k);
    if (!t.valid) return;
    const T* sx = bx + (k % geo.nbuf) * geo.tile;
    const T* sd = bd + (k % geo.nbuf) * geo.tile;
    if constexpr (!Bwd) {  // exact two-pass moments of each channel over the tile's rows
      const float2 sum = channel_sums(sx, sd, t.R, [](float2& acc, int, float xv, float) { acc.x += xv; });
      if (tid < cb) coef[tid].x = sum.x / static_cast<float>(t.R);
      __syncthreads();
      float m[V];
#pragma unroll
      for (int e = 0; e < V; ++e) m[e] = coef[q * V + e].x;
      const float2 m2 = channel_sums(sx, sd, t.R, [&](float2& acc, int e, float xv, float) {
        acc.x = fmaf(xv - m[e], xv - m[e], acc.x);
      });
      if (tid < cb) coef[tid].y = m2.x;
      __syncthreads();
      if (tid < gb) {  // the tile's Welford state of each group: its D channels merged in order
        WelfordState st = WelfordOp::identity();
        for (int d = 0; d < D; ++d)
          st = welford_merge(st, {coef[tid * D + d].x, coef[tid * D + d].y, static_cast<float>(t.R)});
        float* o = a.partial + (t.i * gb + tid) * 3;
        o[0] = st.mean, o[1] = st.m2, o[2] = st.n;
      }
    } else {  // (sum dy * (x - mean[n, g]), sum dy) per channel, and gamma-weighted per group
      float mu[V];
#pragma unroll
      for (int e = 0; e < V; ++e) mu[e] = a.mean[t.n * G + (t.c0 + q * V + e) / D];
      const float2 s = channel_sums(sx, sd, t.R, [&](float2& acc, int e, float xv, float dv) {
        acc.x = fmaf(dv, xv - mu[e], acc.x);
        acc.y += dv;
      });
      if (tid < cb) {
        partial2[t.i * cb + tid] = s;
        const float w = load_param(a.gamma, a.wt, t.c0 + tid, 1.f);
        red[tid] = make_float2(w * s.x, w * s.y);
      }
      __syncthreads();
      if (tid < gb) {
        float2 gs = Sum2Op::identity();
        for (int d = 0; d < D; ++d) gs = Sum2Op::combine(gs, red[tid * D + d]);
        gpartial2[t.i * gb + tid] = gs;
      }
    }
    __syncthreads();
    if (a.counters != nullptr && tid == 0) arrive(&a.counters[t.u]);
  };

  auto finish = [&](int64_t k) {
    const Tile t = tile_k(k);
    if (a.counters != nullptr && tid == 0) {
      wait_count(&a.counters[t.u], static_cast<unsigned>(geo.T));
      depart(&a.counters[t.u], static_cast<unsigned>(geo.T));  // left at zero for the next launch
    }
    __syncthreads();
    const T* sx = bx + (k % geo.nbuf) * geo.tile;
    const T* sd = bd + (k % geo.nbuf) * geo.tile;
    const int64_t g0 = t.c0 / D;  // first group of the block
    if constexpr (!Bwd) {
      // Group statistics: warp per group, lanes over the T*D (tile, channel) states in order.
      for (int lg = warp; lg < gb; lg += nwarps) {
        WelfordState s = WelfordOp::identity();
        for (int64_t j0 = 0; j0 < geo.T; j0 += 8 * 32) {
          WelfordState v[8];
#pragma unroll
          for (int qq = 0; qq < 8; ++qq) {
            const int64_t j2 = j0 + qq * 32 + lane;
            const float* o = a.partial + ((t.u * geo.T + j2) * gb + lg) * 3;
            v[qq] = j2 < geo.T ? WelfordState{__ldcg(o), __ldcg(o + 1), __ldcg(o + 2)} : WelfordOp::identity();
          }
#pragma unroll
          for (int qq = 0; qq < 8; ++qq) s = welford_merge(s, v[qq]);
        }
        s = warp_reduce<WelfordOp>(s);
        if (lane == 0) {
          const float rstd = rsqrtf(fmaxf(s.m2 / s.n, 0.f) + a.eps);
          red[lg] = make_float2(s.mean, rstd);
          if (t.j == 0) {
            a.mean[t.n * G + g0 + lg] = s.mean;
            a.rstd[t.n * G + g0 + lg] = rstd;
          }
        }
      }
      __syncthreads();
      if (tid < cb) {
        const float2 st = red[tid / D];
        const int64_t c = t.c0 + tid;
        coef[tid] = make_float4(st.x, st.y * load_param(a.gamma, a.wt, c, 1.f), load_param(a.beta, a.wt, c, 0.f), 0.f);
      }
    } else {
      if (a.dsum != nullptr && t.j == 0) {  // per-channel sums over the unit's T tiles, for dgamma/dbeta
        const int parts = blockDim.x / cb, c = tid % cb, part = tid / cb;
        float2 s = Sum2Op::identity();
        if (part < parts) {
#pragma unroll 4
          for (int64_t j2 = part; j2 < geo.T; j2 += parts)
            s = Sum2Op::combine(s, __ldcg(partial2 + (t.u * geo.T + j2) * cb + c));
        }
        red[tid] = s;
        __syncthreads();
        if (tid < cb) {
          float2 r = Sum2Op::identity();
          for (int pp = 0; pp < parts; ++pp) r = Sum2Op::combine(r, red[pp * cb + tid]);
          reinterpret_cast<float2*>(a.dsum)[t.n * C + t.c0 + tid] = r;
        }
        __syncthreads();
      }
      const float inv_count = 1.f / static_cast<float>(D * HxW);
      for (int lg = warp; lg < gb; lg += nwarps) {
        float2 s = Sum2Op::identity();
#pragma unroll 4
        for (int64_t j2 = lane; j2 < geo.T; j2 += 32) s = Sum2Op::combine(s, __ldcg(gpartial2 + (t.u * geo.T + j2) * gb + lg));
        s = warp_reduce<Sum2Op>(s);
        if (lane == 0) {
          const float r = a.rstd[t.n * G + g0 + lg];
          red[cb + lg] = make_float2(-r * r * r * s.x * inv_count, -r * s.y * inv_count);
        }
      }
      __syncthreads();
      if (tid < cb) {
        const int64_t g = t.n * G + g0 + tid / D;
        const float2 c23 = red[cb + tid / D];
        coef[tid] = make_float4(a.mean[g], a.rstd[g] * load_param(a.gamma, a.wt, t.c0 + tid, 1.f), c23.x, c23.y);
      }
    }
    __syncthreads();
    if (!active) return;
    float4 k4[V];
#pragma unroll
    for (int e = 0; e < V; ++e) k4[e] = coef[q * V + e];
#pragma unroll 4
    for (int r = rl; r < t.R; r += rpi) {
      float xv[V], dv[V];
      lds_vec<T, V>(sx + (r * cpr + q) * V, xv);
      if constexpr (Bwd) lds_vec<T, V>(sd + (r * cpr + q) * V, dv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if constexpr (Bwd) {
          xv[e] = fmaf(k4[e].y, dv[e], fmaf(k4[e].z, xv[e] - k4[e].x, k4[e].w));
        } else {
          xv[e] = fmaf(xv[e] - k4[e].x, k4[e].y, k4[e].z);
        }
      }
      store_vec<T, V>(out + gofs(t, r) + q * V, xv);
    }
  };

  onepass_pipeline(geo.nbuf, geo.early, ktiles, load, publish, finish);
}

}  // namespace gn
}  // namespace gnext
