// SPDX-License-Identifier: BSD-3-Clause
// Channels_last bulk GroupNorm forward (sm_90+): the bulk forward of group_norm_bulk.cuh (producer, ring, teams,
// look-ahead, publisher and merger) with images as units. An image is L = HxW * C elements contiguous in NHWC memory
// with all G groups interleaved, so a CTA's slice of it holds every group and the statistics are per group.
// Geometry: bulk_nhwc_geometry (group_norm_plan.h); launch: group_norm_bulk_nhwc.cu.
//
// A row (pixel) is CV = C / V 16-byte vectors, a power of two, and 16 * CV bytes divide a 4 KiB part, so every part
// starts on a row. With CW = min(CV, 32) and M = max(1, CV / 32) "slots", the vectors of a part whose index is
// 32 m + l modulo 32 M hold channel vector cv = l % CW + 32 m in every row, part and image. A consumer warp's items are
// (chunk, part, slot): slot m = warp % M is the same for all of a warp's items (M divides the consumer warps), so
// lane l reads vectors 32 m + l, 32 (m + M) + l, ... of each part and keeps one channel vector's mean, scale and
// shift. Each vector lies in one group (D a multiple of V: R = D / V vectors per group, a power of two <= 32) or
// holds the halves of two (2 D = V).
//   * consumers, statistics: a Welford state (two with 2 D = V) per lane of x - s_g, s_g = x[u, pixel 0, first
//     channel of g], the same shift in every CTA (partial means of the spread's size, so merging a team's partials
//     rounds the mean about once, as the two-pass kernels do). At the end of a unit the states of a group
//     merge by xor shuffles over the lanes that hold it (offsets below R: the group's other vectors; offsets >= CW:
//     the same vector in other rows), a fixed pattern, and the group's first lane writes the warp's state of it to
//     wst[k % 2][warp][g] once the publisher has read that slot's previous unit (`taken`).
//   * publisher: lane g % 32 merges group g's states from the warps of its slot, in order, into
//     partial[(u * team + b) * G + g], then one arrival on the unit's counter.
//   * mergers (kBulkNhwcMergers warps): once the team arrived, tpg lanes per group merge its team partials (fixed
//     order: the same bits in every CTA) into stat[slot][g] = (s_g + mean, rstd). In large teams
//     (bulk_nhwc_scatter) CTA b merges only groups b, b + team, ..., writes them to mean / rstd, and after a second
//     arrival of the team reads every group's from there.
//   * consumers, normalize: out = act((x - mean) * rstd * gamma + beta) [+ residual] from the ring (streamed chunks:
//     from L2), with the lane's V channels' mean, rstd * gamma and beta in registers, taken per image from the
//     header's (gamma, beta), which the CTA stages once.
// DRAM 1R + 1W, one launch; the channels_last two-pass kernels: 2R + 1W, three.
#pragma once
#include "group_norm_bulk.cuh"

namespace gnext {
namespace gn {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // group_norm_bulk.cuh's own guard ends with that header
#define GNEXT_BULK_NHWC_SM90 1
#endif

template <typename T, int A>
__global__ void __launch_bounds__(kBulkNhwcThreads, 1)
    bulk_nhwc_forward_kernel(OnePassArgs a, BulkGeometry g, int64_t units, int64_t L, int C, int G, int D) {
#ifdef GNEXT_BULK_NHWC_SM90
  constexpr int V = 16 / sizeof(T);
  using Vec = Pack<T, V>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int W = g.consumers, P = g.parts;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + g.stages;
  uint64_t* posted = empty + g.stages;   // [kBulkSlots]
  uint64_t* ready = posted + kBulkSlots;  // [kBulkSlots]
  uint64_t* taken = ready + kBulkSlots;   // [2]: the publisher has read wst[s]
  auto* wst = reinterpret_cast<WelfordState*>(smem + kBulkNhwcBarrierBytes);  // [2][W][G]
  auto* stat = reinterpret_cast<float2*>(wst + 2 * W * G);                     // [kBulkSlots][G]
  auto* coef = reinterpret_cast<float4*>(smem + bulk_nhwc_coef_offset(W, G));  // [C / 2]: (gamma, beta) of 2 channels
  unsigned char* ring = smem + g.header;
  const unsigned nb = g.team, teams = gridDim.x / nb;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tm = static_cast<int>(blockIdx.x / nb), b = static_cast<int>(blockIdx.x % nb);
  const int64_t mine = units > tm ? (units - tm + teams - 1) / teams : 0;  // the team's images
  const int64_t nc = (L * static_cast<int64_t>(sizeof(T)) + g.chunk - 1) / g.chunk;  // chunks per image
  const int64_t lo = b * nc / nb, cnt = (b + 1) * nc / nb - lo;
  const int64_t E = g.chunk / static_cast<int>(sizeof(T));  // elements per chunk
  const int CV = C / V, CW = min(CV, 32), M = max(1, CV / 32);
  const int items = static_cast<int>(cnt) * P * M;           // a consumer warp per (part of 4 KiB, slot)
  auto unit = [&](int64_t k) { return tm + k * teams; };
  const int64_t Ep = E / P;
  auto* partial = reinterpret_cast<WelfordState*>(a.partial);
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const BulkStages ring_of(g, cnt, W / (P * M));  // a streamed chunk's items: warps j % W of one group of P * M
  // (gamma, beta) once per CTA: read per image from global memory, each channel's two scalar loads stalled every
  // consumer warp at every image.
  for (int c = 2 * static_cast<int>(threadIdx.x); c < C; c += 2 * static_cast<int>(blockDim.x))
    coef[c / 2] = make_float4(load_param(a.gamma, a.wt, c, 1.f), load_param(a.beta, a.wt, c, 0.f),
                              load_param(a.gamma, a.wt, c + 1, 1.f), load_param(a.beta, a.wt, c + 1, 0.f));
  if (threadIdx.x == 0) mbar_init(&taken[0], 1), mbar_init(&taken[1], 1);
  bulk_init_barriers(full, empty, posted, ready, g.stages, W, P * M, kBulkNhwcMergers);
  // A group's statistics are taken of x - s_g, s_g = x[u, pixel 0, first channel of g], the same value in every CTA:
  // partial means are then of the spread's size and the merges of 132 CTAs' partials round no more than one does.
  auto shift_of = [&](int64_t u, int gg) { return to_float(x[u * L + static_cast<int64_t>(gg) * D]); };

  if (warp == W) {  // producer
    const T* const src[1] = {x};
    if (lane == 0) bulk_produce(src, ring, full, empty, ring_of, g.chunk, mine, L, lo, cnt, g.per_chunk, tm, teams);
    return;
  }
  if (warp == W + 1) {  // publisher
    for (int64_t k = 0; k < mine; ++k) {
      const int64_t u = unit(k);
      const int ws = static_cast<int>(k & 1);
      mbar_wait(&posted[k % kBulkSlots], static_cast<uint32_t>((k / kBulkSlots) & 1));
      for (int gg = lane; gg < G; gg += 32) {
        const int m = (D < V ? gg / 2 : gg * (D / V)) / 32;  // the slot of the group's channel vectors
        WelfordState s = wst[(ws * W + m) * G + gg];
        for (int w = m + M; w < W; w += M) s = welford_merge(s, wst[(ws * W + w) * G + gg]);
        partial[(u * nb + b) * G + gg] = s;
      }
      __threadfence();
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(&taken[ws]);
        arrive_release(a.counters + u);
      }
      __syncwarp();
    }
    return;
  }
  if (warp >= W + 2) {  // mergers: kBulkNhwcMergers warps, tpg lanes per group, each over CTAs li, li + tpg, ...
    const int ml = (warp - W - 2) * 32 + lane;
    constexpr int kLanes = kBulkNhwcMergers * 32;
    // Every CTA merges every group's team partials where that takes one batch of loads per lane; larger teams scatter
    // the groups (group g to CTA g % team), publish (mean, rstd) in a.mean / a.rstd, and meet at a second counter.
    const bool scatter = bulk_nhwc_scatter(G, nb);
    const int mg = scatter ? (G - b + static_cast<int>(nb) - 1) / static_cast<int>(nb) : G;  // groups merged here
    int tpg = 32;
    while (tpg > 1 && max(mg, 1) * tpg > kLanes) tpg >>= 1;
    const int per = kLanes / tpg, li = lane % tpg;
    for (int64_t k = 0; k < mine; ++k) {
      const int64_t u = unit(k);
      const int slot = static_cast<int>(k % kBulkSlots);
      if (lane == 0) wait_count(a.counters + u, nb);
      __syncwarp();
      for (int g0 = 0; g0 < mg; g0 += per) {  // the same trip count in every lane (shuffles)
        const int gi = g0 + ml / tpg, gg = scatter ? b + gi * static_cast<int>(nb) : gi;
        WelfordState m = WelfordOp::identity();
        float sg = 0.f;
        if (gi < mg) {
          sg = shift_of(u, gg);
          const WelfordState* pg = partial + u * nb * G + gg;
          for (unsigned j0 = li; j0 < nb; j0 += kBulkNhwcMergeBatch * tpg) {
            WelfordState q[kBulkNhwcMergeBatch];
#pragma unroll
            for (int i = 0; i < kBulkNhwcMergeBatch; ++i) {
              const unsigned j = j0 + i * tpg;
              const float* f = reinterpret_cast<const float*>(pg + static_cast<int64_t>(j) * G);
              q[i] = j < nb ? WelfordState{__ldcg(f), __ldcg(f + 1), __ldcg(f + 2)} : WelfordOp::identity();
            }
#pragma unroll
            for (int w = 1; w < kBulkNhwcMergeBatch; w <<= 1)  // a tree over the batch, in a fixed order
#pragma unroll
              for (int i = 0; i + w < kBulkNhwcMergeBatch; i += 2 * w) q[i] = welford_merge(q[i], q[i + w]);
            m = welford_merge(m, q[0]);
          }
        }
        for (int o = 1; o < tpg; o <<= 1) m = welford_merge(m, shfl_xor(m, o));
        if (gi < mg && li == 0) {
          const float rstd = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + a.eps), mean = sg + m.mean;
          if (!scatter) stat[slot * G + gg] = make_float2(mean, rstd);
          if (scatter || b == 0) a.mean[u * G + gg] = mean, a.rstd[u * G + gg] = rstd;
        }
      }
      if (scatter) {  // publish this CTA's groups, then take every group's from the team
        __threadfence();
        asm volatile("bar.sync 1, %0;" ::"n"(kLanes) : "memory");
        if (ml == 0) arrive_release(a.counters + units + u);
        if (lane == 0) wait_count(a.counters + units + u, nb);
        __syncwarp();
        for (int gg = ml; gg < G; gg += kLanes)
          stat[slot * G + gg] = make_float2(__ldcg(a.mean + u * G + gg), __ldcg(a.rstd + u * G + gg));
      }
      // Both mergers have passed the waits before this CTA's departures (the last one resets each counter).
      asm volatile("bar.sync 1, %0;" ::"n"(kLanes) : "memory");
      if (ml == 0) {
        depart(a.counters + u, nb);
        if (scatter) depart(a.counters + units + u, nb);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ready[slot]);
      __syncwarp();
    }
    return;
  }

  // Consumers.
  const bool two = D < V;                // a vector holds the halves of two groups
  const int R = two ? 1 : D / V;         // vectors per group
  const int m = warp % M;                // the warp's slot
  const int cv = lane % CW + 32 * m;     // the lane's channel vector
  const int ga = cv * V / D;             // its (first) group
  const T* __restrict__ res = static_cast<const T*>(a.pw.residual);
  T* __restrict__ out = static_cast<T*>(a.out);
  const uint64_t drop = l2_policy_evict_first();
  // The shifts of the next image are loaded while this one's statistics run (a load at the start of each image's
  // statistics stalled every consumer warp for a DRAM latency).
  T pa{}, pb{};
  auto load_shifts = [&](int64_t k) {
    if (k < mine) {
      pa = x[unit(k) * L + static_cast<int64_t>(ga) * D];
      if (two) pb = x[unit(k) * L + static_cast<int64_t>(ga + 1) * D];
    }
  };
  load_shifts(0);
  auto statistics = [&](int64_t k) {
    WelfordState sa = WelfordOp::identity(), sb = WelfordOp::identity();
    const float sha = to_float(pa), shb = two ? to_float(pb) : sha;
    load_shifts(k + 1);
    for (int j = warp; j < items; j += W) {
      const int i = j / (P * M), h = j / M % P;
      const StageUse su = ring_of.use(k, i);
      const int st = su.st;
      mbar_wait(&full[st], static_cast<uint32_t>(su.use & 1));
      const int n = static_cast<int>(max(int64_t{0}, min(Ep, L - (lo + i) * E - h * Ep))) / V;  // whole rows
      const uint4* src = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * g.chunk + h * Ep * sizeof(T));
      for (int v = lane + 32 * m; v < n; v += 32 * M) {
        Vec q;
        q.raw = src[v];
        float f[V];
#pragma unroll
        for (int e = 0; e < V; ++e) f[e] = to_float(q.v[e]) - (two && e >= V / 2 ? shb : sha);
        if (two) {
          sa = welford_merge(sa, welford_of<V / 2>(f));
          sb = welford_merge(sb, welford_of<V / 2>(f + V / 2));
        } else {
          sa = welford_merge(sa, welford_of<V>(f));
        }
      }
      if (ring_of.streamed(i)) release_stage(&empty[st], lane);  // read again from L2 by the normalize
    }
    for (int o = 1; o < 32; o <<= 1)
      if (o < R || o >= CW) {
        sa = welford_merge(sa, shfl_xor(sa, o));
        if (two) sb = welford_merge(sb, shfl_xor(sb, o));
      }
    const int ws = static_cast<int>(k & 1);
    if (k >= 2) mbar_wait(&taken[ws], static_cast<uint32_t>(((k >> 1) - 1) & 1));
    if (lane < CW && lane % R == 0) {
      WelfordState* dst = wst + (ws * W + warp) * G;
      dst[ga] = sa;
      if (two) dst[ga + 1] = sb;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&posted[k % kBulkSlots]);
  };
  auto normalize = [&](int64_t k) {
    const int slot = static_cast<int>(k % kBulkSlots);
    mbar_wait(&ready[slot], static_cast<uint32_t>((k / kBulkSlots) & 1));
    const int64_t u = unit(k);
    float mu[V], scale[V], shift[V];
    {
      const float2 fa = stat[slot * G + ga], fb = two ? stat[slot * G + ga + 1] : fa;
#pragma unroll
      for (int e = 0; e < V; e += 2) {
        const float2 f = two && e >= V / 2 ? fb : fa;
        const float4 gb = coef[(cv * V + e) / 2];
        mu[e] = mu[e + 1] = f.x;
        scale[e] = f.y * gb.x, shift[e] = gb.y;
        scale[e + 1] = f.y * gb.z, shift[e + 1] = gb.w;
      }
    }
    for (int j = warp; j < items; j += W) {
      const int i = j / (P * M), h = j / M % P;
      const int st = ring_of.use(k, i).st;
      const bool again = ring_of.streamed(i);  // x from L2, not from the ring
      const int64_t e0 = (lo + i) * E + h * Ep;  // element offset in the image
      const int n = static_cast<int>(max(int64_t{0}, min(Ep, L - e0))) / V;
      if (n == 0) {  // a part past the image's end
        if (!again) release_stage(&empty[st], lane);
        continue;
      }
      const uint4* src = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(st) * g.chunk + h * Ep * sizeof(T));
      const T* xg = x + u * L + e0;
      T* ou = out + u * L + e0;
      const T* ru = res != nullptr ? res + u * L + e0 : nullptr;
      const int step = 32 * M;
      constexpr int kB = 2;  // vectors in flight per lane: with the lane's V channels' coefficients in registers, 4
                             // spilled under the launch bound
      for (int v0 = lane + 32 * m; v0 < n; v0 += kB * step) {
        uint4 r[kB], rr[kB];  // x from shared memory, the residual from global memory: all loads first
#pragma unroll
        for (int jj = 0; jj < kB; ++jj)
          if (v0 + step * jj < n) {
            r[jj] = again ? ldg_hint(xg + (v0 + step * jj) * V, drop) : src[v0 + step * jj];
            if (ru != nullptr) rr[jj] = ldg_hint(ru + (v0 + step * jj) * V, drop);
          }
#pragma unroll
        for (int jj = 0; jj < kB; ++jj) {
          const int v = v0 + step * jj;
          if (v >= n) break;
          Vec q, o;
          q.raw = r[jj];
          float f[V];
#pragma unroll
          for (int e = 0; e < V; ++e) f[e] = act_apply<A>(fmaf(to_float(q.v[e]) - mu[e], scale[e], shift[e]));
          if (ru != nullptr) {
            Vec rv;
            rv.raw = rr[jj];
#pragma unroll
            for (int e = 0; e < V; ++e) f[e] += to_float(rv.v[e]);
          }
#pragma unroll
          for (int e = 0; e < V; ++e) o.v[e] = static_cast<T>(f[e]);
          stg_hint(ou + v * V, o.raw, drop);
        }
      }
      if (!again) release_stage(&empty[st], lane);
    }
  };
  bulk_pipeline(mine, g.ahead, statistics, normalize);
#endif
}

#undef GNEXT_BULK_NHWC_SM90

}  // namespace gn
}  // namespace gnext
