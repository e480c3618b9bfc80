// "Wide" GroupNorm forward: NCHW groups too large for the one-pass plan's shared memory (tens of MB,
// e.g. a 1x128x2048x2048 bf16 VAE map: 33.6 MB per group), read from DRAM once.
//
// One persistent launch of one CTA per SM. The N*G groups are walked one after another; CTA b owns
// elements [b * slice, (b + 1) * slice) of every group. Per group u:
//   1. statistics: the CTA has read its slice of u (Welford), kept the first `held` elements in shared
//      memory and marked the loads of the rest L2 evict_last; it publishes its partial and arrives on
//      u's counter;
//   2. after every CTA arrived: each CTA merges all partials in the same fixed order (bitwise the same
//      mean/rstd everywhere, no float atomics), then, in one loop, normalizes its slice of u from shared
//      memory and L2 (loads and stores marked evict_first), writing out = act((x - mean) * rstd * gamma +
//      beta) [+ residual], and reads its slice of u + 1 from DRAM (step 1 for u + 1, refilling the stage
//      entries just consumed).
// DRAM traffic is 1R + 1W when the part of a group beyond shared memory (grid * held) stays in L2;
// the cost is a grid-wide wait per group. Plan and limits: wide_geometry (group_norm_heuristics.h).
#pragma once
#include <type_traits>

#include "../common/device_utils.cuh"
#include "group_norm_kernels.cuh"  // load_param
#include "group_norm_launch.h"

namespace gnext {
namespace gn {

// L2 eviction-priority hints (sm_80+): an access policy for a whole access.
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 ldg_hint(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void stg_hint(void* p, const uint4& v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
}

template <typename T, int A>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_forward_kernel(OnePassArgs a, int64_t units, int64_t L, FastDivmod hw, int G, int D, int64_t slice,
                        int64_t held) {
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  extern __shared__ __align__(16) uint4 stage[];  // the first `held` elements of this CTA's slice
  __shared__ WelfordState scratch[33];
  __shared__ float2 stat;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ res = static_cast<const T*>(a.pw.residual);
  T* __restrict__ out = static_cast<T*>(a.out);
  auto* partial = reinterpret_cast<WelfordState*>(a.partial);
  const unsigned nb = gridDim.x;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t hi = min(L, lo + slice);
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  const int64_t first = lo + threadIdx.x * V;  // this thread's vectors: first, first + step, ...
  const uint64_t keep = l2_policy_evict_last(), drop = l2_policy_evict_first();

  // Statistics of a group being read: its vectors q[0..n) at element e, e + step, ... join the Welford
  // state s, and those within the first `held` elements of the slice are kept in shared memory. Every
  // thread reads back only the stage entries it wrote, so no barrier guards them.
  WelfordState s = WelfordOp::identity();
  auto absorb = [&](int64_t e, const Vec* q, auto n_tag) {
    constexpr int n = decltype(n_tag)::value;
    float v[n * V];
#pragma unroll
    for (int k = 0; k < n; ++k) {
      if (e + k * step - lo < held) stage[(e + k * step - lo) / V] = q[k].raw;
#pragma unroll
      for (int j = 0; j < V; ++j) v[k * V + j] = to_float(q[k].v[j]);
    }
    s = welford_merge(s, welford_of<n * V>(v));
  };
  using Unrolled = std::integral_constant<int, kUnroll>;
  using One = std::integral_constant<int, 1>;

  // Group 0: statistics only.
  {
    int64_t i = first;
    for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
      Vec q[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) q[k].raw = ldg_hint(x + i + k * step, keep);
      absorb(i, q, Unrolled{});
    }
    for (; i < hi; i += step) {
      Vec q;
      q.raw = ldg_hint(x + i, keep);
      absorb(i, &q, One{});
    }
  }

  for (int64_t u = 0; u < units; ++u) {
    // Group u's statistics: publish this CTA's partial, wait for every CTA's, merge them all in the same
    // order in every CTA.
    s = block_reduce<WelfordOp>(s, scratch);
    if (threadIdx.x == 0) {
      partial[u * nb + blockIdx.x] = s;
      arrive(a.counters + u);
      wait_count(a.counters + u, nb);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      WelfordState m = WelfordOp::identity();
      for (unsigned j = threadIdx.x; j < nb; j += 32) {
        const float* p = reinterpret_cast<const float*>(partial + u * nb + j);
        m = welford_merge(m, WelfordState{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)});
      }
      m = warp_reduce<WelfordOp>(m);
      if (threadIdx.x == 0) {
        const float rstd = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + a.eps);
        stat = make_float2(m.mean, rstd);
        if (blockIdx.x == 0) a.mean[u] = m.mean, a.rstd[u] = rstd;
        depart(a.counters + u, nb);
      }
    }
    __syncthreads();
    s = WelfordOp::identity();

    // Normalize group u from shared memory and L2 while reading group u + 1 from DRAM (its statistics,
    // its stage): one loop, so that the DRAM reads, the writes and the arithmetic overlap.
    const float mu = stat.x, rstd = stat.y;
    const int c0 = static_cast<int>(u % G) * D;
    const T* xu = x + u * L;
    T* ou = out + u * L;
    const T* ru = res != nullptr ? res + u * L : nullptr;
    const bool next = u + 1 < units;
    const T* xn = xu + L;
    auto fetch = [&](int64_t e) -> uint4 { return e - lo < held ? stage[(e - lo) / V] : ldg_hint(xu + e, drop); };
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
      if (ru != nullptr) {
        float rv[V];
        load_vec<T, V>(ru + e, rv);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] += rv[j];
      }
#pragma unroll
      for (int j = 0; j < V; ++j) r.v[j] = static_cast<T>(v[j]);
      stg_hint(ou + e, r.raw, drop);
    };
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
      if (next) absorb(i, q, Unrolled{});  // after the stage entries of group u were read
    }
    for (; i < hi; i += step) {
      const uint4 r = fetch(i);
      Vec q;
      if (next) q.raw = ldg_hint(xn + i, keep);
      normalize(i, r);
      if (next) absorb(i, &q, One{});
    }
  }
}

}  // namespace gn
}  // namespace gnext
