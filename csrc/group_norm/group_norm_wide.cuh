// SPDX-License-Identifier: BSD-3-Clause
// "Wide" GroupNorm forward and backward: NCHW groups too large for the one-pass plan's shared memory (tens
// of MB, e.g. a 1x128x2048x2048 bf16 VAE map: 33.6 MB per group), read from DRAM once. The forward is
// described here; the backward (wide_backward_kernel, below) follows the same schedule with x and dy.
//
// One persistent launch of one CTA per SM. The N*G groups are walked one after another; CTA b owns
// elements [b * slice, (b + 1) * slice) of every group. Per group u:
//   1. statistics: the CTA reads its slice of u (Welford), keeps the first `held` elements in shared
//      memory, marks the loads of the rest L2 evict_last, publishes its partial and arrives on u's counter
//      without waiting;
//   2. after every CTA arrived: each CTA merges all partials in the same fixed order (bitwise the same
//      mean/rstd everywhere, no float atomics), then, in one loop, normalizes its slice of u from shared
//      memory and L2 (loads and stores marked evict_first), writing out = act((x - mean) * rstd * gamma +
//      beta) [+ residual], and reads its slice of group u + 1 + ahead from DRAM (step 1 for that group,
//      refilling the stage entries just consumed).
// With ahead = 0, a CTA that has read group u waits there for the slowest CTA's read of u: the DRAM stream
// stops once per group. With ahead = 1 (two stage buffers, each half the shared memory) group u + 1 has
// been read before u's wait, so the partials of u are complete by then in all but a lagging CTA.
// Forward DRAM traffic is 1R + 1W when the part of a group beyond shared memory (grid * held) stays in L2.
// Plan and limits: wide_geometry (group_norm_plan.h).
#pragma once
#include <type_traits>

#include "../common/device_utils.cuh"
#include "group_norm_kernels.cuh"  // load_param, warp_merge_partials
#include "group_norm_launch.h"

namespace gnext {
namespace gn {

// The two loops of the wide forward kernels over a CTA's part of a unit: elements first, first + step, ... below
// hi, kUnroll 16-byte vectors at a time. absorb(buf, e, q, n_tag) takes n vectors of x read at e, e + step, ...
// (statistics, and the stage entries of buf).
using WideUnrolled = std::integral_constant<int, kUnroll>;
using WideOne = std::integral_constant<int, 1>;

// Statistics only: reads unit xv.
template <typename T, typename Absorb>
__device__ __forceinline__ void wide_read(const T* xv, int64_t first, int64_t hi, int64_t step, uint4* buf,
                                          uint64_t keep, Absorb&& absorb) {
  using Vec = Pack<T, 16 / sizeof(T)>;
  int64_t i = first;
  for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
    Vec q[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) q[k].raw = ldg_hint(xv + i + k * step, keep);
    absorb(buf, i, q, WideUnrolled{});
  }
  for (; i < hi; i += step) {
    Vec q;
    q.raw = ldg_hint(xv + i, keep);
    absorb(buf, i, &q, WideOne{});
  }
}

// One loop that normalizes a unit (fetch(e): its vector at e from shared memory or L2; normalize(e, raw)) and,
// if next, reads unit xn (absorb, after the stage entries were fetched), so that DRAM reads, writes and
// arithmetic overlap.
template <typename T, typename Fetch, typename Normalize, typename Absorb>
__device__ __forceinline__ void wide_stream(int64_t first, int64_t hi, int64_t step, bool next, const T* xn, uint4* buf,
                                            uint64_t keep, Fetch&& fetch, Normalize&& normalize, Absorb&& absorb) {
  using Vec = Pack<T, 16 / sizeof(T)>;
  int64_t i = first;
  for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
    uint4 r[kUnroll];
    Vec q[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) r[k] = fetch(i + k * step);
    if (next) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) q[k].raw = ldg_hint(xn + i + k * step, keep);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) normalize(i + k * step, r[k]);
    if (next) absorb(buf, i, q, WideUnrolled{});
  }
  for (; i < hi; i += step) {
    const uint4 r = fetch(i);
    Vec q;
    if (next) q.raw = ldg_hint(xn + i, keep);
    normalize(i, r);
    if (next) absorb(buf, i, &q, WideOne{});
  }
}

// out[e, e + V) = v (+ residual[e, e + V) if ru) as T, stored with the L2 hint `drop`.
template <typename T>
__device__ __forceinline__ void wide_store(T* ou, const T* ru, int64_t e, float* v, uint64_t drop) {
  constexpr int V = 16 / sizeof(T);
  if (ru != nullptr) {
    float rv[V];
    load_vec<T, V>(ru + e, rv);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] += rv[j];
  }
  Pack<T, V> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = static_cast<T>(v[j]);
  stg_hint(ou + e, r.raw, drop);
}

template <typename T, int A>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_forward_kernel(OnePassArgs a, int64_t units, int64_t L, FastDivmod hw, int G, int D, int64_t slice,
                        int64_t held, int ahead) {
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  // 1 + ahead buffers, each the first `held` elements of this CTA's slice of one group (group v: buffer v % nbuf)
  extern __shared__ __align__(16) uint4 stage[];
  __shared__ WelfordState scratch[33];
  __shared__ float2 stat;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ res = static_cast<const T*>(a.pw.residual);
  T* __restrict__ out = static_cast<T*>(a.out);
  auto* partial = reinterpret_cast<WelfordState*>(a.partial);
  const unsigned nb = gridDim.x;
  const int nbuf = 1 + ahead;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t hi = min(L, lo + slice);
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  const int64_t first = lo + threadIdx.x * V;  // this thread's vectors: first, first + step, ...
  const uint64_t keep = l2_policy_evict_last(), drop = l2_policy_evict_first();
  auto buffer = [&](int64_t v) { return stage + (v % nbuf) * (held / V); };

  // Statistics of a group being read: its vectors q[0..n) at element e, e + step, ... join the Welford
  // state s, and those within the first `held` elements of the slice are kept in shared memory (buf). Every
  // thread reads back only the stage entries it wrote, so no barrier guards them.
  WelfordState s = WelfordOp::identity();
  auto absorb = [&](uint4* buf, int64_t e, const Vec* q, auto n_tag) {
    constexpr int n = decltype(n_tag)::value;
    float v[n * V];
#pragma unroll
    for (int k = 0; k < n; ++k) {
      if (e + k * step - lo < held) buf[(e + k * step - lo) / V] = q[k].raw;
#pragma unroll
      for (int j = 0; j < V; ++j) v[k * V + j] = to_float(q[k].v[j]);
    }
    s = welford_merge(s, welford_of<n * V>(v));
  };
  // Publish this CTA's partial of group v (no wait: that comes when group v is normalized).
  auto publish = [&](int64_t v) {
    s = block_reduce<WelfordOp>(s, scratch);
    if (threadIdx.x == 0) {
      partial[v * nb + blockIdx.x] = s;
      arrive(a.counters + v);
    }
    s = WelfordOp::identity();
  };

  // Groups 0 .. ahead: statistics only.
  for (int64_t v = 0; v < min(static_cast<int64_t>(nbuf), units); ++v) {
    wide_read(x + v * L, first, hi, step, buffer(v), keep, absorb);
    publish(v);
  }

  for (int64_t u = 0; u < units; ++u) {
    // Group u's statistics: wait for every CTA's partial (published a group or two ago), merge them all in
    // the same order in every CTA.
    if (threadIdx.x == 0) wait_count(a.counters + u, nb);
    __syncthreads();
    if (threadIdx.x < 32) {
      const WelfordState m = warp_merge_partials(partial + u * nb, nb, threadIdx.x);
      if (threadIdx.x == 0) {
        const float rstd = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + a.eps);
        stat = make_float2(m.mean, rstd);
        if (blockIdx.x == 0) a.mean[u] = m.mean, a.rstd[u] = rstd;
        depart(a.counters + u, nb);
      }
    }
    __syncthreads();

    // Normalize group u from shared memory and L2 while reading group w = u + nbuf from DRAM (its
    // statistics, and its stage: the same buffer, refilled entry by entry as group u's are consumed): one
    // loop, so that the DRAM reads, the writes and the arithmetic overlap.
    const float mu = stat.x, rstd = stat.y;
    const int c0 = static_cast<int>(u % G) * D;
    const T* xu = x + u * L;
    T* ou = out + u * L;
    const T* ru = res != nullptr ? res + u * L : nullptr;
    const int64_t w = u + nbuf;
    const bool next = w < units;
    const T* xn = x + w * L;
    uint4* const buf = buffer(u);
    auto fetch = [&](int64_t e) -> uint4 { return e - lo < held ? buf[(e - lo) / V] : ldg_hint(xu + e, drop); };
    // A slice spans one or two channels: gamma and beta are loaded when the channel changes.
    int64_t cc = -1;
    float scale = 0.f, shift = 0.f;
    auto normalize = [&](int64_t e, const uint4& raw) {
      const int64_t c = c0 + hw.div(static_cast<uint32_t>(e));
      if (c != cc) {
        cc = c;
        scale = rstd * load_param(a.gamma, a.wt, c, 1.f);
        shift = load_param(a.beta, a.wt, c, 0.f);
      }
      Vec r;
      r.raw = raw;
      float v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = act_apply<A>(fmaf(to_float(r.v[j]) - mu, scale, shift));
      wide_store(ou, ru, e, v, drop);
    };
    wide_stream(first, hi, step, next, xn, buf, keep, fetch, normalize, absorb);
    if (next) publish(w);
  }
}

// Channels_last variant of the wide forward (wide_nhwc_geometry): the units are images, L = HxW * C elements
// contiguous in NHWC memory with all G groups interleaved; CTA b owns rows [b * slice / C, (b + 1) * slice / C)
// of every image. blockDim.x = rps * CV (CV = C / V vectors per row, rps rows per step of blockDim.x * V
// elements), so thread t always holds the channels c0 .. c0 + V - 1, c0 = (t % CV) * V: their groups (at most two
// per vector: the plan checks) and gamma/beta are the same in every row. Per image u:
//   1. statistics: per channel sums of x - x0 and (x - x0)^2 in registers (x0: the thread's first vector of u),
//      folded into a Welford state per group at the end (each channel's mean moved by a.in_shift[c] where
//      given); the CTA's state of each group (a warp per group, fixed order) to partial[(u * G + g) * grid + b];
//      arrive on u's counter;
//   2. after every CTA arrived: each CTA merges the grid partials of each group (same order everywhere), then
//      normalizes its rows of u from shared memory / L2 while reading its rows of image u + 1 + ahead (step 1).
// Dynamic shared memory: (1 + ahead) stage buffers of `held` elements, then blockDim.x * 2 Welford states and
// G float2 (mean, rstd).
template <typename T, int A>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_nhwc_forward_kernel(OnePassArgs a, int64_t units, int64_t L, int C, int G, int D, int64_t slice,
                             int64_t held, int ahead) {
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  extern __shared__ __align__(16) uint4 stage[];
  const int nbuf = 1 + ahead;
  auto* slots = reinterpret_cast<WelfordState*>(stage + nbuf * (held / V));  // [thread][2]
  auto* stat = reinterpret_cast<float2*>(slots + 2 * blockDim.x);           // [G]
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ res = static_cast<const T*>(a.pw.residual);
  T* __restrict__ out = static_cast<T*>(a.out);
  auto* partial = reinterpret_cast<WelfordState*>(a.partial);
  const unsigned nb = gridDim.x;
  const int CV = C / V, rps = blockDim.x / CV;
  const int c0 = (threadIdx.x % CV) * V;
  const int ga = c0 / D, gb = (c0 + V - 1) / D;  // groups of the vector's first and last channel
  const int split = gb != ga ? gb * D - c0 : V;  // channels j < split are in ga, the others in gb
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t hi = min(L, lo + slice);
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  const int64_t first = lo + threadIdx.x * V;
  const uint64_t keep = l2_policy_evict_last(), drop = l2_policy_evict_first();
  auto buffer = [&](int64_t v) { return stage + (v % nbuf) * (held / V); };
  // Per-group reductions of the CTA: tpg lanes per group (a power of two up to 32, G * tpg <= blockDim.x), lane
  // li of group g folds items li, li + tpg, ... (part(g, li)), then the group's lanes merge by xor shuffles in a
  // fixed pattern (the same result in every CTA and run) and its first lane calls done(g, state).
  int tpg = 32;
  while (tpg > 1 && G * tpg > static_cast<int>(blockDim.x)) tpg >>= 1;
  auto for_groups = [&](auto&& part, auto&& done) {
    const int per_round = blockDim.x / tpg, li = threadIdx.x % tpg;
    for (int g0 = 0; g0 < G; g0 += per_round) {  // the same trip count for every thread (shuffles below)
      const int g = g0 + static_cast<int>(threadIdx.x) / tpg;
      WelfordState m = g < G ? part(g, li) : WelfordOp::identity();
      for (int k = 1; k < tpg; k <<= 1) {
        const WelfordState o{__shfl_xor_sync(0xffffffffu, m.mean, k), __shfl_xor_sync(0xffffffffu, m.m2, k),
                             __shfl_xor_sync(0xffffffffu, m.n, k)};
        m = welford_merge(m, o);
      }
      if (g < G && li == 0) done(g, m);
    }
  };

  // Statistics of x + a.in_shift[c] where given: each channel's mean moves by its shift, its M2 does not.
  float in_shift[V];
#pragma unroll
  for (int j = 0; j < V; ++j) in_shift[j] = load_param(a.in_shift.p, a.in_shift.t, c0 + j, 0.f);
  float sh[V], s1[V], s2[V];
  int cnt = 0;
  auto reset = [&] {
#pragma unroll
    for (int j = 0; j < V; ++j) sh[j] = 0.f, s1[j] = 0.f, s2[j] = 0.f;
    cnt = 0;
  };
  reset();
  auto absorb = [&](uint4* buf, int64_t e, const Vec* q, auto n_tag) {
    constexpr int n = decltype(n_tag)::value;
    if (cnt == 0) {
#pragma unroll
      for (int j = 0; j < V; ++j) sh[j] = to_float(q[0].v[j]);
    }
#pragma unroll
    for (int k = 0; k < n; ++k) {
      if (e + k * step - lo < held) buf[(e + k * step - lo) / V] = q[k].raw;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = to_float(q[k].v[j]) - sh[j];
        s1[j] += d;
        s2[j] = fmaf(d, d, s2[j]);
      }
    }
    cnt += n;
  };
  // The CTA's state of every group of image v to partial, then arrive (no wait).
  auto publish = [&](int64_t v) {
    WelfordState sa = WelfordOp::identity(), sb = WelfordOp::identity();
    if (cnt > 0) {
      const float n = static_cast<float>(cnt);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float m = s1[j] / n;
        const WelfordState st{sh[j] + m + in_shift[j], fmaxf(s2[j] - s1[j] * m, 0.f), n};
        if (j < split) {
          sa = welford_merge(sa, st);
        } else {
          sb = welford_merge(sb, st);
        }
      }
    }
    slots[2 * threadIdx.x] = sa;
    slots[2 * threadIdx.x + 1] = sb;
    __syncthreads();
    // Group g: the vectors cva .. cvb of every row lane (slot 0 where g is the vector's first group).
    for_groups([&](int g, int li) {
      const int cva = g * D / V, nv = ((g + 1) * D - 1) / V - cva + 1;
      WelfordState m = WelfordOp::identity();
      for (int i = li; i < nv * rps; i += tpg) {
        const int cv = cva + i % nv, t = (i / nv) * CV + cv;
        m = welford_merge(m, slots[2 * t + ((cv * V) / D == g ? 0 : 1)]);
      }
      return m;
    }, [&](int g, const WelfordState& m) {
      partial[(v * G + g) * nb + blockIdx.x] = m;
      __threadfence();
    });
    __syncthreads();  // the partials written; the slots free again
    if (threadIdx.x == 0) arrive(a.counters + v);
    reset();
  };

  // Images 0 .. ahead: statistics only.
  for (int64_t v = 0; v < min(static_cast<int64_t>(nbuf), units); ++v) {
    wide_read(x + v * L, first, hi, step, buffer(v), keep, absorb);
    publish(v);
  }

  for (int64_t u = 0; u < units; ++u) {
    if (threadIdx.x == 0) wait_count(a.counters + u, nb);
    __syncthreads();
    // Every group's statistics from the grid partials (tpg lanes per group, 8 loads in flight each).
    for_groups([&](int g, int li) {
      const WelfordState* pg = partial + (u * G + g) * nb;
      WelfordState m = WelfordOp::identity();
      for (unsigned j0 = li; j0 < nb; j0 += 8 * tpg) {
        WelfordState q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float* p = reinterpret_cast<const float*>(pg + j0 + k * tpg);
          q[k] = j0 + k * tpg < nb ? WelfordState{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)} : WelfordOp::identity();
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) m = welford_merge(m, q[k]);
      }
      return m;
    }, [&](int g, const WelfordState& m) {
      const float rstd = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + a.eps);
      stat[g] = make_float2(m.mean, rstd);
      if (blockIdx.x == 0) a.mean[u * G + g] = m.mean, a.rstd[u * G + g] = rstd;
    });
    __syncthreads();
    if (threadIdx.x == 0) depart(a.counters + u, nb);
    // This thread's channels: out = act((x - mean) * rstd * gamma + beta).
    float mu[V], scale[V], shift[V];
    {
      const float2 fa = stat[ga], fb = stat[gb];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float2 f = j < split ? fa : fb;
        mu[j] = f.x - in_shift[j];  // (x + shift - mean) = x - (mean - shift)
        scale[j] = f.y * load_param(a.gamma, a.wt, c0 + j, 1.f);
        shift[j] = load_param(a.beta, a.wt, c0 + j, 0.f);
      }
    }
    const T* xu = x + u * L;
    T* ou = out + u * L;
    const T* ru = res != nullptr ? res + u * L : nullptr;
    const int64_t w = u + nbuf;
    const bool next = w < units;
    const T* xn = x + w * L;
    uint4* const buf = buffer(u);
    auto fetch = [&](int64_t e) -> uint4 { return e - lo < held ? buf[(e - lo) / V] : ldg_hint(xu + e, drop); };
    auto normalize = [&](int64_t e, const uint4& raw) {
      Vec r;
      r.raw = raw;
      float v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = act_apply<A>(fmaf(to_float(r.v[j]) - mu[j], scale[j], shift[j]));
      wide_store(ou, ru, e, v, drop);
    };
    wide_stream(first, hi, step, next, xn, buf, keep, fetch, normalize, absorb);
    if (next) publish(w);
  }
}

// Backward of the same schedule: per group u (mean and rstd known from the forward), the CTA's slice of x
// and dy gives the per-channel sums (sum dy'*(x - mean), sum dy') of the slice's first and second channel
// (slice <= HxW: at most two), dy' = dy * act'(n) with an output activation. After the grid-wide wait every
// CTA merges all partials into the group's A = sum_c gamma_c * sum dy'*(x-mean) and B = sum_c gamma_c *
// sum dy' (same order everywhere) and writes dx = rstd*gamma_c*dy' + c2*(x - mean) + c3, c2 = -rstd^3*A/M,
// c3 = -rstd*B/M (M = D*HxW), from shared memory / L2, while reading group u + 1. CTA b also sums the
// partials of channels b, b + grid, ... of the group into dsum (for dgamma/dbeta, a second kernel).
// DRAM 2R + 1W (two-pass: 4R + 1W).
template <typename T, int A>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_backward_kernel(OnePassArgs a, int64_t units, int64_t L, FastDivmod hw, int64_t HxW, int G, int D,
                         int64_t slice, int64_t held) {
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  extern __shared__ __align__(16) uint4 stage[];  // x: held / V vectors, then dy: held / V vectors
  uint4* const stage_dy = stage + held / V;
  __shared__ float2 scratch[33];
  __shared__ float4 coefs;  // (mean, c2, rstd, c3) of the current group
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ dy = static_cast<const T*>(a.dy);
  T* __restrict__ dx = static_cast<T*>(a.out);
  auto* partial = reinterpret_cast<float4*>(a.partial);
  auto* dsum = reinterpret_cast<float2*>(a.dsum);
  const unsigned nb = gridDim.x;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t hi = min(L, lo + slice);
  const int64_t d_lo = lo < L ? hw.div(static_cast<uint32_t>(lo)) : 0;  // the slice's first channel in the group
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  const int64_t first = lo + threadIdx.x * V;
  const int64_t C = static_cast<int64_t>(G) * D;
  const uint64_t keep = l2_policy_evict_last(), drop = l2_policy_evict_first();

  // Per group u: mean, rstd; with an activation, dy' needs n = (x - mean) * rstd * gamma + beta.
  float mu = 0.f, r = 0.f;
  int64_t c0 = 0;
  auto setup = [&](int64_t u) {
    mu = a.mean[u], r = a.rstd[u];
    c0 = (u % G) * D;
  };
  // dy' and x - mean of one vector at element e (channel c).
  auto grads = [&](int64_t c, const uint4& xr, const uint4& dr, float* xm, float* dd) {
    float sg = 0.f, sb = 0.f;
    if constexpr (A != kActIdentity) {
      sg = r * load_param(a.gamma, a.wt, c, 1.f);
      sb = load_param(a.beta, a.wt, c, 0.f);
    }
    vec_grads<T, A>(xr, dr, mu, sg, sb, xm, dd);
  };
  // Statistics of the group being read: sums of the slice's first (s0) and second (s1) channel.
  float2 s0 = {0.f, 0.f}, s1 = {0.f, 0.f};
  auto absorb = [&](int64_t e, const uint4& xr, const uint4& dr) {
    if (e - lo < held) {
      stage[(e - lo) / V] = xr;
      stage_dy[(e - lo) / V] = dr;
    }
    const int64_t d = hw.div(static_cast<uint32_t>(e));
    float xm[V], dd[V];
    grads(c0 + d, xr, dr, xm, dd);
    add_grad_sums<V>(xm, dd, d == d_lo, s0, s1);
  };

  setup(0);
  {
    int64_t i = first;
    for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
      uint4 xr[kUnroll], dr[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        xr[k] = ldg_hint(x + i + k * step, keep);
        dr[k] = ldg_hint(dy + i + k * step, keep);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) absorb(i + k * step, xr[k], dr[k]);
    }
    for (; i < hi; i += step) absorb(i, ldg_hint(x + i, keep), ldg_hint(dy + i, keep));
  }

  for (int64_t u = 0; u < units; ++u) {
    const float2 t0 = block_reduce<Sum2Op>(s0, scratch);
    const float2 t1 = block_reduce<Sum2Op>(s1, scratch);
    if (threadIdx.x == 0) {
      partial[u * nb + blockIdx.x] = make_float4(t0.x, t0.y, t1.x, t1.y);
      arrive(a.counters + u);
      wait_count(a.counters + u, nb);
    }
    __syncthreads();
    auto part = [&](unsigned j) {
      const float* q = reinterpret_cast<const float*>(partial + u * nb + j);
      return make_float4(__ldcg(q), __ldcg(q + 1), __ldcg(q + 2), __ldcg(q + 3));
    };
    if (threadIdx.x < 32) {  // warp 0: the group's A and B
      float2 ab = {0.f, 0.f};
      for (unsigned j = threadIdx.x; j < nb; j += 32) {
        const float4 q = part(j);
        const int64_t d = hw.div(static_cast<uint32_t>(j * slice));
        const float w0 = load_param(a.gamma, a.wt, c0 + d, 1.f);
        const float w1 = d + 1 < D ? load_param(a.gamma, a.wt, c0 + d + 1, 1.f) : 0.f;
        ab.x = fmaf(w0, q.x, fmaf(w1, q.z, ab.x));
        ab.y = fmaf(w0, q.y, fmaf(w1, q.w, ab.y));
      }
      ab = warp_reduce<Sum2Op>(ab);
      if (threadIdx.x == 0) {
        const float inv_m = 1.f / static_cast<float>(L);
        coefs = make_float4(mu, -r * r * r * ab.x * inv_m, r, -r * ab.y * inv_m);
      }
    } else if (threadIdx.x < 64 && dsum != nullptr) {  // warp 1: dsum of channels blockIdx.x, + grid, ...
      const int lane = threadIdx.x - 32;
      for (int64_t d = blockIdx.x; d < D; d += nb) {
        const int64_t b0 = d * HxW / slice, b1 = ::min(static_cast<int64_t>(nb) - 1, ((d + 1) * HxW - 1) / slice);
        float2 t = {0.f, 0.f};
        for (int64_t j = b0 + lane; j <= b1; j += 32) {
          const float4 q = part(static_cast<unsigned>(j));
          const bool second = hw.div(static_cast<uint32_t>(j * slice)) != d;
          t.x += second ? q.z : q.x;
          t.y += second ? q.w : q.y;
        }
        t = warp_reduce<Sum2Op>(t);
        if (lane == 0) dsum[(u / G) * C + c0 + d] = t;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) depart(a.counters + u, nb);
    const float4 k = coefs;
    const float c2 = k.y, c3 = k.w;
    const T* xu = x + u * L;
    const T* du = dy + u * L;
    T* ou = dx + u * L;
    const int64_t cu = c0;
    const bool next = u + 1 < units;
    s0 = s1 = make_float2(0.f, 0.f);
    if (next) setup(u + 1);
    const float mu_u = k.x, r_u = k.z;
    // dx of one vector of group u (channel cu + d): dy' from x, dy and group u's statistics.
    int64_t cc = -1;
    float scale = 0.f, sg = 0.f, sb = 0.f;
    auto write_dx = [&](int64_t e, const uint4& xr, const uint4& dr) {
      const int64_t c = cu + hw.div(static_cast<uint32_t>(e));
      if (c != cc) {
        cc = c;
        const float w = load_param(a.gamma, a.wt, c, 1.f);
        scale = r_u * w;
        sg = scale;
        sb = load_param(a.beta, a.wt, c, 0.f);
      }
      Vec xv, dv, o;
      xv.raw = xr, dv.raw = dr;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xm = to_float(xv.v[j]) - mu_u;
        const float d = act_dy<A>(to_float(dv.v[j]), xm, sg, sb);
        o.v[j] = static_cast<T>(fmaf(scale, d, fmaf(c2, xm, c3)));
      }
      stg_hint(ou + e, o.raw, drop);
    };
    auto fetch = [&](const T* base, const uint4* st, int64_t e) -> uint4 {
      return e - lo < held ? st[(e - lo) / V] : ldg_hint(base + e, drop);
    };
    const T* xn = xu + L;
    const T* dn = du + L;
    int64_t i = first;
    for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
      uint4 xr[kUnroll], dr[kUnroll], xq[kUnroll], dq[kUnroll];
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
        xr[q] = fetch(xu, stage, i + q * step);
        dr[q] = fetch(du, stage_dy, i + q * step);
      }
      if (next) {
#pragma unroll
        for (int q = 0; q < kUnroll; ++q) {
          xq[q] = ldg_hint(xn + i + q * step, keep);
          dq[q] = ldg_hint(dn + i + q * step, keep);
        }
      }
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) write_dx(i + q * step, xr[q], dr[q]);
      if (next) {
#pragma unroll
        for (int q = 0; q < kUnroll; ++q) absorb(i + q * step, xq[q], dq[q]);  // after group u's stage was read
      }
    }
    for (; i < hi; i += step) {
      const uint4 xr = fetch(xu, stage, i), dr = fetch(du, stage_dy, i);
      uint4 xq{}, dq{};
      if (next) xq = ldg_hint(xn + i, keep), dq = ldg_hint(dn + i, keep);
      write_dx(i, xr, dr);
      if (next) absorb(i, xq, dq);
    }
  }
}

}  // namespace gn
}  // namespace gnext
