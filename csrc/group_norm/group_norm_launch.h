// SPDX-License-Identifier: BSD-3-Clause
// Interface between the host glue (group_norm_cuda.cpp, compiled by the C++ compiler) and the
// kernels (group_norm_kernels.cu, compiled by nvcc). Only plain types cross it: the nvcc
// translation unit never formats messages or touches ATen, and returns cudaError_t.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../common/pointwise.h"

namespace gnext {
namespace gn {

// Shared by the kernels (loop unrolling, __launch_bounds__) and the host launch geometry.
constexpr int kUnroll = 4;        // independent vector loads in flight per thread
constexpr int kMaxThreads = 512;  // block size cap of every kernel
constexpr int kNhwcActBwdThreads = 256;  // NHWC backward affine with SiLU (nhwc_split: <= 256)
constexpr int kNhwcActFwdThreads = 256;  // NHWC forward affine with an activation or prologue (same)
// The NCHW elementwise forward on 2-byte elements: at least this many kMaxThreads CTAs per SM (<= 40 registers;
// unbounded it takes 58-64, two CTAs: docs/decisions/two-pass-split.md#three-ctas-per-sm-for-the-2-byte-forward).
constexpr int kAffineFwd16CtasPerSm = 3;
constexpr int kAffineFwd32CtasPerSm = 2;  // float32: at most 64 registers
// CTAs per SM of that forward for elements of esize bytes: its __launch_bounds__ and the planner's resident count.
constexpr int affine_fwd_ctas_per_sm(int64_t esize) {
  return esize == 2 ? kAffineFwd16CtasPerSm : kAffineFwd32CtasPerSm;
}

// The NCHW forward reduction without a prologue (reduce_nchw_fwd_kernel), V-element vectors: kMaxThreads CTAs per SM,
// its __launch_bounds__ and the planner's resident count (reduce_fwd_chunks). 8-wide 2-byte vectors take 55
// registers under this bound (44 without), two CTAs; the others 28-32, four.
constexpr int reduce_fwd_ctas_per_sm(int64_t esize, int V) { return esize == 2 && V == 8 ? 2 : 4; }

enum class ScalarKind : int { Float = 0, Half = 1, BFloat16 = 2 };

// A per-channel input shift (C,) in its own dtype (a convolution's bias that x does not hold yet), or none (p null):
// read in its dtype so that no conversion pass runs per call.
struct ChannelShift {
  const void* p;
  ScalarKind t;
};

// input (N, C, *), HxW = prod(spatial), D = C / G.
struct Problem {
  int64_t N, C, G, D, HxW;
};

// Per-channel partials of (n, c) are at partial[n * s_n + c * s_c + k * s_k], k < K.
struct PartialLayout {
  int64_t K, s_n, s_c, s_k;
};

// Geometry of the reduction and of the elementwise pass (host-computed, see group_norm_cuda.cpp).
//   NCHW: grid (N*C rows, K chunks of `chunk` elements).
//   NHWC: grid (N, K ranges of `chunk` rows); a thread owns channel vectors t % tpr and rows t / tpr.
struct ReduceGeometry {
  bool nhwc;
  int vec;
  int64_t K, chunk;
  int threads, tpr, rpi;
  size_t smem;
};
//   NCHW long rows: tiles (rows_per_cta == 0): a 1-D grid of N*C*K CTAs, CTA b on chunk b % K of row b / K;
//   otherwise (rows_per_cta == 1) grid (N*C, K chunks). Short rows: grid (rows / rows_per_cta).
//   NHWC: as the reduction.
struct AffineGeometry {
  bool nhwc;
  int vec;
  unsigned grid_x, grid_y;
  int threads, rows_per_cta, tpr, rpi;
  int64_t chunk;
};

// One-pass NCHW kernels (group_norm_onepass.cuh). A persistent cooperative grid walks tiles of
// whole channels (or pieces of one channel); each tile of x (and dy) is read from DRAM once into
// shared memory and kept there until its group's statistics are complete, then normalized from
// shared memory: DRAM traffic 1R + 1W forward, 2R + 1W backward.
//   tile i = k * grid + blockIdx.x (k-th tile of a CTA), group i / T, position j = i % T;
//   sub > 1: channel j / sub, piece j % sub of `tile` elements; sub == 1: channels j*cpt ...
constexpr int kOnePassThreads = 512;
constexpr size_t kOnePassStaticSmem = 1024;  // bound on the one-pass kernel's static shared memory
struct OnePassGeometry {
  int nbuf;       // shared-memory stages per CTA; 1 only when every CTA has at most one tile
  int threads;
  unsigned grid;  // persistent CTAs, all co-resident (cooperative launch)
  int vec;        // elements per 16-byte access
  int64_t tile;   // elements per stage (a multiple of vec)
  int64_t sub;    // tiles per channel
  int64_t cpt;    // channels per tile (1 when sub > 1)
  int64_t units;  // groups (NCHW: N*G) or channel blocks (NHWC: N*C/cb); tiles = units * T
  int64_t T;      // tiles per group / unit (spans at most two consecutive waves: T <= grid)
  size_t smem;    // dynamic shared memory bytes
  bool nhwc;      // NHWC: units of cb channels (whole groups), tiles of `rows` pixels x cb
  int64_t cb, rows;
  // NCHW forward whose HxW is not a multiple of vec while D*HxW is: each tile is a whole group
  // (T == 1), vectors may straddle two or more channels, and the finish finds each element's channel.
  bool ragged;
  // Order of a streamed CTA's steps (nbuf > 1): false (default) finishes tile k, starts copying tile k+nbuf,
  // then publishes tile k+1, so that tile k+1's copy overlaps the wait and the normalize of tile k; true
  // publishes tile k+1 before finishing tile k (GNEXT_ONEPASS_EARLY=1, measurements).
  bool early;
};
// Pointwise extension of the kernels (common/pointwise.h), one `mode` = pw_mode(pre, act):
//  * prologue: normalize a = pre(x + bias[c]) instead of x; the backward's grad_out is the gradient
//    of the GroupNorm output and the kernels write dL/dx = dL/da * pre'(x + bias).
//  * epilogue: out = act(GroupNorm(x)) [+ residual]; the backward's grad_out is dL/dout and the kernels
//    use dL/dout * act'(GroupNorm(x)), recomputing GroupNorm(x) from mean, rstd, gamma, beta.
struct PwArgs {
  int mode;              // pw_mode(PreKind, ActKind)
  const void* bias;      // prologue bias (C,) or null
  ScalarKind bias_t;
  const void* residual;  // epilogue, forward: added after the activation (input's layout) or null
  // epilogue, backward (two-pass kernels): per-group rstd and gamma/beta of type wt (null = 1 / 0)
  const float* rstd;
  const void* gamma;
  const void* beta;
  ScalarKind wt;
  // backward, NHWC two-pass kernels without an output activation: dy is NCHW-contiguous ((N, C, HxW),
  // e.g. a loss's contiguous gradient of a channels_last output), read in place channel by channel
  // (the kernels' DyNchw instantiation) instead of being copied into the input's layout first.
  bool dy_nchw;
  // forward, NHWC two-pass elementwise pass with a prologue (the fused conv op of an NCHW input): out is
  // NCHW-contiguous, written through a shared-memory tile (affine_nhwc_out_nchw_kernel) instead of being
  // copied out of the input's layout afterwards.
  bool out_nchw;
};

struct OnePassArgs {
  const void* x;
  const void* dy;  // backward only
  void* out;       // y or dx
  const void* gamma;
  const void* beta;
  ScalarKind wt;       // gamma/beta element type
  float* mean;         // (N, G): written forward, read backward
  float* rstd;
  float* partial;      // forward: Welford (mean, m2, n) per NCHW tile / per NHWC (tile, group);
                       // backward: float2 per NCHW (n, c, piece) / per NHWC (tile, channel) + (tile, group)
  float* dsum;         // backward: (sum dy*(x-mean), sum dy) per (n, c) for dgamma/dbeta, or null
  unsigned* counters;  // one per group / unit, zero on entry and on exit; null when T == 1
  float eps;
  PwArgs pw;           // NCHW only (the NHWC one-pass kernel has no pointwise extension)
  ChannelShift in_shift;  // forward, wide channels_last kernel only: GroupNorm of x + in_shift[c], or none
};
cudaError_t launch_onepass(bool bwd, ScalarKind t, const Problem& p, const OnePassGeometry& g, const OnePassArgs& a,
                           cudaStream_t stream);

// "Wide" forward (group_norm_wide.cuh): NCHW groups beyond the one-pass plan (tens of MB), one
// persistent CTA per SM walking the groups in turn, each CTA a `slice` of every group; the group's
// second read from shared memory (`held` elements per CTA) and L2. Takes OnePassArgs' x, out, gamma,
// beta, wt, mean, rstd, partial (N*G*grid Welford states), counters (N*G, zero), eps and pw (output
// activation and residual; no prologue).
constexpr int kWideThreads = 512;
constexpr size_t kWideStaticSmem = 1024;  // bound on the wide kernel's static shared memory
struct WideGeometry {
  unsigned grid;  // CTAs, at most one per SM (all co-resident: cooperative launch)
  int threads;    // kWideThreads; channels_last: rows per step x C / V
  int64_t slice;  // elements of each group per CTA, a multiple of 1 KB
  int64_t held;   // of those, the first `held` are kept in shared memory (a multiple of 16 bytes; backward:
                  // of x and of dy each; forward: in each of its 1 + ahead buffers)
  int ahead;      // forward: groups read ahead of the one being normalized (0 or 1); backward: 0
  size_t smem;    // dynamic shared memory bytes
};
cudaError_t launch_wide_forward(ScalarKind t, const Problem& p, const WideGeometry& g, const OnePassArgs& a,
                                cudaStream_t stream);
// Channels_last wide forward: units are images (HxW * C elements each), each CTA `slice` elements (whole rows)
// of every image; smem also holds threads * 2 Welford states and G float2 after the stage buffers. Takes the
// wide forward's arguments; partial: N*G*grid Welford states, counters: N (zero).
cudaError_t launch_wide_nhwc_forward(ScalarKind t, const Problem& p, const WideGeometry& g, const OnePassArgs& a,
                                     cudaStream_t stream);
// Wide backward: x and dy staged (held elements of each), dx written; partial: N*G*grid float4 (sums of the
// slice's first and second channel), dsum (N, C) (sum dy*(x-mean), sum dy) or null; slice <= HxW.
cudaError_t launch_wide_backward(ScalarKind t, const Problem& p, const WideGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream);

// "Bulk" forward (group_norm_bulk.cuh, sm_90+): NCHW groups of a few MB, one persistent CTA per SM owning a slice
// of every group, copied from DRAM into a ring of shared-memory chunks by a producer warp (cp.async.bulk) and
// normalized from there; a publisher and a merger warp carry each group's grid-wide statistics. Takes OnePassArgs'
// x, out, gamma, beta, wt, mean, rstd, partial (N*G*grid Welford states), counters (N*G, zero), eps and pw (output
// activation and residual; no prologue).
constexpr int kBulkMaxConsumers = 16;
// The forward's parts per copy that bulk_forward_kernel is compiled for (its template argument P).
constexpr bool bulk_parts_compiled(int parts) { return parts == 1 || parts == 2 || parts == 4; }
// Threads of a bulk CTA: the consumer warps, the producer, the publisher and the merger warp(s).
constexpr int bulk_threads(int consumers, int mergers = 1) { return (consumers + 2 + mergers) * 32; }
constexpr int kBulkMaxThreads = bulk_threads(kBulkMaxConsumers);
// The backward runs 8 consumer warps under a launch bound of its own: at 608 threads its kernels get 96 registers and
// spill (36-168 bytes per instantiation); at 352 none do, and the time falls (docs/decisions/bulk.md).
constexpr int kBulkMaxConsumersBwd = 8;
constexpr int kBulkMaxThreadsBwd = bulk_threads(kBulkMaxConsumersBwd);
constexpr int kBulkSlots = 6;                                   // per-group handshake slots: ahead <= 4
constexpr int kBulkMaxStages = 64;
constexpr int kBulkMergeRegs = 5;                               // backward merger: partials per lane
constexpr int kBulkMaxGridBwd = 32 * kBulkMergeRegs;            // backward: CTAs (SMs) at most
constexpr size_t kBulkHeader = 2560;  // barriers and slots before the ring (bulk_header_bytes)
// The header: full and empty barriers per stage, posted and ready per slot, then per slot the consumer warps'
// states (forward: a Welford state; backward: two channels' sums, a float4) and the group's statistics
// (forward: mean, rstd; backward: the dx coefficients, a float4).
constexpr size_t bulk_header_bytes(int stages, int consumers, bool bwd) {
  return 8 * (2 * static_cast<size_t>(stages) + 2 * kBulkSlots) +
         kBulkSlots * (static_cast<size_t>(consumers) * (bwd ? 16 : 12) + (bwd ? 16 : 8));
}
struct BulkGeometry {
  unsigned grid;  // CTAs, one per SM (all co-resident: cooperative launch)
  int consumers;  // consumer warps (<= kBulkMaxConsumers; backward <= kBulkMaxConsumersBwd)
  int chunk;      // bytes per copy (a multiple of 16); a ring stage holds one chunk (backward: of x and of dy)
  int stages;     // ring stages (<= kBulkMaxStages), >= (ahead + 1) * chunks per slice
  int ahead;      // groups whose statistics run ahead of the one being normalized (forward 1 .., backward 0 ..
                  // kBulkSlots - 2)
  size_t smem;    // dynamic shared memory bytes: kBulkHeader + stages * stage bytes
  bool stream;    // backward: the slice does not fit (ahead + 1) times; `hold` chunks of it are kept in shared
                  // memory, the rest read again from L2 for dx
  int hold;       // with stream: chunks per slice kept; stages - (ahead + 1) * hold >= 1 stream the rest
  bool per_chunk;  // the producer computes each chunk's stage before its wait instead of counting them up
  int parts;      // forward: consumer warps per chunk, 1, 2 or 4 (4 KiB each; divides consumers); backward: 1
  unsigned team;  // CTAs per team (divides grid): team t of the forward takes groups t, t + grid / team, ...;
                  // backward: grid (one team)
  size_t header = kBulkHeader;  // bytes before the ring: kBulkHeader, or bulk_nhwc_header_bytes
};
cudaError_t launch_bulk_forward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                cudaStream_t stream);
// Channels_last bulk forward (bulk_nhwc_forward_kernel): images as units of HxW * C elements, the same ring,
// teams and warps, with per-group statistics. Rows of C / V vectors, a power of two of at most 32 * kBulkNhwcMaxSlots
// (a row within a 4 KiB part); each vector in one group (C / G a multiple of V, C / G / V a power of two <= 32) or in
// two (2 C / G == V); G <= kBulkNhwcMaxG; consumers a multiple of parts * max(1, C / V / 32). Takes the forward's
// arguments; partial: N*team*G Welford states, counters: 2N (zero).
constexpr int kBulkNhwcMaxG = 64;
constexpr int kBulkNhwcMaxSlots = 8;
// Two merger warps: every CTA merges the team's partials of every group (132 x G states on an H100); with one warp
// that chain of L2 loads set the pace.
constexpr int kBulkNhwcMergers = 2;
constexpr int kBulkNhwcThreads = bulk_threads(kBulkMaxConsumers, kBulkNhwcMergers);
// Loads in flight per merger lane: a group's partials of 132 CTAs are 66 per lane (2 lanes per group at G = 32).
constexpr int kBulkNhwcMergeBatch = 16;
// Whether the merger warps of a team of `team` CTAs scatter the G groups over the team (group g merged by CTA g % team,
// then a second arrival): where merging every group in every CTA takes more than two batches of loads per lane.
// H100, G = 32, forward µs: one team of 132 (five batches) 6x512x80² bf16 71.7 -> 57.5, 8x512x96² fp16 109.5 -> 93.1;
// teams of 33 (two batches) 32x256x64² bf16 70.5 -> 80.2 (docs/decisions/bulk.md).
constexpr bool bulk_nhwc_scatter(int64_t G, int64_t team) {
  int64_t tpg = 32;
  while (tpg > 1 && G * tpg > kBulkNhwcMergers * 32) tpg >>= 1;
  return team > 2 * tpg * kBulkNhwcMergeBatch;
}
// Its header: the barriers (at most kBulkMaxStages stages, and two `taken` barriers), the consumer warps' per-group
// states in two slots, per slot the groups' (mean, rstd), and every channel's (gamma, beta) in float (16-byte aligned).
constexpr size_t kBulkNhwcBarrierBytes = 8 * (2 * static_cast<size_t>(kBulkMaxStages) + 2 * kBulkSlots + 2);
constexpr size_t bulk_nhwc_coef_offset(int consumers, int64_t G) {
  return (kBulkNhwcBarrierBytes + 2 * static_cast<size_t>(consumers) * static_cast<size_t>(G) * 12 +
          kBulkSlots * static_cast<size_t>(G) * 8 + 15) / 16 * 16;
}
constexpr size_t bulk_nhwc_header_bytes(int consumers, int64_t G, int64_t C) {
  return (bulk_nhwc_coef_offset(consumers, G) + static_cast<size_t>(C) * 8 + 127) / 128 * 128;
}
cudaError_t launch_bulk_nhwc_forward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                     cudaStream_t stream);
// Bulk backward: takes OnePassArgs' x, dy, out (dx), gamma, beta (with an output activation), wt, mean, rstd,
// partial (N*G*grid float4: sums of the slice's first and second channel), dsum ((N, C) float2, or null), counters
// (N*G, zero) and pw (output activation; no prologue). Needs slices of at most HxW elements.
cudaError_t launch_bulk_backward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream);

// Small groups (group_norm_small.cu): NCHW groups of at most kSmallMaxVecs 16-byte vectors, each held in
// registers by 2^lanes_log2 lanes of a warp (k vectors per lane); the group's sums by warp shuffles. Groups of
// up to kSmallThreads * 8 vectors (the forward's: * kSmallCtaFwdMaxK) (lanes_log2 == kSmallCtaLog2): a CTA per
// group, sums through shared memory.
// Forward: one launch of `grid` CTAs of kSmallThreads; takes OnePassArgs' x, out, gamma, beta, wt, mean,
// rstd, eps and pw (output activation and residual; no prologue).
// Backward: x and dy in registers, dx (out; null: none) and dsum (null: none) in one launch (then
// launch_gamma_beta_backward); takes x, dy, out, gamma, beta (the output activation's), wt, mean, rstd, dsum
// and pw (output activation; no prologue); `smem` bytes of per-channel pieces per CTA.
constexpr int kSmallThreads = 256;
constexpr int kSmallMaxVecs = 256;           // 32 lanes x 8 vectors: 4 KB of x per group
constexpr size_t kSmallMaxSmem = 100 * 1024;  // backward pieces per CTA (2 CTAs per SM)
constexpr int kSmallCtaLog2 = 8;              // lanes_log2 of a plan with a CTA per group (256 lanes)
constexpr int kSmallCtaFwdMaxK = 16;          // forward, a CTA per group: up to 16 vectors per thread (64 KB)
// The output activations whose small-group kernels come with registers sized by the plan (K = 1, 2, 4, 8) and
// with a CTA per group; the others (GELU, tanh, hardswish: rarer after a GroupNorm) have the warp kernels with
// 8 vector registers per lane only. Each variant of a backward kernel is 50-440 KB of SASS per architecture:
// all of them for every activation took the sm_90a module from 25 to 42 MB. GELU (erf) has the CTA-per-group
// variants (K = 2, 4, 8; +1 MB of sm_90a module) but not the sized warp ones: ResNet-GN's 7x7 and 14x14 maps with
// GELU took the one-pass forward and the two-pass backward. H100 op µs forward / backward, GNEXT_SMALL_CTA=0 -> 2,
// L2 flushed: 32x2048x7x7 bf16 31.9 / 118.2 -> 22.1 / 28.7
// (GroupNorm 17.3 / 31.8), 32x1024x14x14 fp16 42.7 / 93.7 -> 31.8 / 50.1 (21.5 / 28.8), 16x2048x7x7 fp32
// 21.0 / 64.3 -> 15.9 / 25.5 (12.6 / 17.3), 32x256x28x28 bf16 29.0 / 56.5 -> 21.1 / 39.4.
constexpr bool small_sized_act(int act) { return act == kActIdentity || act == kActSilu || act == kActRelu; }
constexpr bool small_cta_act(int act) { return small_sized_act(act) || act == kActGelu; }
struct SmallGeometry {
  int vec;         // elements per 16-byte vector
  int lanes_log2;  // lanes per group: 1 .. 32, or kSmallCtaLog2: the CTA
  int k;           // vectors per lane, <= kSmallMaxVecs / 32 (a CTA per group's forward: kSmallCtaFwdMaxK)
  int kreg;        // vector registers per lane (the kernels' K): k rounded up to 1, 2, 4, 8 or 16
  unsigned grid;
  size_t smem;     // backward: dynamic shared memory bytes; forward: 0
};
// The small-group backward's pieces of (dy' (x - mean), dy') in shared memory, `slots` per channel (channel d's
// at d * slots): kVector (HxW a multiple of V): one per vector; kStraddle (HxW > V, not a multiple): one per
// vector part, a vector lying in one channel or straddling two (the first of the next channel's pieces);
// kElement (HxW < V, not a divisor): one per element. direct: a piece is a whole channel (HxW == V or
// HxW == 1), summed from registers, no shared memory.
struct SmallPieces {
  enum Mode { kVector, kStraddle, kElement };
  Mode mode;
  uint32_t hxw, vec, slots;
  bool direct;
  __host__ __device__ SmallPieces(uint32_t HxW, uint32_t V)
      : mode(HxW % V == 0 ? kVector : HxW > V ? kStraddle : kElement),
        hxw(HxW),
        vec(V),
        slots(mode == kVector ? HxW / V : mode == kStraddle ? HxW / V + 2 : HxW),
        direct(slots == 1) {}
  // Pieces of channel d (of its group).
  __host__ __device__ uint32_t count(uint32_t d) const {
    return mode == kStraddle ? ((d + 1) * hxw - 1) / vec - d * hxw / vec + 1 : slots;
  }
};
cudaError_t launch_small_forward(ScalarKind t, const Problem& p, const SmallGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream);
cudaError_t launch_small_backward(ScalarKind t, const Problem& p, const SmallGeometry& g, const OnePassArgs& a,
                                  cudaStream_t stream);

// affine_nhwc_out_nchw_kernel's shared memory (C coefficients, C prologue biases, two tiles of C x (tr + 1)
// elements) and whether a plan has it: each thread one channel vector (tpr >= C / V), tiles of kUnroll * rpi
// rows, within 48 KB (C up to ~600 fp32 channels); else the caller computes channels_last and copies. Chunks of a
// multiple of 8 rows (affine_out_nchw_chunks) let the kernel store 16-byte runs of pixels.
constexpr size_t affine_out_nchw_smem(int64_t C, int tr, size_t esize) {
  return static_cast<size_t>((C * 5 + 3) / 4) * sizeof(float4) + static_cast<size_t>(C) * 2 * (tr + 1) * esize;
}
constexpr bool affine_out_nchw_fits(const AffineGeometry& g, int64_t C, size_t esize) {
  return g.nhwc && static_cast<int64_t>(g.tpr) * g.vec >= C &&
         affine_out_nchw_smem(C, kUnroll * g.rpi, esize) <= 48 * 1024;
}

inline AffineGeometry affine_out_nchw_chunks(AffineGeometry g, int64_t HxW) {
  g.chunk = (g.chunk + 7) / 8 * 8;
  g.grid_y = static_cast<unsigned>((HxW + g.chunk - 1) / g.chunk);
  return g;
}

// Sizes of one reduction state: Welford (mean, m2, n) forward, (sum dy*(x-mean), sum dy) backward.
constexpr size_t kMomentsStateBytes = 3 * sizeof(float);
constexpr size_t kGradStateBytes = 2 * sizeof(float);

// Forward Welford partials of x (grad == false) or backward sums of dy*(x - mean) and dy.
cudaError_t launch_reduce(bool grad, ScalarKind t, const Problem& p, const ReduceGeometry& g, const void* x,
                          const void* dy, const float* mean, float* partial, const PwArgs& pw,
                          cudaStream_t stream);
// mean/rstd per (n, g) and, if coef is non-null, coef = (mean, rstd*gamma, 0, beta) per (n, c). wt: gamma/beta type.
// shift (or none): statistics of x + shift[c] from the partials of x (a Welford state shifts by its mean).
cudaError_t launch_finalize_forward(ScalarKind wt, const Problem& p, const PartialLayout& L, const float* partial,
                                    const void* gamma, const void* beta, float* mean, float* rstd, float* coef,
                                    float eps, ChannelShift shift, cudaStream_t stream);
// dsum (n, c) = (sum dy*(x-mean), sum dy) if non-null; coef = (mean, c2, rstd*gamma, c3) if non-null.
cudaError_t launch_finalize_backward(ScalarKind wt, const Problem& p, const PartialLayout& L, const float* partial,
                                     const float* mean, const float* rstd, const void* gamma, float* dsum, float* coef,
                                     cudaStream_t stream);
// coef per (n, c) from given mean/rstd (N, G) (the statistics of a tensor split over ranks, merged elsewhere):
// gsum null: the forward's (mean, rstd*gamma, 0, beta); else the backward's, gsum (N, G) float2 holding the group
// means of gamma*dy*(x - mean) and gamma*dy over the whole tensor: (mean, -rstd^3 gsum.x, rstd*gamma, -rstd gsum.y).
cudaError_t launch_coef(ScalarKind wt, const Problem& p, const float* mean, const float* rstd, const void* gamma,
                        const void* beta, const float* gsum, float* coef, cudaStream_t stream);
// Moments of shards of one tensor (groupnorm_ext.distributed), float64 (3, n) = (count, mean, M2) per (n, g):
// packed from a shard's mean / rstd (eps = 0) and its count per group; merged over `world` such blocks
// (world, 3, n) by Chan's formula into mean, rstd = 1/sqrt(M2/count + eps) (float32) and count (float64).
cudaError_t launch_pack_moments(const float* mean, const float* rstd, int64_t count, double* out, int64_t n,
                                cudaStream_t stream);
cudaError_t launch_merge_moments(const double* moments, int64_t world, int64_t n, float eps, float* mean,
                                 float* rstd, double* count, cudaStream_t stream);
// dgamma/dbeta (either may be null) of type pt from dsum.
cudaError_t launch_gamma_beta_backward(ScalarKind pt, const Problem& p, const float* dsum, const float* rstd,
                                       void* dgamma, void* dbeta, cudaStream_t stream);
// mean and rstd (n values each) converted from `from` to `to` (one of them float32) in one launch: ATen's
// GroupNorm keeps its statistics in the input's dtype (group_norm_aten.cpp), gnext's kernels in float32.
cudaError_t launch_cast_stats(ScalarKind from, ScalarKind to, const void* mean, const void* rstd, void* mean_out,
                              void* rstd_out, int64_t n, cudaStream_t stream);
// out = coef.y * (a - coef.x) [+ coef.z * dy] + coef.w, a = x or the prologue's act(x + bias)
// (backward with a prologue: times act'(x + bias)).
cudaError_t launch_affine(bool has_dy, ScalarKind t, const Problem& p, const AffineGeometry& g, const void* x,
                          const void* dy, void* out, const float* coef, const PwArgs& pw, cudaStream_t stream);

// The elementwise pass into a padded output (group_norm_pad.cu): x contiguous (NC, D, H, W) (D = H = 1 for fewer
// spatial dims), out contiguous (NC, Dp, Hp, Wp); fd, ht, wl: padding before d, h, w (the rest after).
struct PadShape {
  int64_t NC, C, D, H, W, Dp, Hp, Wp;
  int fd, ht, wl;
};
// Which kernel writes the padded output (pad_plan in group_norm_plan.h): source rows staged by cp.async
// (kTiles: rows of 16-byte multiples, at most kPadTileBytes), a warp per output row (kRows, rows_per_warp 1 or 2
// at a time), or each plane walked flat (kFlat).
enum class PadKernel : int { kFlat, kRows, kTiles };
struct PadPlan {
  PadKernel kernel;
  int rows_per_warp;
};
constexpr int kPadTileBytes = 16384;  // kTiles: bytes of source rows per stage
// out = act(coef.y * (x' - coef.x) + coef.w) at the source element x' of each output element (replicate: the
// clamped index), `value` where constant padding has none. pw: an output activation only (no prologue, no residual).
cudaError_t launch_affine_pad(ScalarKind t, const PadShape& s, const void* x, void* out, const float* coef,
                              const PwArgs& pw, bool replicate, float value, const PadPlan& plan, int sm_count,
                              cudaStream_t stream);
// Where the modulated pass writes row (n, c) = (row / C, row % C): at n * sn + c * sc elements (a contiguous out:
// sn = C * plane, sc = plane; out a slice along dim 2 of a larger buffer: that buffer's strides).
struct OutRows {
  int64_t C, sn, sc;
  __host__ __device__ int64_t offset(int64_t row) const { return (row / C) * sn + (row % C) * sc; }
};
// out = act((coef.y * (x - coef.x) + coef.w) * scale + shift) over `rows` rows (n, c) of HxW elements, x, scale and
// shift NCHW-contiguous, out's rows at o, coef per row (group_norm_modulate.cu); aligned: all four and the rows'
// starts 16-byte aligned (16-byte vectors where HxW allows). pw: an output activation only.
cudaError_t launch_affine_modulate(ScalarKind t, int64_t rows, int64_t HxW, const void* x, const void* scale,
                                   const void* shift, void* out, const OutRows& o, bool aligned, const float* coef,
                                   const PwArgs& pw, int sm_count, cudaStream_t stream);
// The same with scale and shift of a smaller (h, w): rows (n, c) of x are (D, H, W), of scale and shift (D, h, w),
// read at the nearest-neighbour source of each element as F.interpolate(mode="nearest") maps it (sh = h / H,
// sw = w / W in float). D * H * W must fit 31 bits.
struct ModShape {
  int64_t rows, D, H, W, h, w;
  float sh, sw;
};
cudaError_t launch_affine_modulate_up(ScalarKind t, const ModShape& m, const void* x, const void* scale,
                                      const void* shift, void* out, const OutRows& o, bool aligned,
                                      const float* coef, const PwArgs& pw, int sm_count, cudaStream_t stream);

}  // namespace gn
}  // namespace gnext
