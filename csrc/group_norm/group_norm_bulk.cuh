// SPDX-License-Identifier: BSD-3-Clause
// "Bulk" GroupNorm forward and backward (sm_90+): NCHW groups of a few MB, read from DRAM once by bulk asynchronous
// copies (cp.async.bulk into shared memory, completion on mbarriers) and normalized from shared memory. Geometry:
// bulk_geometry (group_norm_plan.h); launch: group_norm_bulk.cu. The forward is described here, the backward
// (same warps and handshakes, x and dy in each stage) above bulk_backward_kernel.
//
// One persistent CTA per SM, in teams of g.team CTAs (the forward; one team of every CTA in the backward): team t
// takes groups t, t + teams, ... Group u (L = D*HxW elements) is cut into chunks of `chunk` bytes; CTA b of its team
// owns chunks [b*nc/team, (b+1)*nc/team) of each of the team's groups (its slice, `cnt` chunks), and its shared
// memory is a ring of `stages` chunk buffers. Below, "group 0, 1, ..." counts the team's groups and "the grid" is
// the team. Warps:
//   * producer (one lane): copies the CTA's chunks of group 0, 1, ... into the ring in order, each into the next
//     stage once that stage is released; nothing else, so the copies of later groups are in flight while the
//     other warps wait or compute: the bytes in flight per SM are the free stages, not registers.
//   * consumers (`consumers` warps; a chunk is cut into `parts` parts of 4 KiB, and part h of chunk i of a slice
//     belongs to warp (i * parts + h) % consumers: a copy of several parts costs the producer about what a copy of
//     one does, and the consumers keep 4 KiB each): for u = 0, 1, ...:
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
// statistics of group u + ahead never wait for a stage that only the normalize of group u would release. Groups
// whose slices the ring does not hold twice are streamed (BulkStages): part of each slice is held, the rest is
// released after the statistics and read again from L2 by the normalize.
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
// The producer's arrival on `bar`, announcing `bytes` of copies that complete on it.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef GNEXT_BULK_SM90
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) into shared memory; `bar` completes when
// they have landed (announced by mbar_expect_tx).
__device__ __forceinline__ void bulk_copy_tx(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t pol) {
#ifdef GNEXT_BULK_SM90
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol)
      : "memory");
#endif
}
// A ring stage and how many times it was filled before (its barriers' phase).
struct StageUse {
  int st;
  int64_t use;
};

// Where chunk i of group u's slice (cnt chunks) lives. Retained (!g.stream): a ring of g.stages in order, every
// chunk kept until the group is normalized (its dx written). Streamed (g.stream): chunks i < hold in a held region
// of (ahead + 1) * hold stages (group u in part u % (ahead + 1)), kept until then; the others pass through the
// remaining S stages, released after the statistics and read again from L2 (copied with an evict-last hint).
// use: how many times the stage was filled before. A consumer waits for a use by its parity, so a stage must never
// be two uses ahead of a waiter: in the held region and the retained ring the look-ahead guarantees it; streamed
// stages are refilled as soon as the statistics release them, so each is private to the one warp (group of `parts`
// warps: W counts groups) that takes its chunks (chunk i -> group i % W: the streaming groups' own rings of
// P = S / min(W, cnt - hold) stages each).
struct BulkStages {
  bool stream;
  int stages, H, R, S, P, W;
  int64_t cnt;
  __device__ BulkStages(const BulkGeometry& g, int64_t cnt_, int W_)
      : stream(g.stream), stages(g.stages), H(g.stream ? g.hold : 0), R(g.ahead + 1),
        S(g.stages - (g.stream ? (g.ahead + 1) * g.hold : 0)), P(0), W(W_), cnt(cnt_) {
    const int64_t nsw = min(static_cast<int64_t>(W), cnt - H);  // streaming warps
    P = nsw > 0 ? static_cast<int>(S / nsw) : 0;
  }
  __device__ bool streamed(int64_t i) const { return stream && i >= H; }
  __device__ StageUse use(int64_t u, int64_t i) const {
    if (!stream) {  // 32-bit: units * cnt chunks of several MB each stay far below 2^32
      const auto k = static_cast<uint32_t>(u * cnt + i), q = k / static_cast<uint32_t>(stages);
      return StageUse{static_cast<int>(k - q * static_cast<uint32_t>(stages)), q};
    }
    if (i < H) return StageUse{S + static_cast<int>(u % R) * H + static_cast<int>(i), u / R};
    const int64_t j = i - H, ws = j % W;                         // the streaming warp's index
    const int64_t q = u * ((cnt - H - ws + W - 1) / W) + j / W;  // its streamed chunks before this one
    return StageUse{static_cast<int>(ws * P + q % P), q / P};
  }
};
// A consumer warp hands stage barrier `bar`'s buffer back to the producer once all its lanes are done with it.
__device__ __forceinline__ void release_stage(uint64_t* bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}
// The consumers' schedule: the statistics of unit u + ahead, then the pass that needs unit u's (normalize, dx).
template <typename S, typename F>
__device__ __forceinline__ void bulk_pipeline(int64_t units, int ahead, S&& statistics, F&& finish) {
  for (int64_t u = 0; u < min(static_cast<int64_t>(ahead), units); ++u) statistics(u);
  for (int64_t u = 0; u < units; ++u) {
    if (u + ahead < units) statistics(u + ahead);
    finish(u);
  }
}
// arrive() with a release reduction in place of a fence and an atomic.
__device__ __forceinline__ void arrive_release(unsigned* counter) {
#ifdef GNEXT_BULK_SM90
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
#endif
}

// The header's barriers, by thread 0 (full per stage: the producer; empty per stage: the `parts` warps that take
// the chunk; posted per slot: the consumer warps; ready per slot: the `mergers` merger warps), then a CTA barrier.
// Barriers a kernel adds of its own, initialized by thread 0 before this call, are fenced with these.
__device__ __forceinline__ void bulk_init_barriers(uint64_t* full, uint64_t* empty, uint64_t* posted, uint64_t* ready,
                                                   int stages, int consumers, int parts = 1, int mergers = 1) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], parts);
    for (int s = 0; s < kBulkSlots; ++s) mbar_init(&posted[s], consumers), mbar_init(&ready[s], mergers);
#ifdef GNEXT_BULK_SM90
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  }
  __syncthreads();
}

// The producer lane: chunk i of the CTA's slice (chunks [lo, lo + cnt) of every group of L elements) of each of the
// N tensors src[t], group after group, into the stage ring_of gives it (tensor t at t * chunk in the stage), each
// stage once it is released. Streamed chunks are copied with an evict-last hint (read again from L2), the others
// evict-first (read once).
// The CTA's team takes groups u0, u0 + ustride, ... (`units` of them; one team: 0, 1, ...).
template <typename T, int N>
__device__ __forceinline__ void bulk_produce(const T* const (&src)[N], unsigned char* ring, uint64_t* full,
                                             uint64_t* empty, const BulkStages& ring_of, int chunk, int64_t units,
                                             int64_t L, int64_t lo, int64_t cnt, bool per_chunk, int64_t u0 = 0,
                                             int64_t ustride = 1) {
  const uint64_t pol = l2_policy_evict_first(), keep = l2_policy_evict_last();
  const int64_t bytes_u = L * static_cast<int64_t>(sizeof(T)), stage_bytes = int64_t{N} * chunk;
  // Held ring: stage and fill counted up (per_chunk: computed for each chunk before its wait, as the streamed ring
  // must; the H100 and the H200's backward run faster that way; docs/decisions/bulk.md).
  if (!ring_of.stream && !per_chunk) {
    int st = 0;
    uint32_t use = 0;
    for (int64_t u = 0; u < units; ++u)
      for (int64_t i = 0; i < cnt; ++i) {
        if (use > 0) mbar_wait(&empty[st], (use - 1) & 1);
        const int64_t off = (lo + i) * chunk;
        const auto bytes = static_cast<uint32_t>(min(static_cast<int64_t>(chunk), bytes_u - off));
        unsigned char* dst = ring + st * stage_bytes;
        mbar_expect_tx(&full[st], N * bytes);
#pragma unroll
        for (int t = 0; t < N; ++t)
          bulk_copy_tx(dst + t * chunk, reinterpret_cast<const char*>(src[t]) + (u0 + u * ustride) * bytes_u + off,
                       bytes, &full[st], pol);
        if (++st == ring_of.stages) st = 0, ++use;
      }
    return;
  }
  for (int64_t u = 0; u < units; ++u)
    for (int64_t i = 0; i < cnt; ++i) {
      const StageUse su = ring_of.use(u, i);
      if (su.use > 0) mbar_wait(&empty[su.st], static_cast<uint32_t>((su.use - 1) & 1));
      const int64_t off = (lo + i) * chunk;
      const auto bytes = static_cast<uint32_t>(min(static_cast<int64_t>(chunk), bytes_u - off));
      unsigned char* dst = ring + su.st * stage_bytes;
      const uint64_t p = ring_of.streamed(i) ? keep : pol;
      mbar_expect_tx(&full[su.st], N * bytes);
#pragma unroll
      for (int t = 0; t < N; ++t)
        bulk_copy_tx(dst + t * chunk, reinterpret_cast<const char*>(src[t]) + (u0 + u * ustride) * bytes_u + off,
                     bytes, &full[su.st], p);
    }
}


// P: parts per chunk (1, 2 or 4), a template argument: the 4 KiB plans compile to the loop without parts.
template <typename T, int A, int P>
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
  // Teams of nb CTAs: team tm takes groups tm, tm + teams, ...; its k-th is unit k of the ring and slots.
  const unsigned nb = g.team, teams = gridDim.x / nb;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tm = static_cast<int>(blockIdx.x / nb), b = static_cast<int>(blockIdx.x % nb);
  const int64_t mine = units > tm ? (units - tm + teams - 1) / teams : 0;  // the team's groups
  const int64_t nc = (L * static_cast<int64_t>(sizeof(T)) + g.chunk - 1) / g.chunk;  // chunks per group
  const int64_t lo = b * nc / nb, cnt = (b + 1) * nc / nb - lo;
  const int64_t E = g.chunk / static_cast<int>(sizeof(T));  // elements per chunk
  const int items = static_cast<int>(cnt) * P;               // a consumer warp per part of 4 KiB
  auto group = [&](int64_t k) { return tm + k * teams; };
  const int64_t Ep = E / P;                                    // elements per part
  auto* partial = reinterpret_cast<WelfordState*>(a.partial);
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const BulkStages ring_of(g, cnt, W / P);  // a streamed chunk's parts: warps j % W of one group of P
  bulk_init_barriers(full, empty, posted, ready, g.stages, W, P);

  if (warp == W) {  // producer
    const T* const src[1] = {x};
    if (lane == 0) bulk_produce(src, ring, full, empty, ring_of, g.chunk, mine, L, lo, cnt, g.per_chunk, tm, teams);
    return;
  }
  if (warp == W + 1) {  // publisher
    for (int64_t k = 0; k < mine; ++k) {
      const int64_t u = group(k);
      const int slot = static_cast<int>(k % kBulkSlots);
      mbar_wait(&posted[slot], static_cast<uint32_t>((k / kBulkSlots) & 1));
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
    for (int64_t k = 0; k < mine; ++k) {
      const int64_t u = group(k);
      if (lane == 0) wait_count(a.counters + u, nb);
      __syncwarp();
      const WelfordState m = warp_merge_partials(partial + u * nb, nb, lane);
      if (lane == 0) {
        const float rstd = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + a.eps);
        const int slot = static_cast<int>(k % kBulkSlots);
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
  auto statistics = [&](int64_t k) {
    WelfordState s = WelfordOp::identity();
    for (int j = warp; j < items; j += W) {
      const int i = j / P, h = j % P;
      const StageUse su = ring_of.use(k, i);
      const int st = su.st;
      mbar_wait(&full[st], static_cast<uint32_t>(su.use & 1));
      const int n = static_cast<int>(max(int64_t{0}, min(Ep, L - (lo + i) * E - h * Ep))) / V;
      const uint4* src = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * g.chunk + h * Ep * sizeof(T));
      for (int v = lane; v < n; v += 32) {
        Vec q;
        q.raw = src[v];
        float f[V];
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = to_float(q.v[j]);
        s = welford_merge(s, welford_of<V>(f));
      }
      if (ring_of.streamed(i)) release_stage(&empty[st], lane);  // read again from L2 by the normalize
    }
    s = warp_reduce<WelfordOp>(s);
    const int slot = static_cast<int>(k % kBulkSlots);
    if (lane == 0) {
      wstate[slot * W + warp] = s;
      mbar_arrive(&posted[slot]);
    }
  };
  const bool few_straddles = static_cast<int64_t>(hw.divisor) * static_cast<int64_t>(sizeof(T)) >= 16 * g.chunk;
  auto normalize = [&](int64_t k) {
    const int slot = static_cast<int>(k % kBulkSlots);
    mbar_wait(&ready[slot], static_cast<uint32_t>((k / kBulkSlots) & 1));
    const float2 ms = stat[slot];
    const int64_t u = group(k);
    const int c0 = static_cast<int>(u % G) * D;
    for (int j = warp; j < items; j += W) {
      const int i = j / P, h = j % P;
      const int st = ring_of.use(k, i).st;
      const bool again = ring_of.streamed(i);  // x from L2, not from the ring
      const int64_t e0 = (lo + i) * E + h * Ep;  // element offset in the group
      const int n = static_cast<int>(max(int64_t{0}, min(Ep, L - e0))) / V;
      if (P > 1 && n == 0) {  // a part past the group's end
        if (!again) release_stage(&empty[st], lane);
        continue;
      }
      const uint4* src = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * g.chunk + h * Ep * sizeof(T));
      const T* xg = x + u * L + e0;
      T* ou = out + u * L + e0;
      const T* ru = res != nullptr ? res + u * L + e0 : nullptr;
      // A chunk lies in one channel unless it straddles a channel boundary: gamma/beta once per chunk, or, where it
      // straddles, reloaded by each lane where its channel changes (its vectors lie 32 apart; a load per vector
      // stalled the warp, and with it the whole team, on every straddling chunk). With an activation on 2-byte
      // elements, where channels span 16 chunks or more, the chunks in one channel take a loop without that
      // bookkeeping: inside it, it cost those forwards 4-10%. GroupNorm alone, float32 and channels of ~8 chunks
      // (16x256x16000 bf16: every 8th chunk straddles) were 1-8% slower with the second loop (docs/decisions/bulk.md).
      const int ca = static_cast<int>(hw.div(static_cast<uint32_t>(e0)));
      const bool one = static_cast<int64_t>(ca + 1) * static_cast<int64_t>(hw.divisor) >= e0 + n * V;
      float scale = ms.y * load_param(a.gamma, a.wt, c0 + ca, 1.f), shift = load_param(a.beta, a.wt, c0 + ca, 0.f);
      auto run = [&](auto straddles) {
        int cur = ca;
        for (int v0 = lane; v0 < n; v0 += 4 * 32) {
          uint4 r[4], rr[4];  // x from shared memory, the residual from global memory: all loads first
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (v0 + 32 * j < n) {
              r[j] = again ? ldg_hint(xg + (v0 + 32 * j) * V, drop) : src[v0 + 32 * j];
              if (ru != nullptr) rr[j] = ldg_hint(ru + (v0 + 32 * j) * V, drop);
            }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int v = v0 + 32 * j;
            if (v >= n) break;
            if (decltype(straddles)::value && !one) {
              const int c = static_cast<int>(hw.div(static_cast<uint32_t>(e0 + v * V)));
              if (c != cur) {
                cur = c;
                scale = ms.y * load_param(a.gamma, a.wt, c0 + c, 1.f), shift = load_param(a.beta, a.wt, c0 + c, 0.f);
              }
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
      };
      if constexpr (sizeof(T) == 2 && A != kActIdentity) {
        if (one && few_straddles)
          run(std::false_type{});
        else
          run(std::true_type{});
      } else {
        run(std::true_type{});
      }
      if (!again) release_stage(&empty[st], lane);
    }
  };
  bulk_pipeline(mine, g.ahead, statistics, normalize);
#endif
}

// Backward of the same schedule (mean and rstd known from the forward): a ring stage holds chunk i of x and chunk i
// of dy of the CTA's slice (2 * chunk bytes, one full barrier). Consumers take the slice's per-channel sums
// (sum dy'*(x - mean), sum dy') of its first and second channel (slice <= HxW: at most two), dy' = dy * act'(n),
// n = (x - mean) * rstd * gamma + beta, with an output activation. The publisher posts them as the CTA's float4
// partial; the merger turns the grid's partials into the group's coefficients (mean, c2, rstd, c3), c2 = -rstd^3 *
// A / L, c3 = -rstd * B / L with A = sum_c gamma_c * sum dy'*(x - mean), B = sum_c gamma_c * sum dy' (the same
// order in every CTA), hands them to the consumers, which write dx = rstd*gamma_c*dy' + c2*(x - mean) + c3 from
// shared memory; then it sums the partials of channels b, b + grid, ... of the group into dsum (for dgamma/dbeta,
// a second kernel). DRAM 2R + 1W (two-pass: 4R + 1W). A slice of x and dy is twice the forward's, so a ring that
// holds (ahead + 1) slices bounds the groups at half the size; beyond that (g.stream) part of each slice is kept
// and the rest is read a second time, from L2, for dx (BulkStages), which keeps a look-ahead: with the whole slice
// held once (ahead 0) every group's grid-wide wait is exposed.
template <typename T, int A>
__global__ void __launch_bounds__(kBulkMaxThreadsBwd, 1)
    bulk_backward_kernel(OnePassArgs a, BulkGeometry g, int64_t units, int64_t L, FastDivmod hw, int G, int D) {
#ifdef GNEXT_BULK_SM90
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int W = g.consumers;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + g.stages;
  uint64_t* posted = empty + g.stages;    // [kBulkSlots]
  uint64_t* ready = posted + kBulkSlots;  // [kBulkSlots]
  auto* wsum = reinterpret_cast<float4*>(ready + kBulkSlots);  // [kBulkSlots][W]
  auto* coefs = wsum + kBulkSlots * W;                          // [kBulkSlots]: (mean, c2, rstd, c3)
  unsigned char* ring = smem + kBulkHeader;
  const int64_t stage_bytes = 2 * static_cast<int64_t>(g.chunk);
  const unsigned nb = gridDim.x;
  const int b = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nc = (L * static_cast<int64_t>(sizeof(T)) + g.chunk - 1) / g.chunk;  // chunks per group
  const int64_t lo = b * nc / nb, cnt = (b + 1) * nc / nb - lo;
  const int64_t E = g.chunk / static_cast<int>(sizeof(T));  // elements per chunk
  // The first channel of CTA j's slice (only CTAs with chunks have partials that are not zero).
  auto first_channel = [&](int64_t j) {
    return static_cast<int>(hw.div(static_cast<uint32_t>(min(j * nc / nb * E, L - 1))));
  };
  const int d_lo = first_channel(b);
  auto* partial = reinterpret_cast<float4*>(a.partial);
  auto* dsum = reinterpret_cast<float2*>(a.dsum);
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ dy = static_cast<const T*>(a.dy);
  const int64_t C = static_cast<int64_t>(G) * D;
  const BulkStages ring_of(g, cnt, W);
  bulk_init_barriers(full, empty, posted, ready, g.stages, W);

  if (warp == W) {  // producer
    const T* const src[2] = {x, dy};
    if (lane == 0) bulk_produce(src, ring, full, empty, ring_of, g.chunk, units, L, lo, cnt, g.per_chunk);
    return;
  }
  if (warp == W + 1) {  // publisher
    for (int64_t u = 0; u < units; ++u) {
      const int slot = static_cast<int>(u % kBulkSlots);
      mbar_wait(&posted[slot], static_cast<uint32_t>((u / kBulkSlots) & 1));
      const float4 q = lane < W ? wsum[slot * W + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
      const float2 s0 = warp_reduce<Sum2Op>(make_float2(q.x, q.y)), s1 = warp_reduce<Sum2Op>(make_float2(q.z, q.w));
      if (lane == 0) {
        partial[u * nb + b] = make_float4(s0.x, s0.y, s1.x, s1.y);
        arrive_release(a.counters + u);
      }
      __syncwarp();
    }
    return;
  }
  if (warp == W + 2) {  // merger
    // Lane l takes the partials of CTAs l + 32 m (m < kBulkMergeRegs, grid <= 32 * kBulkMergeRegs), all loads of a
    // group issued at once (one L2 round trip), for the dx coefficients and then dsum.
    const float inv_l = 1.f / static_cast<float>(L);
    int dj[kBulkMergeRegs];
#pragma unroll
    for (int m = 0; m < kBulkMergeRegs; ++m) dj[m] = first_channel(lane + 32 * m);
    for (int64_t u = 0; u < units; ++u) {
      if (lane == 0) wait_count(a.counters + u, nb);
      __syncwarp();
      const int c0 = static_cast<int>(u % G) * D;
      float4 q[kBulkMergeRegs];
#pragma unroll
      for (int m = 0; m < kBulkMergeRegs; ++m) {
        const float* f = reinterpret_cast<const float*>(partial + u * nb + lane + 32 * m);
        q[m] = lane + 32 * m < static_cast<int>(nb) ? make_float4(__ldcg(f), __ldcg(f + 1), __ldcg(f + 2), __ldcg(f + 3))
                                                    : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float2 ab = {0.f, 0.f};
#pragma unroll
      for (int m = 0; m < kBulkMergeRegs; ++m) {
        const float w0 = load_param(a.gamma, a.wt, c0 + dj[m], 1.f);
        const float w1 = dj[m] + 1 < D ? load_param(a.gamma, a.wt, c0 + dj[m] + 1, 1.f) : 0.f;
        ab.x = fmaf(w0, q[m].x, fmaf(w1, q[m].z, ab.x));
        ab.y = fmaf(w0, q[m].y, fmaf(w1, q[m].w, ab.y));
      }
      ab = warp_reduce<Sum2Op>(ab);
      const int slot = static_cast<int>(u % kBulkSlots);
      if (lane == 0) {
        const float mu = a.mean[u], r = a.rstd[u];
        coefs[slot] = make_float4(mu, -r * r * r * ab.x * inv_l, r, -r * ab.y * inv_l);
        mbar_arrive(&ready[slot]);
      }
      if (dsum != nullptr)  // channels b, b + grid, ... of the group: the partials of the CTAs whose slice has them
        for (int d = b; d < D; d += static_cast<int>(nb)) {
          float2 t = {0.f, 0.f};
#pragma unroll
          for (int m = 0; m < kBulkMergeRegs; ++m) {
            t.x += dj[m] == d ? q[m].x : dj[m] + 1 == d ? q[m].z : 0.f;
            t.y += dj[m] == d ? q[m].y : dj[m] + 1 == d ? q[m].w : 0.f;
          }
          t = warp_reduce<Sum2Op>(t);
          if (lane == 0) dsum[(u / G) * C + c0 + d] = t;
        }
      __syncwarp();
      if (lane == 0) depart(a.counters + u, nb);
    }
    return;
  }

  // Consumers.
  T* __restrict__ dx = static_cast<T*>(a.out);
  const uint64_t drop = l2_policy_evict_first();
  auto statistics = [&](int64_t u) {
    const float mu = a.mean[u], r = a.rstd[u];
    const int c0 = static_cast<int>(u % G) * D;
    float2 s0 = {0.f, 0.f}, s1 = {0.f, 0.f};
    for (int64_t i = warp; i < cnt; i += W) {
      const StageUse su = ring_of.use(u, i);
      const int st = su.st;
      mbar_wait(&full[st], static_cast<uint32_t>(su.use & 1));
      const int64_t e0 = (lo + i) * E;
      const int n = static_cast<int>(min(E, L - e0)) / V;
      const uint4* xs = reinterpret_cast<const uint4*>(ring + st * stage_bytes);
      const uint4* ds = reinterpret_cast<const uint4*>(ring + st * stage_bytes + g.chunk);
      const bool again = ring_of.streamed(i);
      const int ca = static_cast<int>(hw.div(static_cast<uint32_t>(e0)));
      const bool one = static_cast<int64_t>(ca + 1) * static_cast<int64_t>(hw.divisor) >= e0 + n * V;
      int c = ca;
      float sg = 0.f, sb = 0.f;
      auto params = [&] {
        if constexpr (A != kActIdentity) {
          sg = r * load_param(a.gamma, a.wt, c0 + c, 1.f);
          sb = load_param(a.beta, a.wt, c0 + c, 0.f);
        }
      };
      params();
      for (int v0 = lane; v0 < n; v0 += 2 * 32) {
        uint4 xr[2], dr[2];  // both vector pairs' loads first
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (v0 + 32 * j < n) xr[j] = xs[v0 + 32 * j], dr[j] = ds[v0 + 32 * j];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int v = v0 + 32 * j;
          if (v >= n) break;
          if (!one) {
            c = static_cast<int>(hw.div(static_cast<uint32_t>(e0 + v * V)));
            params();
          }
          float xm[V], dd[V];
          vec_grads<T, A>(xr[j], dr[j], mu, sg, sb, xm, dd);
          add_grad_sums<V>(xm, dd, c == d_lo, s0, s1);
        }
      }
      if (again) release_stage(&empty[st], lane);  // read again from L2 for dx
    }
    s0 = warp_reduce<Sum2Op>(s0);
    s1 = warp_reduce<Sum2Op>(s1);
    const int slot = static_cast<int>(u % kBulkSlots);
    if (lane == 0) {
      wsum[slot * W + warp] = make_float4(s0.x, s0.y, s1.x, s1.y);
      mbar_arrive(&posted[slot]);
    }
  };
  auto write_dx = [&](int64_t u) {
    const int slot = static_cast<int>(u % kBulkSlots);
    mbar_wait(&ready[slot], static_cast<uint32_t>((u / kBulkSlots) & 1));
    const float4 kc = coefs[slot];
    const float mu = kc.x, c2 = kc.y, r = kc.z, c3 = kc.w;
    const int c0 = static_cast<int>(u % G) * D;
    for (int64_t i = warp; i < cnt; i += W) {
      const int st = ring_of.use(u, i).st;
      const bool again = ring_of.streamed(i);  // x and dy from L2, not from the ring
      const int64_t e0 = (lo + i) * E;
      const int n = static_cast<int>(min(E, L - e0)) / V;
      const uint4* xs = reinterpret_cast<const uint4*>(ring + st * stage_bytes);
      const uint4* ds = reinterpret_cast<const uint4*>(ring + st * stage_bytes + g.chunk);
      const T* xg = x + u * L + e0;
      const T* dg = dy + u * L + e0;
      T* ou = dx + u * L + e0;
      const int ca = static_cast<int>(hw.div(static_cast<uint32_t>(e0)));
      const bool one = static_cast<int64_t>(ca + 1) * static_cast<int64_t>(hw.divisor) >= e0 + n * V;
      float scale = 0.f, sb = 0.f;
      auto params = [&](int c) {
        scale = r * load_param(a.gamma, a.wt, c0 + c, 1.f);
        if constexpr (A != kActIdentity) sb = load_param(a.beta, a.wt, c0 + c, 0.f);
      };
      params(ca);
      for (int v0 = lane; v0 < n; v0 += 4 * 32) {
        uint4 xr[4], dr[4];  // all loads first
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = v0 + 32 * j;
          if (v < n) {
            if (again) {
              xr[j] = ldg_hint(xg + v * V, drop), dr[j] = ldg_hint(dg + v * V, drop);
            } else {
              xr[j] = xs[v], dr[j] = ds[v];
            }
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = v0 + 32 * j;
          if (v >= n) break;
          if (!one) params(static_cast<int>(hw.div(static_cast<uint32_t>(e0 + v * V))));
          float xm[V], dd[V];
          vec_grads<T, A>(xr[j], dr[j], mu, scale, sb, xm, dd);
          Vec o;
#pragma unroll
          for (int e = 0; e < V; ++e) o.v[e] = static_cast<T>(fmaf(scale, dd[e], fmaf(c2, xm[e], c3)));
          stg_hint(ou + v * V, o.raw, drop);
        }
      }
      if (!again) release_stage(&empty[st], lane);
    }
  };
  bulk_pipeline(units, g.ahead, statistics, write_dx);
#endif
}

#undef GNEXT_BULK_SM90

}  // namespace gn
}  // namespace gnext
