// SPDX-License-Identifier: BSD-3-Clause
// "Bulk" GroupNorm forward (sm_90+): NCHW groups of a few MB, read from DRAM once by bulk asynchronous copies
// (cp.async.bulk into shared memory, completion on mbarriers) and normalized from shared memory. Geometry:
// bulk_geometry (group_norm_plan.h); launch: group_norm_bulk.cu.
//
// One persistent CTA per SM. Group u (L = D*HxW elements) is cut into chunks of `chunk` bytes; CTA b owns chunks
// [b*nc/grid, (b+1)*nc/grid) of every group (its slice, `cnt` chunks), and its shared memory is a ring of
// `stages` chunk buffers. Warps:
//   * producer (one lane): copies the CTA's chunks of group 0, 1, ... into the ring in order, each into the next
//     stage once that stage is released; nothing else, so the copies of later groups are in flight while the
//     other warps wait or compute: the bytes in flight per SM are the free stages, not registers.
//   * consumers (`consumers` warps; chunk i of a slice belongs to warp i % consumers): for u = 0, 1, ...:
//     statistics of their chunks of group u + ahead (Welford, from shared memory; the warp's state into a
//     shared slot), then normalize their chunks of group u from shared memory once its mean/rstd are in
//     shared memory: out = act((x - mean) * rstd * gamma + beta) [+ residual]; each stage is released after
//     its normalize, so the ring holds the slices of ahead + 1 groups plus what is being copied.
//   * publisher: merges the consumer warps' states of a group (fixed order) into the CTA's partial in global
//     memory and arrives on the group's counter (release).
//   * merger: waits for a group's counter to reach grid, merges the grid's partials in the same fixed order in
//     every CTA (bitwise the same mean/rstd everywhere, no float atomics), hands mean/rstd to the consumers.
// The publisher and merger take the grid-wide chain of a group (fence, arrival, wait, merge) off the consumers:
// with ahead = 2 a group's statistics are complete two groups before they are needed.
// Handshakes inside the CTA are mbarriers: full/empty per stage; per group slot (kBulkSlots of them, a slot reused
// kBulkSlots groups later: safe while ahead <= kBulkSlots - 1) "states posted" (consumers -> publisher, count =
// consumers) and "statistics ready" (merger -> consumers, count 1).
// Deadlock freedom: every CTA is co-resident (cooperative launch); the ring holds (ahead + 1) slices, so the
// statistics of group u + ahead never wait for a stage that only the normalize of group u would release.
#pragma once
#include <type_traits>

#include "../common/device_utils.cuh"
#include "group_norm_kernels.cuh"  // load_param, warp_merge_partials
#include "group_norm_launch.h"

namespace gnext {
namespace gn {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GNEXT_BULK_SM90 1
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
#ifdef GNEXT_BULK_SM90
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
#ifdef GNEXT_BULK_SM90
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
#ifdef GNEXT_BULK_SM90
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(b)), "r"(parity)
        : "memory");
#endif
}
// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) into shared memory; `bar` completes when
// they have landed (the caller has announced them with mbar_expect_tx).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t pol) {
#ifdef GNEXT_BULK_SM90
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol)
      : "memory");
#endif
}
// arrive() with a release reduction in place of a fence and an atomic.
__device__ __forceinline__ void arrive_release(unsigned* counter) {
#ifdef GNEXT_BULK_SM90
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
#endif
}


template <typename T, int A>
__global__ void __launch_bounds__(kBulkMaxThreads, 1)
    bulk_forward_kernel(OnePassArgs a, BulkGeometry g, int64_t units, int64_t L, FastDivmod hw, int G, int D) {
#ifdef GNEXT_BULK_SM90
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int W = g.consumers;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + g.stages;
  uint64_t* posted = empty + g.stages;  // [kBulkSlots]
  uint64_t* ready = posted + kBulkSlots;  // [kBulkSlots]
  auto* wstate = reinterpret_cast<WelfordState*>(ready + kBulkSlots);  // [kBulkSlots][W]
  auto* stat = reinterpret_cast<float2*>(wstate + kBulkSlots * W);     // [kBulkSlots]
  unsigned char* ring = smem + kBulkHeader;
  const unsigned nb = gridDim.x;
  const int b = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nc = (L * static_cast<int64_t>(sizeof(T)) + g.chunk - 1) / g.chunk;  // chunks per group
  const int64_t lo = b * nc / nb, cnt = (b + 1) * nc / nb - lo;
  const int64_t E = g.chunk / static_cast<int>(sizeof(T));  // elements per chunk
  auto* partial = reinterpret_cast<WelfordState*>(a.partial);
  const T* __restrict__ x = static_cast<const T*>(a.x);

  if (threadIdx.x == 0) {
    for (int s = 0; s < g.stages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 1);
    for (int s = 0; s < kBulkSlots; ++s) mbar_init(&posted[s], W), mbar_init(&ready[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == W) {  // producer
    if (lane == 0) {
      const uint64_t pol = l2_policy_evict_first();  // read once
      const int64_t bytes_u = L * static_cast<int64_t>(sizeof(T));
      int64_t k = 0;
      for (int64_t u = 0; u < units; ++u)
        for (int64_t i = 0; i < cnt; ++i, ++k) {
          const int s = static_cast<int>(k % g.stages);
          if (k >= g.stages) mbar_wait(&empty[s], static_cast<uint32_t>((k / g.stages - 1) & 1));
          const int64_t off = (lo + i) * g.chunk;
          bulk_copy(ring + static_cast<size_t>(s) * g.chunk, reinterpret_cast<const char*>(x) + u * bytes_u + off,
                    static_cast<uint32_t>(min(static_cast<int64_t>(g.chunk), bytes_u - off)), &full[s], pol);
        }
    }
    return;
  }
  if (warp == W + 1) {  // publisher
    for (int64_t u = 0; u < units; ++u) {
      const int slot = static_cast<int>(u % kBulkSlots);
      mbar_wait(&posted[slot], static_cast<uint32_t>((u / kBulkSlots) & 1));
      WelfordState s = lane < W ? wstate[slot * W + lane] : WelfordOp::identity();
      s = warp_reduce<WelfordOp>(s);
      if (lane == 0) {
        partial[u * nb + b] = s;
        arrive_release(a.counters + u);
      }
      __syncwarp();
    }
    return;
  }
  if (warp == W + 2) {  // merger
    for (int64_t u = 0; u < units; ++u) {
      if (lane == 0) wait_count(a.counters + u, nb);
      __syncwarp();
      const WelfordState m = warp_merge_partials(partial + u * nb, nb, lane);
      if (lane == 0) {
        const float rstd = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + a.eps);
        const int slot = static_cast<int>(u % kBulkSlots);
        stat[slot] = make_float2(m.mean, rstd);
        if (b == 0) a.mean[u] = m.mean, a.rstd[u] = rstd;
        depart(a.counters + u, nb);
        mbar_arrive(&ready[slot]);
      }
      __syncwarp();
    }
    return;
  }

  // Consumers.
  const T* __restrict__ res = static_cast<const T*>(a.pw.residual);
  T* __restrict__ out = static_cast<T*>(a.out);
  const uint64_t drop = l2_policy_evict_first();
  auto stage_of = [&](int64_t u, int64_t i) { return static_cast<int>((u * cnt + i) % g.stages); };
  auto statistics = [&](int64_t u) {
    WelfordState s = WelfordOp::identity();
    for (int64_t i = warp; i < cnt; i += W) {
      const int64_t k = u * cnt + i;
      const int st = stage_of(u, i);
      mbar_wait(&full[st], static_cast<uint32_t>((k / g.stages) & 1));
      const int n = static_cast<int>(min(E, L - (lo + i) * E)) / V;
      const uint4* src = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * g.chunk);
      for (int v = lane; v < n; v += 32) {
        Vec q;
        q.raw = src[v];
        float f[V];
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = to_float(q.v[j]);
        s = welford_merge(s, welford_of<V>(f));
      }
    }
    s = warp_reduce<WelfordOp>(s);
    const int slot = static_cast<int>(u % kBulkSlots);
    if (lane == 0) {
      wstate[slot * W + warp] = s;
      mbar_arrive(&posted[slot]);
    }
  };
  auto normalize = [&](int64_t u) {
    const int slot = static_cast<int>(u % kBulkSlots);
    mbar_wait(&ready[slot], static_cast<uint32_t>((u / kBulkSlots) & 1));
    const float2 ms = stat[slot];
    const int c0 = static_cast<int>(u % G) * D;
    for (int64_t i = warp; i < cnt; i += W) {
      const int st = stage_of(u, i);
      const int64_t e0 = (lo + i) * E;  // element offset in the group
      const int n = static_cast<int>(min(E, L - e0)) / V;
      const uint4* src = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * g.chunk);
      T* ou = out + u * L + e0;
      const T* ru = res != nullptr ? res + u * L + e0 : nullptr;
      // A chunk lies in one channel unless it straddles a channel boundary: gamma/beta per chunk or per vector.
      const int ca = static_cast<int>(hw.div(static_cast<uint32_t>(e0)));
      const bool one = static_cast<int64_t>(ca + 1) * static_cast<int64_t>(hw.divisor) >= e0 + n * V;
      float scale = ms.y * load_param(a.gamma, a.wt, c0 + ca, 1.f), shift = load_param(a.beta, a.wt, c0 + ca, 0.f);
      for (int v0 = lane; v0 < n; v0 += 4 * 32) {
        uint4 r[4], rr[4];  // x from shared memory, the residual from global memory: all loads first
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (v0 + 32 * j < n) {
            r[j] = src[v0 + 32 * j];
            if (ru != nullptr) rr[j] = ldg_hint(ru + (v0 + 32 * j) * V, drop);
          }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = v0 + 32 * j;
          if (v >= n) break;
          if (!one) {
            const int c = c0 + static_cast<int>(hw.div(static_cast<uint32_t>(e0 + v * V)));
            scale = ms.y * load_param(a.gamma, a.wt, c, 1.f), shift = load_param(a.beta, a.wt, c, 0.f);
          }
          Vec q, o;
          q.raw = r[j];
          float f[V];
#pragma unroll
          for (int e = 0; e < V; ++e) f[e] = act_apply<A>(fmaf(to_float(q.v[e]) - ms.x, scale, shift));
          if (ru != nullptr) {
            Vec rv;
            rv.raw = rr[j];
#pragma unroll
            for (int e = 0; e < V; ++e) f[e] += to_float(rv.v[e]);
          }
#pragma unroll
          for (int e = 0; e < V; ++e) o.v[e] = static_cast<T>(f[e]);
          stg_hint(ou + v * V, o.raw, drop);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[st]);
    }
  };
  for (int64_t u = 0; u < min(static_cast<int64_t>(g.ahead), units); ++u) statistics(u);
  for (int64_t u = 0; u < units; ++u) {
    if (u + g.ahead < units) statistics(u + g.ahead);
    normalize(u);
  }
#endif
}

#undef GNEXT_BULK_SM90

}  // namespace gn
}  // namespace gnext
