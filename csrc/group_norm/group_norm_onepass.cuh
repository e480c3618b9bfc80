// One-pass NCHW GroupNorm kernels (forward and backward): every element of x (and dy) is read
// from DRAM once. Geometry and arguments: OnePassGeometry / OnePassArgs in group_norm_launch.h.
//
// A persistent grid of `grid` CTAs walks the tiles (tile i = k * grid + blockIdx.x). A CTA keeps
// `nbuf` tiles in shared memory (cp.async stages). For its k-th tile it
//   1. publishes the statistics of its (k+1)-th tile (already in shared memory): a Welford state
//      (forward) or per-channel (sum dy*(x - mean), sum dy) (backward) to `partial` in global
//      memory, then increments the group's counter;
//   2. waits until the counter of the k-th tile's group reaches T (all of its tiles published),
//      merges the group's partials in a fixed order (every CTA of the group computes the same
//      bits; no float atomics), and normalizes the tile from shared memory;
//   3. starts copying its (k+nbuf)-th tile into the freed stage.
// Deadlock freedom: a group's T <= grid tiles lie in at most two consecutive waves k, k+1, and
// every CTA publishes wave k+1 before it waits on wave k; all CTAs are co-resident (cooperative
// launch), so the waits of wave k end once wave k-1's have. With nbuf == 1 every CTA has one tile.
#pragma once
#include "../common/device_utils.cuh"
#include "group_norm_launch.h"

namespace gnext {
namespace gn {

__device__ __forceinline__ float load_param(const void* p, ScalarKind k, int64_t c, float dflt) {
  if (p == nullptr) return dflt;
  switch (k) {
    case ScalarKind::Half:
      return to_float(static_cast<const c10::Half*>(p)[c]);
    case ScalarKind::BFloat16:
      return to_float(static_cast<const c10::BFloat16*>(p)[c]);
    default:
      return static_cast<const float*>(p)[c];
  }
}

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

template <typename T, int V, bool Bwd>
__global__ void __launch_bounds__(kOnePassThreads, 1)
    onepass_nchw_kernel(OnePassArgs a, OnePassGeometry geo, int64_t G, int64_t D, int64_t HxW, int64_t ntiles,
                        FastDivmod hwv) {
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

  // Statistics of the k-th tile (in shared memory) to `partial`; then the group's counter.
  auto publish = [&](int64_t k) {
    const OnePassTile t = tile_k(k);
    if (!t.valid) return;
    const T* sx = bx + (k % geo.nbuf) * geo.tile;
    const T* sd = bd + (k % geo.nbuf) * geo.tile;
    const uint32_t nvec = t.len / V;
    if constexpr (!Bwd) {
      WelfordState s = WelfordOp::identity();
      for (uint32_t v = tid; v < nvec; v += blockDim.x) {
        float xv[V];
        lds_vec<T, V>(sx + v * V, xv);
        s = welford_merge(s, welford_of<V>(xv));
      }
      s = block_reduce<WelfordOp>(s, wscratch);
      if (tid == 0) {
        float* q = a.partial + (blockIdx.x + k * P) * 3;
        q[0] = s.mean, q[1] = s.m2, q[2] = s.n;
      }
    } else {
      const float mu = a.mean[t.u];
      auto acc = [&](float2& s, uint32_t v) {
        float xv[V], dv[V];
        lds_vec<T, V>(sx + v * V, xv);
        lds_vec<T, V>(sd + v * V, dv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          s.x = fmaf(dv[e], xv[e] - mu, s.x);
          s.y += dv[e];
        }
      };
      float2* q = partial2 + (t.u * D + t.d0) * geo.sub + t.piece;
      if (t.nch == 1) {
        float2 s = Sum2Op::identity();
        for (uint32_t v = tid; v < nvec; v += blockDim.x) acc(s, v);
        s = block_reduce<Sum2Op>(s, sscratch);
        if (tid == 0) *q = s;
      } else {
        const uint32_t hv = static_cast<uint32_t>(HxW / V);
        if (t.nch <= nwarps) {  // wpc warps per channel, combined through shared memory
          const int wpc = nwarps / t.nch;
          float2 s = Sum2Op::identity();
          if (warp < t.nch * wpc) {
            const uint32_t ch = warp / wpc, part = warp % wpc;
            for (uint32_t v = part * 32 + lane; v < hv; v += wpc * 32) acc(s, ch * hv + v);
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
            for (uint32_t v = lane; v < hv; v += 32) acc(s, ch * hv + v);
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
    if (a.counters != nullptr && tid == 0) wait_count(&a.counters[t.u], static_cast<unsigned>(geo.T));
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
#pragma unroll 4
      for (uint32_t v = tid; v < nvec; v += blockDim.x) {
        if (t.nch > 1) {
          const int64_t c = c0 + hwv.div(v);
          scale = rstd * load_param(a.gamma, a.wt, c, 1.f);
          shift = load_param(a.beta, a.wt, c, 0.f);
        }
        float xv[V];
        lds_vec<T, V>(sx + v * V, xv);
#pragma unroll
        for (int e = 0; e < V; ++e) xv[e] = fmaf(xv[e] - mu, scale, shift);
        store_vec<T, V>(out + t.start + v * V, xv);
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
#pragma unroll 4
      for (uint32_t v = tid; v < nvec; v += blockDim.x) {
        if (t.nch > 1) scale = r * load_param(a.gamma, a.wt, c0 + hwv.div(v), 1.f);
        float xv[V], dv[V];
        lds_vec<T, V>(sx + v * V, xv);
        lds_vec<T, V>(sd + v * V, dv);
#pragma unroll
        for (int e = 0; e < V; ++e) xv[e] = fmaf(scale, dv[e], fmaf(c2, xv[e] - mu, c3));
        store_vec<T, V>(out + t.start + v * V, xv);
      }
    }
  };

  for (int b = 0; b < geo.nbuf; ++b) load(b);
  cp_async_wait_dyn(geo.nbuf - 1);
  __syncthreads();
  publish(0);
  for (int64_t k = 0; k < ktiles; ++k) {
    if (geo.nbuf > 1) {
      cp_async_wait_dyn(geo.nbuf - 2);  // the (k+1)-th tile has arrived
      __syncthreads();
      publish(k + 1);
    }
    finish(k);
    __syncthreads();  // stage k % nbuf is free
    load(k + geo.nbuf);
  }
  cp_async_wait<0>();
}

}  // namespace gn
}  // namespace gnext
