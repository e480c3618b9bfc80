// SPDX-License-Identifier: BSD-3-Clause
// The GroupNorm launch planner: plan_forward / plan_backward / plan_stats are pure functions of the problem
// (N, C, G, HxW, element size, layout, alignment, pointwise extension), the device's properties (Device: SM
// count, shared memory, L2, peak DRAM bandwidth, architecture) and a Tuning (group_norm_tuning.h). No
// environment, globals, tensors or CUDA calls: the host glue (group_norm_cuda.cpp) checks, plans, allocates and
// launches, and `python -m groupnorm_ext --plan` prints the same plans for any device.
//
// Choice order, forward: layout (NHWC for channels_last when its shared memory fits) -> small-group kernel
// (groups of <= 4 KB in registers) -> bulk (NCHW groups of a few MB streamed through shared memory, sm_90+; NHWC
// images whose slices shared memory holds) ->
// one-pass (groups held in shared memory across a persistent grid) -> wide (one CTA per SM holding a slice of
// each large group; NCHW, or channels_last single images) -> two-pass (reduce, finalize, elementwise). Backward: small-group -> layout -> bulk -> one-pass -> wide -> two-pass.
//
// The model behind the rules. Every design reads and writes the tensor; what differs is the bytes moved and
// the bytes each SM keeps in flight. Two-pass: forward 2R + 1W, backward 3R + 1W (the second reads often hit
// L2), streamed at about 0.95 of copy bandwidth. Persistent (one-pass, wide): 1R + 1W forward, 2R + 1W
// backward, but a CTA waits for its whole group before it normalizes, so its rate is set by the bytes in
// flight per SM (stages x tile), measured at 2.0-2.7 TB/s on the H100 and H200 alike. The persistent plans
// therefore pay while the device's bandwidth is below what the saved pass is worth (persistent_kernels_pay),
// and below that, where waves of CTAs can overlap their waits (few tiles per group, groups >= SMs).
// Measurements behind each rule: docs/decisions/.
#pragma once
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>

#include "group_norm_launch.h"
#include "group_norm_tuning.h"

namespace gnext {
namespace gn {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// What the planner knows of a GPU. H100 SXM: {132, 9, 233472, 232448, 1024, 52428800, 3352}.
struct Device {
  int sms;                 // streaming multiprocessors
  int major;               // compute capability major
  int64_t smem_per_sm;     // shared memory per SM, bytes
  int64_t smem_per_block;  // opt-in maximum per block, bytes
  int64_t smem_reserved;   // reserved by the system per block, bytes
  int64_t l2_bytes;
  int64_t peak_gbs;        // peak DRAM bandwidth, GB/s (2 x memory clock x bus width)
};

// The call being planned, besides its sizes (Problem).
struct Request {
  int64_t esize = 4;       // bytes per element of x: 4 (float32) or 2 (float16, bfloat16)
  bool contiguous = true;  // x is NCHW-contiguous; else channels_last (NHWC kernels, or an NCHW copy)
  bool aligned = true;     // every operand pointer is 16-byte aligned
  bool prologue = false;   // input prologue pre(x + bias[c]) (the fused conv op)
  int act = kActIdentity;  // output activation
  bool residual = false;   // output residual
  bool input_shift = false;  // forward: statistics and output of x + input_bias[c] (a convolution's bias)
  bool flat = true;        // backward: x and dy NCHW-contiguous
  bool need_dx = true;     // backward: grad_input wanted
};

enum class Kernel : int { kSmall, kBulk, kBulkNhwc, kOnePass, kWide, kWideNhwc, kTwoPass };

struct Plan {
  Kernel kernel = Kernel::kTwoPass;
  bool nhwc = false;  // the kernels' layout
  SmallGeometry small{};
  BulkGeometry bulk{};
  OnePassGeometry onepass{};
  WideGeometry wide{};
  ReduceGeometry reduce{};  // two-pass
  AffineGeometry affine{};  // two-pass (forward, or backward with need_dx)
  const char* why = "";
};

// Widest vector (elements per 16-byte access) for rows of `inner` elements; 1 when a row or pointer is not
// 16-byte aligned.
constexpr int vector_width(int64_t esize, int64_t inner, bool aligned) {
  const int vmax = static_cast<int>(16 / esize);
  return aligned && inner % vmax == 0 ? vmax : 1;
}

// ---------------------------------------------------------------------------------------------------------------
// Padded output (group_norm_pad.cu). The tile kernel stages whole source rows in shared memory by cp.async, three
// stages of kPadTileBytes per CTA (two in flight while one is written: 128 KiB per SM without registers behind
// them), and writes each output row from the stage: rows of 16-byte multiples from kPadTileMinW elements up to a
// stage. Stages of 4, 8 and 32 KiB were slower (fewer rows per barrier, or fewer CTAs per SM); 128-element rows lose
// to the flat kernel (a warp per 130-element row leaves half its lanes idle). Other rows of at least kPadRowsMinW
// elements take the row kernel, two rows per warp trip with their loads in flight together (four cost more
// occupancy than they win). Shorter rows: the flat kernel. docs/decisions/padded-output.md.
constexpr int64_t kPadTileMinW = 256;
constexpr int64_t kPadRowsMinW = 256;
inline PadPlan pad_plan(int64_t W, int64_t esize, bool aligned, const Tuning& t) {
  const bool rows16 = aligned && (W * esize) % 16 == 0 && W * esize <= kPadTileBytes;
  if (t.pad_tile != 0 && rows16 && (t.pad_tile == 2 || W >= kPadTileMinW)) return {PadKernel::kTiles, 0};
  if (W >= kPadRowsMinW) return {PadKernel::kRows, t.pad_rows == 1 ? 1 : 2};
  return {PadKernel::kFlat, 0};
}

// ---------------------------------------------------------------------------------------------------------------
// Two-pass kernels (group_norm_kernels.cuh): how rows are split over CTAs. docs/decisions/two-pass-split.md.

// CTAs per launch: enough to fill every SM four times. H100: 4 x 132 = 528.
inline int64_t target_ctas(const Device& d, const Tuning& t) {
  return t.target_ctas > 0 ? t.target_ctas : 4 * int64_t{d.sms};
}
// The backward's elementwise pass (NHWC: without an output activation) and NCHW reduction: twice that.
inline int64_t bwd_target_ctas(const Device& d, const Tuning& t) { return 2 * target_ctas(d, t); }

// NHWC: tpr threads across the C/V channel vectors of a row, rpi rows at once; CTAs take ranges of `chunk`
// rows: about `target` CTAs, at most kMaxNhwcRows rows each (more CTAs hide the GELU prologue's math), and at
// most 2^15 / D chunks (the finalize merges D*K partials per group).
// Example: 16x512x128x128 bf16 channels_last, V = 8: tpr = 64, rpi = 4 (256 threads), K = max(ceil(528 / 16),
// ceil(16384 / 2048)) = 33 chunks of 497 rows per image.
struct NhwcSplit {
  int tpr, rpi, threads;
  int64_t chunk, K;
};
inline NhwcSplit nhwc_split(const Problem& p, int V, int64_t target) {
  constexpr int kThreads = 256;
  constexpr int64_t kMaxNhwcRows = 2048;
  NhwcSplit s{};
  const int CV = static_cast<int>(p.C / V);
  s.tpr = std::min(CV, kThreads);
  s.rpi = std::max(1, kThreads / s.tpr);
  s.threads = static_cast<int>(round_up(static_cast<int64_t>(s.tpr) * s.rpi, 32));
  int64_t K = std::max(ceil_div(target, p.N), ceil_div(p.HxW, kMaxNhwcRows));
  K = std::min(K, ceil_div(p.HxW, static_cast<int64_t>(s.rpi) * kUnroll));
  K = std::min(K, std::max<int64_t>(1, (int64_t{1} << 15) / p.D));
  s.chunk = ceil_div(p.HxW, std::max<int64_t>(K, 1));
  s.K = ceil_div(p.HxW, s.chunk);
  return s;
}

// NCHW: each of the N*C rows split into K chunks (at most max_k) so that about `target` CTAs (a wave) run: at least
// `target`, or, for the forward's passes (whole_waves), one chunk fewer per row where that fills the waves better
// (the CTAs over whole waves of `target`); chunks start on `align_vecs`-vector boundaries (1 KB at the default 64:
// a chunk starting mid cache line made every warp's loads straddle one more line). Example: 1x128x2048x2048 bf16
// forward, 128 rows, target 528: K = 5 gives 640 CTAs, a second wave of 112 (0.61 of two waves), K = 4 gives 512
// (0.97 of one): K = 4 chunks of 1048576 elements (docs/decisions/two-pass-split.md).
struct RowSplit {
  int64_t K, chunk;
  int threads;
};
inline RowSplit nchw_row_split(const Problem& p, int V, int64_t max_k, int64_t target, int64_t align_vecs,
                               bool whole_waves) {
  const int64_t rows = p.N * p.C;
  auto fill = [&](int64_t k) {  // the CTAs' share of the waves they occupy
    return static_cast<double>(rows * k) / static_cast<double>(ceil_div(rows * k, target) * target);
  };
  int64_t K = 1;
  if (rows < target) {
    K = ceil_div(target, rows);  // >= 2
    if (whole_waves && fill(K - 1) > fill(K) + 0.05) --K;
    K = std::min(K, std::max<int64_t>(1, max_k));
  }
  RowSplit s{};
  const int64_t align = V * std::max<int64_t>(1, align_vecs);
  s.chunk = round_up(ceil_div(p.HxW, K), align);
  s.K = ceil_div(p.HxW, s.chunk);
  s.threads = static_cast<int>(std::clamp<int64_t>(round_up(ceil_div(s.chunk / V, kUnroll), 32), 32, kMaxThreads));
  return s;
}

// Whether `ctas` CTAs make waves of `resident` (the CTAs that fit at once) whose last is at least 70% full, or at
// least `many_waves` waves (their ends spread out): the chunk splits below stop at the first such count.
constexpr bool fills_resident_waves(int64_t ctas, int64_t resident, int64_t many_waves) {
  const int64_t last = ctas % resident;
  return last == 0 || last * 10 >= resident * 7 || ctas >= many_waves * resident;
}

// The forward's NCHW reduction without a prologue: chunks per row K, from nchw_row_split's k0 (waves of target_ctas)
// up to the first that fills_resident_waves of `resident` CTAs (reduce_fwd_ctas_per_sm per SM) or kReduceManyWaves
// waves; k0 where none up to max_k does. A last wave of a few CTAs streams its chunks at a fraction of DRAM's rate,
// and more, smaller chunks cost each CTA's start and block reduction.
// Example, H200 (264 resident), 1x288x768x768 fp16: k0 = 2 (576 CTAs, a last wave of 48) 264.2 µs; K = 3 (.27 full)
// 259.8; K = 4 (4.4 waves) 257.3; K = 7 260.8 (docs/decisions/two-pass-split.md#the-reduction-in-resident-waves).
constexpr int64_t kReduceManyWaves = 4;
constexpr int64_t reduce_fwd_chunks(int64_t rows, int64_t k0, int64_t resident, int64_t max_k) {
  for (int64_t k = k0; k <= max_k; ++k)
    if (fills_resident_waves(rows * k, resident, kReduceManyWaves)) return k;
  return k0;
}

// The reduction pass (prologue: x goes through an input prologue first). NHWC chunks are at least min(64, HxW / 32)
// rows where HxW >= 1024 (the split above cut 64x64 maps into 8-16-row chunks whose partials the finalize then had
// to merge; 2x640x64x64 fp16 CL forward 30.5 -> 21.8 µs on the H100); Tuning::nhwc_min_rows overrides.
inline ReduceGeometry reduce_geometry(const Problem& p, bool nhwc, int V, size_t state_bytes, bool bwd,
                                      const Device& d, const Tuning& t, int64_t esize, bool prologue) {
  ReduceGeometry g{};
  g.nhwc = nhwc;
  g.vec = V;
  if (nhwc) {
    const NhwcSplit s = nhwc_split(p, V, target_ctas(d, t));
    g.tpr = s.tpr, g.rpi = s.rpi, g.threads = s.threads, g.chunk = s.chunk, g.K = s.K;
    const int64_t rule = p.HxW >= 1024 ? std::min<int64_t>(64, p.HxW / 32) : 0;
    const int64_t min_rows = t.nhwc_min_rows >= 0 ? t.nhwc_min_rows : rule;
    if (min_rows > 0 && g.chunk < min_rows) {
      g.chunk = std::min(p.HxW, min_rows);
      g.K = ceil_div(p.HxW, g.chunk);
    }
    g.smem = static_cast<size_t>(g.rpi) * p.C * state_bytes;
    return g;
  }
  const int64_t max_k = p.HxW / 4096;
  RowSplit s = nchw_row_split(p, V, max_k, bwd ? bwd_target_ctas(d, t) : target_ctas(d, t), t.chunk_align, !bwd);
  if (!bwd && !prologue && t.target_ctas <= 0 && s.K < max_k) {
    const int64_t rows = p.N * p.C;
    const int64_t k = reduce_fwd_chunks(rows, s.K, reduce_fwd_ctas_per_sm(esize, V) * int64_t{d.sms}, max_k);
    if (k != s.K) s = nchw_row_split(p, V, k, rows * k, t.chunk_align, false);
  }
  g.K = s.K, g.chunk = s.chunk, g.threads = s.threads;
  return g;
}

constexpr bool persistent_kernels_pay(int64_t peak_gbs);
// NCHW long rows in tiles (a CTA per kMaxThreads x kUnroll vectors) rather than CTAs looping over chunks: on the H100
// forwards 2-13% and backwards 2-8% faster; on the H200 backwards 0-5%, float32 forwards 8%, 2-byte forwards 2-4%
// and, at three CTAs per SM (kAffineFwd16CtasPerSm), 2-byte forwards with SiLU, ReLU, tanh or hardswish 2-4.5%. The
// H200's 2-byte forwards with GELU (erf or tanh form), whose math spills at 40 registers, keep the loop: 3-8% faster
// there (docs/decisions/two-pass-split.md#three-ctas-per-sm-for-the-2-byte-forward).
constexpr bool affine_tiles(bool bwd, int act, int64_t esize, int64_t peak_gbs) {
  return bwd || esize >= 4 || persistent_kernels_pay(peak_gbs) || (act != kActGelu && act != kActGeluTanh);
}

// The forward's looping elementwise CTAs (where affine_tiles is false): chunks per row K. From target_ctas CTAs up,
// the fewest that fills_resident_waves of `resident` CTAs (affine_fwd_ctas_per_sm per SM) or kAffineLoopManyWaves
// waves; else the fullest last wave; at most max_k.
// Counted in target_ctas alone, a last wave of a few resident CTAs streamed at a fraction of DRAM's rate. Example,
// H200 (396 resident), 1x288x768x768 fp16 GroupNorm+GELU: K = 2 (576 CTAs, a last wave of 180) 329.6 µs; K = 4 (1152,
// last 360) 308.0 (docs/decisions/two-pass-split.md#looping-ctas-in-resident-waves).
constexpr int64_t kAffineLoopManyWaves = 8;
constexpr int64_t affine_loop_chunks(int64_t rows, int64_t target, int64_t resident, int64_t max_k) {
  int64_t best = max_k, best_last = -1;
  for (int64_t k = std::max<int64_t>(1, ceil_div(target, rows)); k <= max_k; ++k) {
    if (fills_resident_waves(rows * k, resident, kAffineLoopManyWaves)) return k;
    if (rows * k % resident > best_last) best = k, best_last = rows * k % resident;
  }
  return best;
}

// The elementwise pass. bwd: the backward's dx pass; act: the output activation (ActKind; the NHWC backward with
// one keeps target_ctas). Short NCHW rows are packed several to a CTA.
inline AffineGeometry affine_geometry(const Problem& p, bool nhwc, int V, int64_t esize, bool bwd, int act,
                                      const Device& d, const Tuning& t) {
  AffineGeometry g{};
  g.nhwc = nhwc;
  g.vec = V;
  const int64_t target = bwd && !(nhwc && act != kActIdentity) ? bwd_target_ctas(d, t) : target_ctas(d, t);
  if (nhwc) {
    const NhwcSplit s = nhwc_split(p, V, target);
    g.tpr = s.tpr, g.rpi = s.rpi, g.threads = s.threads, g.chunk = s.chunk;
    g.grid_x = static_cast<unsigned>(p.N);
    g.grid_y = static_cast<unsigned>(s.K);
    return g;
  }
  const int64_t rows = p.N * p.C, hwv = p.HxW / V;
  constexpr int64_t kVecsPerCta = kMaxThreads * kUnroll;
  int64_t rows_per_cta = std::max<int64_t>(1, kVecsPerCta / hwv);
  rows_per_cta = std::min(rows_per_cta, std::max<int64_t>(1, rows / target));
  if (rows_per_cta > 1) {
    g.rows_per_cta = static_cast<int>(rows_per_cta);
    g.threads = static_cast<int>(std::min<int64_t>(kMaxThreads, round_up(rows_per_cta * hwv, 32)));
    g.grid_x = static_cast<unsigned>(ceil_div(rows, rows_per_cta));
    g.grid_y = 1;
    g.chunk = p.HxW;
    return g;
  }
  // Tiles: a CTA per kVecsPerCta vectors of a row, one trip of kUnroll loads per thread, in a 1-D grid whose
  // consecutive CTAs are consecutive tiles in memory (affine_tiles).
  const int64_t tiles = ceil_div(hwv, kVecsPerCta);
  const bool tiled = t.affine_tile >= 0 ? t.affine_tile == 1 : affine_tiles(bwd, act, esize, d.peak_gbs);
  if (tiled && rows * tiles < (int64_t{1} << 31)) {
    const RowSplit s = nchw_row_split(p, V, tiles, rows * tiles, t.chunk_align, false);
    g.rows_per_cta = 0;
    g.chunk = s.chunk;
    g.threads = s.threads;
    g.grid_x = static_cast<unsigned>(rows * s.K);
    g.grid_y = 1;
    return g;
  }
  const int64_t max_k = std::max<int64_t>(1, hwv / kVecsPerCta);
  int64_t k = t.affine_k;  // chunks per row; <= 0: nchw_row_split's count in target_ctas
  if (k <= 0 && !bwd && t.target_ctas <= 0)
    k = affine_loop_chunks(rows, target, affine_fwd_ctas_per_sm(esize) * int64_t{d.sms}, max_k);
  const RowSplit s = k > 0 ? nchw_row_split(p, V, k, rows * k, t.chunk_align, false)
                           : nchw_row_split(p, V, max_k, target, t.chunk_align, !bwd);
  g.rows_per_cta = 1;
  g.chunk = s.chunk;
  g.threads = s.threads;
  g.grid_x = static_cast<unsigned>(rows);
  g.grid_y = static_cast<unsigned>(s.K);
  return g;
}

inline PartialLayout partial_layout(const Problem& p, const ReduceGeometry& g) {
  if (g.nhwc) return {g.K, g.K * p.C, 1, p.C};  // partial[(n * K + k) * C + c]
  return {g.K, p.C * g.K, g.K, 1};               // partial[(n * C + c) * K + k]
}

// Layout the kernels run in: NHWC for a channels_last x and for HxW == 1 (the same (N, C) memory), unless
// the NHWC reduction's rpi * C states exceed a block's shared memory (then an NCHW copy).
inline bool use_nhwc(const Problem& p, const Request& r, size_t state_bytes, const Device& d, const Tuning& t) {
  if (r.contiguous && p.HxW != 1) return false;
  const int V = vector_width(r.esize, p.C, r.aligned);
  return reduce_geometry(p, true, V, state_bytes, false, d, t, r.esize, r.prologue).smem <=
         static_cast<size_t>(d.smem_per_block);
}

// ---------------------------------------------------------------------------------------------------------------
// Persistent kernels against the streamed two-pass kernels, by peak DRAM bandwidth. Persistent forward: 1R + 1W
// at 2.0-2.7 TB/s (bytes in flight per SM); two-pass: 2R + 1W at ~0.95 of copy bandwidth. Persistent pays while
// 2 / 2.4 < 3 / (0.95 BW), i.e. BW < ~3.8 TB/s. Example: 8x256x256x256 bf16 forward, one-pass / two-pass µs:
// H100 (3352 GB/s) 269 / 276, H200 (4814-4916 GB/s) 247 / 210. docs/decisions/persistent-vs-streamed.md.
constexpr int64_t kPersistentMaxPeakGBs = 3800;
constexpr bool persistent_kernels_pay(int64_t peak_gbs) { return peak_gbs < kPersistentMaxPeakGBs; }
// It applies to one-pass forwards of at least 64 groups of at least 1 MiB (smaller groups are a tile or two with
// little waiting; 32 groups of 8 MiB tie).
constexpr int64_t kStreamedMinGroupBytes = int64_t{1} << 20;
constexpr int64_t kStreamedMinGroups = 64;
// Fewer groups stream too from 8 MiB a group: 32 groups of 8 MiB tie (1x128x1024x1024 fp16 220.6 two-pass / 222.8
// one-pass us on the H200) and 9-10 MiB ones lose in one-pass (docs/decisions/bulk.md#look-ahead-1-on-the-h200).
constexpr int64_t kStreamedFewGroupBytes = int64_t{8} << 20;

// ---------------------------------------------------------------------------------------------------------------
// One-pass kernels (group_norm_onepass.cuh): a persistent cooperative grid of `ctas` CTAs per SM holds each
// group's tiles in shared memory until the group's statistics are complete. docs/decisions/onepass.md.
//
// Example: NCHW 2x320x64x64 fp16, G = 32 (D = 10), H100: 2 CTAs per SM -> 264 slots of 114688 stage bytes;
// 64 units of 40960 elements. 4 * 64 <= 264, so it first tries 264 / 64 = 4 CTAs per group (2-channel tiles,
// 320 tiles > 264 slots: dropped), then one whole-group tile per CTA: 64 CTAs, no inter-CTA waits.
// Example (ragged): NCHW 32x2048x7x7 bf16 with tanh (no small-group kernel for it): HxW = 49 is not a multiple of
// V = 8 but D*HxW = 3136 is, and 1024 groups >= 132 SMs: 1024 whole-group tiles streamed through 528 CTAs (4 per
// SM: many small groups).
constexpr int kRaggedSmallBytes = 1 << 20;  // tiny ragged groups below a group per SM: tensors up to this

inline std::optional<OnePassGeometry> onepass_geometry(const Problem& p, const Request& r, bool bwd, bool nhwc,
                                                       const Device& d, const Tuning& tun, int pack_ctas = 0,
                                                       int64_t pack_tile = 0) {
  const int onepass = tun.onepass;
  if (onepass == 0) return std::nullopt;
  int V = vector_width(r.esize, nhwc ? p.C : p.HxW, r.aligned);
  // Ragged NCHW forward: HxW not a multiple of the vector but D*HxW is: whole-group tiles whose vectors may
  // straddle channels. The backward's per-channel sums and a prologue's per-channel bias need channel-aligned
  // vectors.
  const int Vg = V == 1 && !nhwc && !bwd && !r.prologue ? vector_width(r.esize, p.D * p.HxW, r.aligned) : 1;
  const bool ragged = Vg > 1;
  if (ragged) V = Vg;
  if (V == 1) return std::nullopt;
  const int64_t esize = r.esize;
  if (!bwd && !nhwc && !ragged && onepass != 2 && !persistent_kernels_pay(d.peak_gbs) &&
      p.D * p.HxW * esize >= kStreamedMinGroupBytes &&
      (p.N * p.G >= kStreamedMinGroups || p.D * p.HxW * esize >= kStreamedFewGroupBytes))
    return std::nullopt;
  const int64_t bytes = esize * (bwd ? 2 : 1);  // stage bytes per element
  // Many small NCHW groups (>= 2 per SM, <= 16 KB of stage each): 4 CTAs per SM of 128 threads, so that each SM
  // has four chains of load -> reduce -> normalize instead of two (32x2048x7x7 bf16 29.2 -> 20.9 µs, H100).
  const bool many_small = !nhwc && p.N * p.G >= 2 * d.sms && p.D * p.HxW * bytes <= 16384;
  const int ctas = pack_ctas > 0 ? pack_ctas : std::clamp(tun.onepass_ctas > 0 ? tun.onepass_ctas : many_small ? 4 : 2, 1, 4);
  const int stages = std::clamp(tun.onepass_nbuf, 2, 4);
  const int64_t slots = int64_t{d.sms} * ctas;  // co-resident CTAs
  const int threads = std::max(128, kOnePassThreads / ctas / 32 * 32);
  const int64_t per_cta = ctas == 1 ? d.smem_per_block : d.smem_per_sm / ctas - d.smem_reserved;
  const int64_t avail0 = std::min<int64_t>(per_cta, d.smem_per_block) - static_cast<int64_t>(kOnePassStaticSmem);
  const int64_t ragged_small = tun.ragged_small >= 0 ? tun.ragged_small : kRaggedSmallBytes;
  // Plan for NHWC blocks of cb channels (cb = 0: NCHW).
  auto plan = [&](int64_t cb) -> std::optional<OnePassGeometry> {
    const int64_t extra = nhwc ? threads * V * 8 + cb * 16 : 0;  // NHWC: per-thread sums, per-channel coefs
    const int64_t avail = avail0 - extra;
    const int64_t U = nhwc ? p.N * (p.C / cb) : p.N * p.G;  // units: groups (NCHW), channel blocks (NHWC)
    const int64_t L = nhwc ? cb * p.HxW : p.D * p.HxW;      // elements per unit
    // Tiles of at most `cap` elements. NCHW: whole channels (balanced over the group) or equal pieces of one;
    // NHWC: equal ranges of pixel rows.
    auto make = [&](int nbuf, int64_t cap) -> std::optional<OnePassGeometry> {
      OnePassGeometry g{};
      g.nbuf = nbuf, g.vec = V, g.threads = threads, g.nhwc = nhwc, g.units = U;
      if (nhwc) {
        const int64_t rows = cap / cb;
        if (rows < 1) return std::nullopt;
        g.cb = cb;
        g.T = ceil_div(p.HxW, rows);
        g.rows = ceil_div(p.HxW, g.T);
        g.tile = g.rows * cb;
        g.sub = g.cpt = 1;
      } else {
        cap = cap / V * V;
        if (cap < V) return std::nullopt;
        if (p.HxW <= cap) {
          g.T = ceil_div(p.D, cap / p.HxW);
          g.cpt = ceil_div(p.D, g.T);
          g.sub = 1;
          g.tile = g.cpt * p.HxW;
        } else {
          g.sub = ceil_div(p.HxW, cap);
          g.tile = round_up(ceil_div(p.HxW, g.sub), V);
          g.cpt = 1;
          g.T = p.D * g.sub;
        }
      }
      // Ragged: whole-group tiles only, and at least a group per SM (fewer leave SMs idle where the scalar
      // two-pass kernels use them all), except groups of <= 4 KB in a tensor of <= ragged_small bytes.
      const bool tiny = L * esize <= 4096 && p.N * p.C * p.HxW * esize <= ragged_small;
      if (ragged && (g.T != 1 || (U < d.sms && !tiny))) return std::nullopt;
      g.ragged = ragged;
      // Groups of several tiles publish early (every wave otherwise waits for the slowest CTA of the last).
      g.early = tun.onepass_early == kRule ? g.T > 1 : tun.onepass_early != 0;
      const int64_t tiles = g.units * g.T;
      g.grid = static_cast<unsigned>(std::min(tiles, slots));
      if (g.T > g.grid || (nbuf == 1 && tiles > g.grid)) return std::nullopt;
      g.smem = static_cast<size_t>(nbuf * g.tile * bytes + extra);
      return g;
    };
    // Few units: split each over slots / U CTAs, one tile per CTA. Up to one unit per CTA: one tile each, no
    // inter-CTA waits. Otherwise stream tiles through `stages` (else 2) stages.
    if (avail <= 0) return std::nullopt;
    if (pack_tile > 0) return make(stages, pack_tile);
    if (4 * U <= slots)  // NHWC: the cap in whole pixel rows, rounded up
      if (auto g = make(1, std::min(avail / bytes, round_up(ceil_div(L, slots / U), nhwc ? cb : V)))) return g;
    if (U <= slots)
      if (auto g = make(1, avail / bytes)) return g;
    if (nhwc) return std::nullopt;  // NHWC streamed through stages lost to two-pass (UNet 16x512x128x128 bf16)
    // Backward, streamed, groups of 3 or more tiles and more groups than SMs: two-pass wins (CTAs wait on their
    // group wave after wave), except on tensors of >= 512 MiB, where two-pass's second read comes from DRAM. So it
    // does, with an output activation (its derivative per element in the one-pass finish), for 16-bit groups of one
    // or two tiles that outnumber the CTA slots: H100 32x256x56x56 bf16 GroupNorm+SiLU backward 125.7 -> 113.5 µs
    // (docs/decisions/onepass.md).
    const bool big = p.N * p.C * p.HxW * esize >= (int64_t{512} << 20);
    auto streamed = [&](const OnePassGeometry& g) -> std::optional<OnePassGeometry> {
      if (!bwd || onepass == 2 || big) return g;
      if (g.T >= 3 && U > d.sms) return std::nullopt;
      if (r.act != kActIdentity && esize == 2 && U > slots) return std::nullopt;  // here g.T <= 2
      return g;
    };
    if (auto g = make(stages, avail / stages / bytes)) return streamed(*g);
    if (stages != 2)
      if (auto g = make(2, avail / 2 / bytes)) return streamed(*g);
    return std::nullopt;
  };
  if (!nhwc) {
    const std::optional<OnePassGeometry> g = plan(0);
    if (pack_ctas > 0 || !g || g->units * g->T <= g->grid || tun.onepass_ctas > 0 || tun.onepass_pack == 0) return g;
    // Streamed NCHW tiles of whole channels can leave stages unused (16x256x16000 bf16: a 16000-element channel
    // per 28K-element stage); then more CTAs per SM fit with the same tiles (140.7 -> 122.2 µs, H100).
    const int64_t need = static_cast<int64_t>(g->smem + kOnePassStaticSmem) + d.smem_reserved;
    const int fit = static_cast<int>(std::min<int64_t>(4, d.smem_per_sm / need));
    if (fit <= ctas) return g;
    const std::optional<OnePassGeometry> q = onepass_geometry(p, r, bwd, nhwc, d, tun, fit, g->tile);
    return q && q->T == g->T && q->tile == g->tile && q->nbuf == g->nbuf ? q : g;
  }
  // NHWC one-pass pays only with at most 16 tiles per unit on tensors of at least 4 MiB (2x640x64x64 fp16 CL,
  // T = 33: won; 1x512x64x64, T = 128: lost).
  auto pays = [&](const std::optional<OnePassGeometry>& g) -> std::optional<OnePassGeometry> {
    if (!g || onepass == 2) return g;
    if (g->T > 16 || p.N * p.C * p.HxW * esize < (int64_t{4} << 20)) return std::nullopt;
    return g;
  };
  // NHWC units: blocks of whole groups, rows of 16-byte multiples, at most `threads` channels. The widest block
  // that fits wins; blocks under 128 bytes per row only when nothing wider fits.
  int64_t narrow = 0;
  for (int64_t cb = std::min<int64_t>(p.C, threads) / p.D * p.D; cb >= p.D; cb -= p.D) {
    if (p.C % cb != 0 || (cb * esize) % 16 != 0) continue;
    if (cb * esize < 128) {
      if (narrow == 0) narrow = cb;
      continue;
    }
    if (auto g = plan(cb)) return pays(g);
  }
  return narrow > 0 ? pays(plan(narrow)) : std::nullopt;
}

// The one-pass kernels take a pointwise extension only in NCHW.
constexpr bool onepass_allows(const Request& r, bool nhwc) {
  return !nhwc || (!r.prologue && r.act == kActIdentity && !r.residual);
}

// ---------------------------------------------------------------------------------------------------------------
// Small-group kernels (group_norm_small.cu): NCHW memory (or HxW == 1), no prologue, at least 64 groups of at
// most kSmallMaxVecs vectors, each held in registers by the fewest lanes (a power of two) taking at most 4
// vectors (8 at 32 lanes), then more lanes while the grid has fewer than small_fill CTAs per SM. Larger groups
// (up to 8 vectors per thread of a CTA; the forward 16, 64 KB groups, but for 2-byte GELU) get a CTA each where
// there is at least small_cta_min group per SM (identity, SiLU, ReLU, GELU). docs/decisions/small-groups.md.
// Example: ResNet-50-GN 32x512x28x28 fp32: 1024 groups of 3136 vectors, 13 per thread of a CTA (registers for 16,
// 2 CTAs per SM) instead of the one-pass forward's 4 tiles per persistent CTA: 52.4 -> 42.2 µs with SiLU (H200).
// Example: 256x1024x1x1 bf16 G=32: 8192 groups of 32 elements (4 vectors): 1 lane each gives 32 CTAs, under
// the 264 of the fill rule -> 2 lanes (64 CTAs) -> 4 lanes (128 CTAs, one vector per lane: no more lanes).
constexpr int64_t kSmallMinGroups = 64;
inline std::optional<SmallGeometry> small_geometry(const Problem& p, const Request& r, bool bwd, const Device& d,
                                                   const Tuning& t) {
  if (t.small == 0 || r.prologue || p.N * p.G < kSmallMinGroups) return std::nullopt;
  const int64_t L = p.D * p.HxW;
  const int V = vector_width(r.esize, L, r.aligned);
  if (V == 1) return std::nullopt;
  const int64_t nvec = L / V;
  SmallGeometry g{};
  g.vec = V;
  const bool cta_plan = nvec > kSmallMaxVecs;
  if (cta_plan) {
    if (!small_cta_act(r.act)) return std::nullopt;
    // The forward holds up to 16 vectors per thread; 2-byte GELU and the backward (x and dy) 8.
    const int kmax = bwd || (r.act == kActGelu && r.esize == 2) ? kSmallMaxVecs / 32 : kSmallCtaFwdMaxK;
    const bool fits = nvec <= int64_t{kSmallThreads} * kmax &&
                      p.N * p.G >= int64_t{t.small_cta_min} * d.sms;
    // The backward with an activation stops at 4 vectors per thread (8 took 210 registers).
    const bool act_bwd_fits = !bwd || r.act == kActIdentity || nvec <= int64_t{kSmallThreads} * 4;
    if (!fits || !act_bwd_fits || t.small_cta == 0 || (t.small_cta == 1 && !bwd)) return std::nullopt;
    g.lanes_log2 = kSmallCtaLog2;
    g.k = static_cast<int>(ceil_div(nvec, int64_t{kSmallThreads}));
    g.grid = static_cast<unsigned>(p.N * p.G);
  } else {
    g.lanes_log2 = 0;
    while (g.lanes_log2 < 5 && (int64_t{4} << g.lanes_log2) < nvec) ++g.lanes_log2;
    auto grid_of = [&](int lanes_log2) {
      return ceil_div(ceil_div(p.N * p.G, int64_t{32} >> lanes_log2), int64_t{kSmallThreads / 32});
    };
    const int64_t fill = int64_t{t.small_fill} * d.sms;
    while (g.lanes_log2 < 5 && (int64_t{1} << g.lanes_log2) < nvec && grid_of(g.lanes_log2) < fill) ++g.lanes_log2;
    g.k = static_cast<int>(ceil_div(nvec, int64_t{1} << g.lanes_log2));
    g.grid = static_cast<unsigned>(grid_of(g.lanes_log2));
  }
  // Registers sized by k (1, 2, 4, 8) for the activations that have those variants.
  const bool sized = cta_plan || (small_sized_act(r.act) && t.small_kreg != 8);
  g.kreg = g.k > 8 ? 16 : !sized ? 8 : g.k <= 1 ? 1 : g.k <= 2 ? 2 : g.k <= 4 ? 4 : 8;
  g.smem = 0;
  if (bwd) {  // a CTA's per-channel pieces: one group's (CTA per group) or those of all its warps' groups
    const SmallPieces pc(static_cast<uint32_t>(p.HxW), static_cast<uint32_t>(V));
    const int64_t groups_per_cta = cta_plan ? 1 : (kSmallThreads / 32) * (int64_t{32} >> g.lanes_log2);
    if (!pc.direct) g.smem = static_cast<size_t>(groups_per_cta * p.D * pc.slots * 8);
    if (g.smem > kSmallMaxSmem) return std::nullopt;
  }
  return g;
}

// ---------------------------------------------------------------------------------------------------------------
// Wide kernels (group_norm_wide.cuh): one CTA per SM, each a 1 KB-aligned slice of every group, as much of it as
// fits kept in shared memory and the rest in L2 between the two reads. Every group costs a grid-wide wait, which
// the saved re-read must outweigh: groups of >= 16 MiB forward, >= 24 MiB backward (48 MiB with an activation),
// and only where persistent kernels pay. docs/decisions/wide.md.
// Example: 1x128x2048x2048 bf16 forward on the H100: 32 groups of 32 MiB, slices of 127488 elements. With the
// look-ahead's two buffers 17.4 MiB of each group would wait in L2, three such rests over half of L2: one buffer,
// 115712 elements (226 KiB) held per CTA, 2.9 MiB per group in L2.
constexpr int64_t kWideMinBytes = int64_t{16} << 20;
constexpr int64_t kWideMinBytesBwd = int64_t{24} << 20;
constexpr int64_t kWideMinBytesBwdAct = int64_t{48} << 20;
constexpr int64_t kWideNhwcMinBytes = int64_t{8} << 20;

// Stage buffers of a wide plan whose grid and slice are set: `tensors` staged tensors, 1 + ahead buffers each,
// out of `avail` bytes, plus `extra`. A forward with the look-ahead has three units' rests in L2 at once, kept
// under half of L2, else no look-ahead. Sets g.held, g.ahead, g.smem; returns the bytes beyond shared memory.
inline int64_t wide_stages(WideGeometry& g, int64_t esize, int64_t unit_bytes, int tensors, bool ahead, int64_t avail,
                           int64_t align, int64_t extra, const Device& d, const Tuning& t) {
  int64_t rest = 0;
  auto fill = [&](int a) {
    const int64_t parts = int64_t{tensors} * (1 + a);
    int64_t held = std::min<int64_t>(avail / parts / align * align, g.slice * esize);
    if (t.wide_held >= 0) held = std::min<int64_t>(held, t.wide_held / 16 * 16);
    g.held = held / esize;
    g.ahead = a;
    g.smem = static_cast<size_t>(parts * held + extra);
    rest = tensors * (unit_bytes - static_cast<int64_t>(g.grid) * held);
  };
  fill(ahead && t.wide_ahead != 0 ? 1 : 0);
  if (g.ahead == 1 && 3 * rest > d.l2_bytes / 2) fill(0);
  return rest;
}

// NCHW wide forward or backward, for groups the one-pass plan did not take. epilogue: an output activation or
// residual.
inline std::optional<WideGeometry> wide_geometry(const Problem& p, const Request& r, bool epilogue, bool bwd,
                                                 const Device& d, const Tuning& t) {
  if (t.wide == 0 || r.prologue || d.major < 8 || vector_width(r.esize, p.HxW, r.aligned) == 1) return std::nullopt;
  const int64_t esize = r.esize, L = p.D * p.HxW, tensors = bwd ? 2 : 1, bytes = tensors * L * esize;
  if (L >= (int64_t{1} << 31)) return std::nullopt;  // offsets within a group are 32-bit
  WideGeometry g{};
  g.slice = round_up(ceil_div(L, d.sms), 1024 / esize);
  if (bwd && g.slice > p.HxW) return std::nullopt;  // the backward sums a slice's first two channels only
  g.grid = static_cast<unsigned>(ceil_div(L, g.slice));
  g.threads = kWideThreads;
  const int64_t rest = wide_stages(g, esize, L * esize, static_cast<int>(tensors), /*ahead=*/!bwd,
                                   d.smem_per_block - static_cast<int64_t>(kWideStaticSmem), 1024, 0, d, t);
  if (t.wide == 2) return g;
  if (!persistent_kernels_pay(d.peak_gbs)) return std::nullopt;
  const int64_t min_bytes = bwd ? (epilogue ? kWideMinBytesBwdAct : kWideMinBytesBwd) : kWideMinBytes;
  const int64_t max_rest = bwd ? d.l2_bytes : d.l2_bytes / 4;
  if (bytes < min_bytes || rest > max_rest) return std::nullopt;
  return g;
}

// Channels_last wide forward: single images (N = 1) of at least kWideNhwcMinBytes whose part beyond shared
// memory fits a quarter of L2 (several images lose: each costs ~9 µs of grid-wide wait against ~5.6 µs of saved
// re-read per 16.8 MB image on the H100). Needs C % V == 0, aligned pointers, at most two groups per vector and
// lcm(C / V, 32) <= kWideThreads. Example: 1x512x128x128 fp16: 64 vectors per row, 512 threads (8 rows a step),
// 125 rows (64000 elements) per CTA, 132 CTAs.
inline std::optional<WideGeometry> wide_nhwc_geometry(const Problem& p, const Request& r, const Device& d,
                                                      const Tuning& t) {
  const int64_t esize = r.esize, V = 16 / esize;
  if (t.wide_nhwc == 0 || r.prologue || d.major < 8 || vector_width(esize, p.C, r.aligned) != V) return std::nullopt;
  const int64_t CV = p.C / V, L = p.C * p.HxW;
  if (CV > kWideThreads) return std::nullopt;
  for (int64_t cv = 0; cv < CV; ++cv)  // at most two groups per vector
    if ((cv * V + V - 1) / p.D - (cv * V) / p.D > 1) return std::nullopt;
  const int64_t unit = std::lcm(CV, int64_t{32});  // whole rows and whole warps
  if (unit > kWideThreads) return std::nullopt;
  WideGeometry g{};
  g.threads = static_cast<int>(kWideThreads / unit * unit);
  const int64_t srows = ceil_div(p.HxW, int64_t{d.sms});
  g.slice = srows * p.C;
  g.grid = static_cast<unsigned>(ceil_div(p.HxW, srows));
  const int64_t stats = int64_t{g.threads} * 2 * static_cast<int64_t>(sizeof(float)) * 3 + p.G * 8;
  const int64_t avail = d.smem_per_block - static_cast<int64_t>(kWideStaticSmem) - round_up(stats, 16);
  if (avail <= 0) return std::nullopt;
  const int64_t rest = wide_stages(g, esize, L * esize, 1, /*ahead=*/p.N > 1, avail, 16, round_up(stats, 16), d, t);
  if (t.wide_nhwc == 2) return g;
  if (p.N != 1 || L * esize < kWideNhwcMinBytes || rest > d.l2_bytes / 4) return std::nullopt;
  return g;
}

// ---------------------------------------------------------------------------------------------------------------
// Bulk forward (group_norm_bulk.cuh, sm_90+): one CTA per SM, a slice of cnt chunks of every NCHW group, copied into
// a ring of shared-memory chunks by bulk asynchronous copies and normalized from there. The ring holds the slices
// of ahead + 1 groups plus 16 KiB (at least a chunk) being copied; ahead = the largest of 4 (kBulkSlots - 2) .. 1 that
// fits (the statistics of a group are complete `ahead` groups before they are needed). The bytes in flight per SM
// are the free stages, not registers: it streams where the one-pass kernels do not (docs/decisions/bulk.md). It
// runs for slices of more than 8 chunks: below that the grid-wide chain per group (~3 µs, one group after another,
// with one team of every CTA; teams, below, lengthen the slices) costs more than the group's DRAM time (H100: 2 MiB
// groups, 4 chunks, 1.7x slower than one-pass; 4 MiB groups, 8 chunks, -10% to +2%; 8 MiB groups, 16 chunks,
// 13-27% faster).
// Example: 1x128x1024x1024 fp16, H100 (132 SMs, 232448 B per block): 8 MiB groups = 2048 chunks of 4 KiB, 16 per
// CTA; (232448 - 2560) / 4096 -> 56 stages; 5 x 16 + 4 and 4 x 16 + 4 exceed 56, 3 x 16 + 4 does not: ahead 2.
constexpr int kBulkChunk = 4096;
constexpr int kBulkSpareStages = 4;
constexpr int64_t kBulkMinChunks = 9;
constexpr int64_t kBulkMinChunksBwd = 8;
constexpr int kBulkStreamStages = 8;
// Faster memory (peak >= 3.8 TB/s, the H200; docs/decisions/bulk.md): the forward copies chunks of
// kBulkChunkFast bytes (a copy costs the producer about the same time at 4 and at 8 KiB: with 4 KiB copies the ring
// fills at ~2 TB/s on the H200, under its read rate), each cut into 4 KiB parts for the consumer warps, at look-ahead
// 2; it takes held slices of at least kBulkMinChunksFast x 4 KiB. Slices streamed in 16 KiB copies lose to
// two-pass. The backward (4 KiB chunks) keeps the rule below for identity and ReLU, and takes SiLU on float32 only
// (its 2-byte slices lose).
// Example: 1x128x1024x1024 bf16 forward on the H200: 8 MiB groups = 512 chunks of 16 KiB, 4 per CTA; (232448 -
// 2560) / 16384 -> 14 stages; 3 x 4 + 1 <= 14: look-ahead 2, 16 consumer warps on the 16 parts of a slice.
constexpr int kBulkChunkFast = 16384;
constexpr int64_t kBulkMinChunksFast = 16;
constexpr int kBulkAheadFast = 2;
// A slice that 16 KiB copies can only stream is retried with kBulkChunkStreamFast copies (2 parts): twice the
// stages, so more of each slice is held and less read again from L2.
// Example: 1x256x1024x1024 bf16 on the H200: 16 MiB groups; 16 KiB: 8 chunks per CTA in 14 stages, streamed, 5 of
// them read again (20.6 MiB in flight: over a quarter of its 60 MiB L2); 8 KiB: 16 chunks in 28 stages, hold 10,
// 6 read again (12.4 MiB): streamed in 8 KiB copies.
constexpr int kBulkChunkStreamFast = 8192;

// Teams (forward): the grid is cut into teams of CTAs, team t taking groups t, t + teams, ...: each team's
// grid-wide chain per group overlaps the others', and each CTA's slice is longer than with one team. The most teams
// (of >= kBulkMinTeam CTAs, with >= 2 groups each: a team of one group overlaps nothing) whose slices the ring
// still holds kBulkTeamAhead + 1 times: the H100 measured slices of 8-16 chunks at look-ahead 2-3 fastest, longer
// ones at look-ahead 1 or streamed slower, smaller teams slower (docs/decisions/bulk.md). team = sms / teams
// (grid >= sms - teams + 1).
// Example: L2#19's GroupNorm, 128x64x258x258 fp32 G = 8, 1024 groups of 2.1 MB = 520 chunks of 4 KiB, H100
// (56 stages: (56 - 4) / 3 = 17 chunks at look-ahead 2): teams of >= 31 CTAs -> 4 teams of 33, 16 chunks per slice
// (one team: 4 chunks, too short for the bulk forward). 8x512x4096 fp32, 256 KiB groups (64 chunks): 33 teams of 4.
// The H200 takes the same plans (4 KiB copies, below).
constexpr int kBulkMinTeam = 4;
constexpr int kBulkTeamAhead = 2;
inline int bulk_teams(int64_t group_chunks, int64_t groups, int64_t cap, int sms, int knob) {
  if (knob >= 1) return std::min(knob, sms);
  const int64_t team = std::max<int64_t>(kBulkMinTeam, ceil_div(group_chunks, std::max<int64_t>(cap, 1)));
  if (2 * team > sms) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sms / team, groups / 2)));
}

// Consumer warps before any rule: GNEXT_BULK_CONSUMERS where set (clamped), else the most.
inline int bulk_consumer_warps(const Tuning& t, bool bwd) {
  const int most = bwd ? kBulkMaxConsumersBwd : kBulkMaxConsumers;
  return t.bulk_consumers == kRule ? most : std::clamp(t.bulk_consumers, 1, most);
}

// Where the ring holds (ahead + 1) slices (ahead >= 1), every chunk stays in shared memory until its group is
// normalized. Where it does not (streamed), the look-ahead is 1: `hold` chunks of each slice stay in a region of
// 2 * hold stages, and the rest pass through the other stages (at least kBulkStreamStages, and one per warp that
// takes streamed chunks), released after the statistics and read again from L2. The backward (bwd): a stage holds
// a chunk of x and one of dy (8 KiB), and its slices must lie within two channels (slice <= HxW).
// Examples, H100: 1x256x1024x1024 bf16 forward, 16 MiB groups, 32 chunks per CTA, 56 stages; 2 x 32 + 4 > 56:
// streamed, hold 24 (56 - 2 x 24 = 8 stages for the 8 streamed chunks), 4.1 MiB of each group read again from L2.
// 1x128x1024x1024 fp16 backward: 16 chunks of x and dy per CTA, (232448 - 2560) / 8192 -> 28 stages; 2 x 16 + 4 > 28:
// streamed, hold 10 (8 stages for the 6 streamed chunks), 6.2 MiB of each group read again.
// header: the bytes before the ring (the channels_last forward's is larger: bulk_nhwc_header_bytes).
inline std::optional<BulkGeometry> bulk_geometry(const Problem& p, const Request& r, bool bwd, const Device& d,
                                                 const Tuning& t, size_t header = kBulkHeader) {
  const int64_t esize = r.esize, L = p.D * p.HxW;
  const bool contiguous = bwd ? r.flat && r.need_dx : r.contiguous;
  if ((bwd ? t.bulk_bwd : t.bulk) == 0 || r.prologue || !contiguous || d.major < 9 ||
      vector_width(esize, p.HxW, r.aligned) == 1 || L >= (int64_t{1} << 31))
    return std::nullopt;
  BulkGeometry g{};
  g.consumers = bulk_consumer_warps(t, bwd);
  const bool fast = !persistent_kernels_pay(d.peak_gbs);
  // Teams copy 4 KiB chunks on every device: on the H200 they measured as fast as 16 KiB copies or faster, and the
  // ring holds 17 chunks of a slice at look-ahead 2 instead of 4 (docs/decisions/bulk.md). Larger copies stay with
  // one team.
  if (!bwd && fast && t.bulk_chunk <= 0) {
    Tuning four = t;
    four.bulk_chunk = kBulkChunk;
    if (const auto g4 = bulk_geometry(p, r, false, d, four, header); g4 && g4->team != g4->grid) return g4;
  }
  g.chunk = bwd ? kBulkChunk : t.bulk_chunk > 0 ? t.bulk_chunk : fast ? kBulkChunkFast : kBulkChunk;
  // The producer counts stages up only in the H200's forward: the H100 measured 5-8% slower that way, and the H200's
  // held backward 1.09x slower (docs/decisions/bulk.md).
  g.per_chunk = t.bulk_pace >= 0 ? t.bulk_pace == 1 : bwd || !fast;
  g.parts = g.chunk / kBulkChunk;  // 4 KiB per consumer warp
  if (g.chunk % kBulkChunk != 0 || !bulk_parts_compiled(g.parts) || g.consumers % g.parts != 0) return std::nullopt;
  const int64_t stage_bytes = int64_t{bwd ? 2 : 1} * g.chunk;
  g.stages = static_cast<int>(std::min<int64_t>(
      kBulkMaxStages, (d.smem_per_block - static_cast<int64_t>(header)) / stage_bytes));
  const int spare = std::max(1, kBulkSpareStages * kBulkChunk / g.chunk);
  const int64_t group_chunks = ceil_div(L * esize, g.chunk);
  const int teams = bwd || (fast && g.chunk != kBulkChunk && t.bulk_teams < 1)
                        ? 1
                        : bulk_teams(group_chunks, p.N * p.G, (g.stages - spare) / (kBulkTeamAhead + 1), d.sms,
                                     t.bulk_teams);
  g.team = static_cast<unsigned>(d.sms / teams), g.grid = g.team * static_cast<unsigned>(teams);
  const int64_t cnt = ceil_div(group_chunks, int64_t{g.team});  // chunks per slice, at most
  if (bwd && (cnt * (g.chunk / esize) > p.HxW || d.sms > kBulkMaxGridBwd)) return std::nullopt;
  if (header == kBulkHeader && bulk_header_bytes(g.stages, g.consumers, bwd) > kBulkHeader) return std::nullopt;
  const int lowest = bwd ? 0 : 1;
  const int want = t.bulk_ahead >= 0 ? std::clamp(t.bulk_ahead, lowest, kBulkSlots - 2)
                   : fast && !bwd    ? kBulkAheadFast
                                     : kBulkSlots - 2;
  g.ahead = -1;
  for (int ahead = want; ahead >= lowest && g.ahead < 0; --ahead)
    if ((ahead + 1) * cnt + spare <= g.stages &&
        (ahead >= 1 || t.bulk_ahead == 0))
      g.ahead = ahead;
  if (g.ahead < 0 || t.bulk_hold >= 0) {  // streamed
    g.stream = true;
    g.ahead = t.bulk_ahead >= 1 ? std::min(want, kBulkSlots - 2) : 1;
    // The most chunks held that leave each streaming warp a stage of its own, and kBulkStreamStages in all.
    const int most = t.bulk_hold >= 0 ? t.bulk_hold : g.stages;
    g.hold = -1;
    for (int h = std::min<int64_t>(most, cnt); h >= 0 && g.hold < 0; --h) {
      const int64_t left = g.stages - int64_t{g.ahead + 1} * h;
      if (left >= std::min<int64_t>(g.consumers / g.parts, cnt - h) && (left >= kBulkStreamStages || t.bulk_hold >= 0) && left > 0)
        g.hold = h;
    }
    if (g.hold < 0) return std::nullopt;
  }
  if (g.ahead < 0) return std::nullopt;
  g.header = header;
  g.smem = header + static_cast<size_t>(g.stages * stage_bytes);
  if ((bwd ? t.bulk_bwd : t.bulk) == 2) return g;
  if (cnt * g.parts < (bwd ? kBulkMinChunksBwd : kBulkMinChunks)) return std::nullopt;
  if (fast && !bwd && g.stream && g.chunk == kBulkChunkFast && t.bulk_chunk <= 0) {
    Tuning half = t;
    half.bulk_chunk = kBulkChunkStreamFast;
    return bulk_geometry(p, r, bwd, d, half, header);
  }
  if (fast && (bwd ? r.act != kActIdentity && r.act != kActRelu && (r.act != kActSilu || esize < 4)
                   : teams == 1 &&
                         ((g.stream && g.chunk != kBulkChunkStreamFast) || cnt * g.parts < kBulkMinChunksFast)))
    return std::nullopt;
  // Streamed: the parts read again, of the ahead + 1 groups in flight, within a quarter of L2; beyond it they miss
  // L2 and go back to DRAM (docs/decisions/bulk.md).
  if (g.stream && (g.ahead + 1) * (cnt - g.hold) * stage_bytes * g.grid > d.l2_bytes / 4) return std::nullopt;
  // An output activation's derivative is taken twice per element (statistics and dx) by the consumer warps. ReLU's and
  // SiLU's keep up everywhere; GELU's (erf) only on float32 slices held in the ring: streamed (L2 re-reads on top) or
  // on 2-byte elements (twice the elements per byte) it loses. The others are unmeasured (docs/decisions/bulk.md).
  if (bwd && r.act != kActIdentity && r.act != kActRelu && r.act != kActSilu &&
      (r.act != kActGelu || g.stream || esize < 4))
    return std::nullopt;
  return g;
}

// Held slices at look-ahead 1 on >= 3.8 TB/s: each group's grid-wide chain (publish, wait for every CTA, merge) is
// hidden behind one group's work only, and measured ~8-10 us per group on the H200 whatever the group's size (9, 10
// and 12 MiB fp16 groups), while two-pass costs 3 passes at ~0.9 of the copy rate, ~0.8 us per MiB of group. Two-pass
// wins below ~11 MiB: slices of fewer than kBulkMinPartsAhead1Fast parts of 4 KiB (5 copies of 16 KiB, groups of 8.3
// to 10.3 MiB) go two-pass (docs/decisions/bulk.md#look-ahead-1-on-the-h200). The 4 KiB copies of float32 slices keep
// the bulk forward (1x128x768x768 fp32: GroupNorm 1.11x faster in bulk, GroupNorm+SiLU 1.02x slower).
// Example: 1x256x768x768 fp16 on the H200: 9 MiB groups, 5 copies of 16 KiB per CTA = 20 parts: two-pass (GroupNorm+SiLU
// 295.3 -> 237.6 us). 1x192x1024x1024 fp16: 12 MiB groups, 24 parts: bulk (318.1 against 339.2 two-pass).
constexpr int64_t kBulkMinPartsAhead1Fast = 24;
// Parts of 4 KiB in a CTA's slice of one group, at most.
inline int64_t bulk_slice_parts(const Problem& p, const Request& r, const BulkGeometry& g) {
  return ceil_div(ceil_div(p.D * p.HxW * r.esize, int64_t{g.chunk}), int64_t{g.team}) * g.parts;
}
inline bool bulk_ahead1_loses(const Problem& p, const Request& r, const BulkGeometry& g, const Device& d,
                              const Tuning& t) {
  return !persistent_kernels_pay(d.peak_gbs) && t.bulk == 1 && t.bulk_ahead == kRule && t.bulk_chunk == kRule &&
         !g.stream && g.team == g.grid && g.ahead == 1 && g.chunk == kBulkChunkFast &&
         bulk_slice_parts(p, r, g) < kBulkMinPartsAhead1Fast;
}

// The NCHW bulk forward's geometry: bulk_geometry, with fewer consumer warps for held slices of more than 16 parts on
// >= 3.8 TB/s. A slice of P parts of 4 KiB goes to W consumer warps, part i to warp i % W, so the slowest warp takes
// ceil(P / W) of them: with 16 warps, 17-24 parts leave some warps two parts and others one. There the rule takes the
// fewest warps (a multiple of the copy's parts) that keep ceil(P / 16) parts per warp, and float32 slices copied in
// 4 KiB. On the H100 the same rule lost 2.2-3.4% on 4 of 6 shapes with SiLU, so it stays with 16 warps
// (docs/decisions/bulk.md#fewer-consumer-warps-on-the-h200).
// Example: 1x192x1024x1024 fp16 on the H200: 12 MiB groups = 768 copies of 16 KiB, 6 per CTA: 24 parts; 12 warps
// take two parts each (GroupNorm+SiLU 334.1 -> 317.3 us). 1x128x768x768 fp32: 9 MiB groups, 5 copies = 20 parts ->
// 12 warps, in 4 KiB copies (18 per CTA): 267.9 -> 246.7 us.
inline std::optional<BulkGeometry> bulk_forward_geometry(const Problem& p, const Request& r, const Device& d,
                                                         const Tuning& t) {
  const auto g = bulk_geometry(p, r, false, d, t);
  if (!g || t.bulk_consumers != kRule || persistent_kernels_pay(d.peak_gbs) || g->stream || g->team != g->grid)
    return g;
  const int64_t parts = bulk_slice_parts(p, r, *g);
  if (parts <= g->consumers) return g;
  const int64_t per = ceil_div(parts, int64_t{g->consumers});
  Tuning fewer = t;
  fewer.bulk_consumers = static_cast<int>(ceil_div(ceil_div(parts, per), int64_t{g->parts}) * g->parts);
  if (fewer.bulk_consumers >= g->consumers) return g;
  if (r.esize == 4 && t.bulk_chunk == kRule) {
    Tuning four = fewer;
    four.bulk_chunk = kBulkChunk;
    if (const auto g4 = bulk_geometry(p, r, false, d, four); g4 && !g4->stream) return g4;
  }
  const auto f = bulk_geometry(p, r, false, d, fewer);
  return f && !f->stream ? f : g;
}

// ---------------------------------------------------------------------------------------------------------------
// Channels_last bulk forward (group_norm_bulk_nhwc.cuh, sm_90+): the bulk forward with images as units (HxW * C
// contiguous elements holding every group), per-group statistics. The slots M of a row (max(1, CV / 32) of its CV =
// C / V vectors: a consumer warp takes one slot, i.e. every M-th 32 vectors of a part), or 0 where the kernel does not
// take the shape: CV a power of two of at most 32 * kBulkNhwcMaxSlots (rows divide a 4 KiB part, so every lane sees
// the same channel vector in every row), each vector in one group (D a multiple of V, D / V a power of two <= 32) or
// in two (2 D = V), G <= kBulkNhwcMaxG.
// Example: C = 512 bf16, G = 32: CV = 64, M = 2 (warps 0, 2, ... take channels 0-255, warps 1, 3, ... 256-511), D =
// 16, 2 vectors per group.
inline int bulk_nhwc_slots(const Problem& p, int64_t esize) {
  const int64_t V = 16 / esize;
  if (p.C % V != 0 || p.G > kBulkNhwcMaxG || p.G < 1) return 0;
  const int64_t CV = p.C / V, M = std::max<int64_t>(1, CV / 32);
  const auto pow2 = [](int64_t v) { return v > 0 && (v & (v - 1)) == 0; };
  if (!pow2(CV) || M > kBulkNhwcMaxSlots) return 0;
  if (p.D % V == 0 ? !pow2(p.D / V) || p.D / V > 32 : 2 * p.D != V) return 0;
  return static_cast<int>(M);
}
// The geometry is the NCHW forward's (bulk_geometry) for N units of HxW * C elements, with the larger header; knob
// GNEXT_BULK_NHWC (2: wherever it fits).
// Example: 32x256x32x32 bf16 channels_last, H100: 512 KiB images = 128 chunks of 4 KiB; (232448 - 17024) / 4096 -> 52
// stages, (52 - 4) / 3 = 16 chunks a slice at look-ahead 2: teams of 8 CTAs, 16 teams. 16x512x128x128 bf16: 16 MiB
// images, 32 chunks per CTA, streamed: not taken (two-pass).
// The largest image taken, held: 8 MiB below 3.8 TB/s (the H100), 2 MiB above it (the H200's 4 and 8 MiB images win
// 1.06-1.36x from DRAM but lose 1.08-1.11x replayed from a CUDA graph with the input in L2).
constexpr int64_t bulk_nhwc_max_image_bytes(int64_t peak_gbs) {
  return persistent_kernels_pay(peak_gbs) ? int64_t{8} << 20 : int64_t{2} << 20;
}
inline std::optional<BulkGeometry> bulk_nhwc_geometry(const Problem& p, const Request& r, const Device& d,
                                                      const Tuning& t) {
  const int M = bulk_nhwc_slots(p, r.esize);
  if (t.bulk_nhwc == 0 || r.prologue || !r.aligned || d.major < 9 || M == 0) return std::nullopt;
  const Problem units{p.N, 1, 1, 1, p.HxW * p.C};
  Request ru = r;
  ru.contiguous = true;
  Tuning tu = t;
  tu.bulk = t.bulk_nhwc;
  const int consumers = bulk_consumer_warps(t, false);
  const auto g = bulk_geometry(units, ru, false, d, tu, bulk_nhwc_header_bytes(consumers, p.G, p.C));
  if (!g || g->consumers % (g->parts * M) != 0) return std::nullopt;
  if (t.bulk_nhwc == 2) return g;
  // Held images of at most bulk_nhwc_max_image_bytes: 0.5-2 MiB images measured faster than the one-pass and two-pass
  // kernels on both GPUs, 4-8 MiB ones on the H100 (GroupNorm / GroupNorm+SiLU 1.14 / 1.13x at 8x512x64x64 bf16, 1.01
  // / 1.02x at 6x512x80x80 bf16, 1.15 / 1.17x at 4x256x128x128 bf16); 9 MiB fp16 images lose with SiLU (1.02x),
  // streamed 16 MiB ones 1.02-1.06x (docs/decisions/bulk.md#channels_last-images-as-units-again).
  const int64_t image = p.HxW * p.C * r.esize;
  if (g->stream || image > bulk_nhwc_max_image_bytes(d.peak_gbs)) return std::nullopt;
  // Images over 2 MiB only in tensors larger than half of L2: replayed from a CUDA graph with the input in L2, the
  // two-pass kernels read it twice from there, and 2x64x16x64x64 bf16 (16 MiB) ran 1.26x slower in bulk; 32 MiB
  // tensors of 4-8 MiB images tie there and win 1.14-1.17x from DRAM.
  // Example: 8x512x64x64 bf16 on the H100: 4 MiB images, 32 MiB > 25 MiB: taken; 2x64x16x64x64 bf16: not.
  if (image > (int64_t{2} << 20) && 2 * p.N * image <= d.l2_bytes) return std::nullopt;
  return g;
}

// ---------------------------------------------------------------------------------------------------------------
// The plans.

// The two-pass geometry (reduction, and the elementwise pass where one runs) of a plan whose layout is set.
inline Plan two_pass(Plan plan, const Problem& p, const Request& r, bool bwd, const Device& d, const Tuning& t) {
  plan.kernel = Kernel::kTwoPass;
  const int V = vector_width(r.esize, plan.nhwc ? p.C : p.HxW, r.aligned);
  plan.reduce = reduce_geometry(p, plan.nhwc, V, bwd ? kGradStateBytes : kMomentsStateBytes, bwd, d, t, r.esize,
                                r.prologue);
  if (!bwd || r.need_dx) plan.affine = affine_geometry(p, plan.nhwc, V, r.esize, bwd, r.act, d, t);
  return plan;
}

inline Plan plan_forward(const Problem& p, const Request& r, const Device& d, const Tuning& t) {
  Plan plan;
  plan.nhwc = use_nhwc(p, r, kMomentsStateBytes, d, t);
  // An input shift (the bias of the convolution that wrote x): the two-pass finalize shifts each channel's
  // moments and the wide channels_last kernel its per-channel sums; the other kernels hold per-group sums only.
  // Two-pass with the shift reads 2R + 1W, less than the 2R + 2W of a bias pass before a one-pass kernel.
  if (r.input_shift) {
    if (plan.nhwc)
      if (const auto g = wide_nhwc_geometry(p, r, d, t)) {
        plan.kernel = Kernel::kWideNhwc, plan.wide = *g;
        plan.why = "wide channels_last with an input shift: one image >= 8 MiB held in shared memory + L2";
        return plan;
      }
    plan.why = "two-pass with an input shift: the finalize shifts each channel's moments (2R + 1W)";
    return two_pass(plan, p, r, false, d, t);
  }
  const auto small = small_geometry(p, r, false, d, t);
  // HxW == 1 in NCHW memory: the small-group kernel is one launch where the NHWC kernels take three.
  if (plan.nhwc && p.HxW == 1 && r.contiguous && small) plan.nhwc = false;
  if (!plan.nhwc && small) {
    plan.kernel = Kernel::kSmall, plan.small = *small;
    plan.why = small->lanes_log2 == kSmallCtaLog2
                   ? "small-group: >= 1 group per SM of <= 64 KB, a CTA per group, in registers"
                   : "small-group: >= 64 groups of <= 4 KB, in registers";
    return plan;
  }
  std::optional<BulkGeometry> bulk;
  bool ahead1 = false;  // the held bulk forward would run at look-ahead 1 and lose to two-pass
  if (!plan.nhwc) {
    bulk = bulk_forward_geometry(p, r, d, t);
    ahead1 = bulk && bulk_ahead1_loses(p, r, *bulk, d, t);
  }
  if (bulk && !ahead1) {
    plan.kernel = Kernel::kBulk, plan.bulk = *bulk;
    plan.why = bulk->team != bulk->grid
                   ? "bulk in teams: one team of every CTA would cut the groups into slices too short, so teams of "
                     "CTAs each take every teams-th group, slices of 4 KiB chunks that the ring holds at look-ahead "
                     "2, copied once into shared memory by bulk asynchronous copies"
               : persistent_kernels_pay(d.peak_gbs)
                   ? "bulk: slices of > 8 chunks per SM, copied once into shared memory by bulk asynchronous copies"
               : bulk->stream
                   ? "bulk: slices streamed through shared memory, the part not held read again from L2 (>= 3.8 "
                     "TB/s: 8 KiB copies where 16 KiB ones would read too much again), by bulk asynchronous copies"
               : bulk->consumers < kBulkMaxConsumers
                   ? "bulk: held slices of more than 16 parts of 4 KiB per SM (>= 3.8 TB/s), the fewest consumer "
                     "warps that keep as many parts per warp as 16 warps would (float32: in 4 KiB copies), copied "
                     "once into shared memory by bulk asynchronous copies"
                   : "bulk: held slices of >= 64 KiB per SM in 16 KiB copies at look-ahead 2 (>= 3.8 TB/s), "
                     "copied once into shared memory by bulk asynchronous copies";
    return plan;
  }
  if (plan.nhwc)
    if (const auto g = bulk_nhwc_geometry(p, r, d, t)) {
      plan.kernel = Kernel::kBulkNhwc, plan.bulk = *g;
      plan.why = persistent_kernels_pay(d.peak_gbs)
                     ? "bulk channels_last: images of <= 8 MiB (< 3.8 TB/s; over 2 MiB in tensors over half of L2) as "
                       "units, teams of CTAs whose slices the ring holds, copied once into shared memory by bulk "
                       "asynchronous copies, per-group statistics"
                     : "bulk channels_last: images of <= 2 MiB (>= 3.8 TB/s) as units, teams of CTAs whose slices the "
                       "ring holds, copied once into shared memory by bulk asynchronous copies, per-group statistics";
      return plan;
    }
  if (onepass_allows(r, plan.nhwc))
    if (const auto g = onepass_geometry(p, r, false, plan.nhwc, d, t)) {
      plan.kernel = Kernel::kOnePass, plan.onepass = *g;
      plan.why = g->T == 1 ? "one-pass: every group is one tile in one CTA's shared memory"
                           : "one-pass: groups of T tiles held in shared memory across the grid";
      return plan;
    }
  if (!plan.nhwc)
    if (const auto g = wide_geometry(p, r, r.act != kActIdentity || r.residual, false, d, t)) {
      plan.kernel = Kernel::kWide, plan.wide = *g;
      plan.why = "wide: groups >= 16 MiB, each CTA a slice held in shared memory + L2, persistent kernels pay";
      return plan;
    }
  if (plan.nhwc)
    if (const auto g = wide_nhwc_geometry(p, r, d, t)) {
      plan.kernel = Kernel::kWideNhwc, plan.wide = *g;
      plan.why = "wide channels_last: one image >= 8 MiB held in shared memory + L2";
      return plan;
    }
  plan.why = ahead1
                 ? "two-pass: held bulk slices of fewer than 24 parts of 4 KiB run at look-ahead 1 (>= 3.8 TB/s), where "
                   "each group's grid-wide chain costs more than a third pass over x"
             : !plan.nhwc && !persistent_kernels_pay(d.peak_gbs)
                 ? "two-pass: peak bandwidth >= 3.8 TB/s, the persistent kernels' bytes in flight do not keep up"
                 : "two-pass: no persistent plan fits or pays";
  return two_pass(plan, p, r, false, d, t);
}

inline Plan plan_backward(const Problem& p, const Request& r, const Device& d, const Tuning& t) {
  Plan plan;
  if (r.flat)
    if (const auto g = small_geometry(p, r, true, d, t)) {
      plan.kernel = Kernel::kSmall, plan.small = *g;
      plan.why = g->lanes_log2 == kSmallCtaLog2
                     ? "small-group: >= 1 group per SM of <= 32 KB, a CTA per group, x and dy in registers"
                     : "small-group: >= 64 groups of <= 4 KB, x and dy in registers";
      return plan;
    }
  plan.nhwc = use_nhwc(p, r, kGradStateBytes, d, t);
  if (!plan.nhwc)
    if (const auto g = bulk_geometry(p, r, true, d, t)) {
      plan.kernel = Kernel::kBulk, plan.bulk = *g;
      plan.why = "bulk: slices of x and dy of >= 8 chunks per SM, copied once into shared memory by bulk asynchronous "
                 "copies";
      return plan;
    }
  if (r.need_dx && onepass_allows(r, plan.nhwc))
    if (const auto g = onepass_geometry(p, r, true, plan.nhwc, d, t)) {
      plan.kernel = Kernel::kOnePass, plan.onepass = *g;
      plan.why = g->T == 1 ? "one-pass: x and dy of every group as one tile in shared memory"
                           : "one-pass: groups of T tiles of x and dy held across the grid";
      return plan;
    }
  if (!plan.nhwc && r.need_dx)
    if (const auto g = wide_geometry(p, r, r.act != kActIdentity, true, d, t)) {
      plan.kernel = Kernel::kWide, plan.wide = *g;
      plan.why = "wide: x + dy of a group >= 24 MiB (48 with an activation), slices in shared memory + L2";
      return plan;
    }
  plan.why = "two-pass: no persistent plan fits or pays";
  return two_pass(plan, p, r, true, d, t);
}

// The two-pass kernels whatever else would fit: the reduction and the elementwise pass run as separate ops when
// the statistics are merged between them (groupnorm_ext.distributed: per-shard sums, all-reduce, apply).
inline Plan plan_two_pass(const Problem& p, const Request& r, bool bwd, const Device& d, const Tuning& t) {
  Plan plan;
  plan.nhwc = use_nhwc(p, r, bwd ? kGradStateBytes : kMomentsStateBytes, d, t);
  plan.why = "two-pass: statistics merged between the passes";
  return two_pass(plan, p, r, bwd, d, t);
}

// The statistics alone (mean, rstd): the two-pass reduction.
inline Plan plan_stats(const Problem& p, const Request& r, const Device& d, const Tuning& t) {
  Plan plan;
  plan.nhwc = use_nhwc(p, r, kMomentsStateBytes, d, t);
  plan.why = "statistics: reduction";
  plan = two_pass(plan, p, r, false, d, t);
  plan.affine = {};  // no elementwise pass
  return plan;
}

}  // namespace gn
}  // namespace gnext
