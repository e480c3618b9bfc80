// Launch policy of the GroupNorm kernels, as functions of the problem (N, C, G, HxW, dtype, layout)
// and the device (SM count, shared memory): which design runs (one-pass, wide, two-pass; NCHW or NHWC), the
// vector width, how rows are split across CTAs, and the one-pass tiling. The host glue
// (group_norm_cuda.cpp) asks these and launches; nothing here allocates or launches.
//
// Worked numbers (H100: 132 SMs; 228 KB shared memory per SM, 227 KB per block, 1 KB reserved per block):
//  * target_ctas() = 4 * 132 = 528 CTAs per launch.
//  * NCHW 2x320x64x64 fp16, G = 32 (D = 10 channels per group): V = 8 (HxW = 4096 is a multiple of 8
//    halves). Two-pass reduction: N*C = 640 rows >= 528, so one CTA per row (K = 1).
//    One-pass forward: 2 CTAs per SM -> 264 slots, 114688 bytes of stage per CTA; 64 units (groups) of
//    40960 elements (80 KB). Since 4 * 64 <= 264 it first tries 264 / 64 = 4 CTAs per group: a
//    10240-element cap gives 2-channel tiles, T = 5 tiles per group, 320 tiles > 264 slots, dropped.
//    Then one tile per group: 64 CTAs, each holding its whole group in shared memory, no inter-CTA wait.
//  * NHWC 16x512x128x128 bf16 channels_last: V = 8, C / V = 64 vectors per pixel row -> tpr = 64
//    threads across a row, rpi = 4 rows at once (256 threads); K = max(ceil(528 / 16), ceil(16384 /
//    2048)) = 33 chunks of 497 rows per image (528 CTAs).
//  * NCHW 32x2048x7x7 bf16, G = 32 (ResNet-GN's last stage): HxW = 49 is not a multiple of V = 8 but
//    D*HxW = 64 * 49 = 3136 is, and N*G = 1024 groups >= 132 SMs: the "ragged" one-pass forward,
//    1024 whole-group tiles of 3136 elements (6 KB) streamed through 264 CTAs (about 4 each), no waits.
//    Its backward runs the two-pass kernels, scalar (V = 1).
// Defaults of the one-pass knobs come from scripts/dev/onepass_sweep.py (docs/kernels.md).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <numeric>
#include <optional>

#include "../common/cuda_utils.h"
#include "group_norm_launch.h"

namespace gnext {
namespace gn {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }


inline int64_t element_size(ScalarType t) { return t == ScalarType::Float ? 4 : 2; }

inline int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::atoi(v) : dflt;
}

// CTAs to aim for per launch of the two-pass kernels: enough to fill every SM a few times over.
// GNEXT_TARGET_CTAS=n overrides it (measurements).
inline int64_t target_ctas() {
  const int64_t dflt = 4 * static_cast<int64_t>(device_props().multiProcessorCount);
  return std::max(1, env_int("GNEXT_TARGET_CTAS", static_cast<int>(dflt)));
}

// Widest vector (elements per 16-byte access) when rows have `inner` elements and every pointer
// is 16-byte aligned; 1 otherwise.
inline int vector_width(ScalarType t, int64_t inner, std::initializer_list<const void*> ptrs) {
  const int vmax = static_cast<int>(16 / element_size(t));
  if (inner % vmax != 0) return 1;
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return vmax;
}

// NHWC: tpr threads across the C/V channel vectors of a row, rpi rows at once; CTAs take ranges
// of `chunk` rows: enough CTAs to fill the GPU, each with a few full row sweeps, and few enough
// partials that the per-group finalize (D*K merges) stays cheap.
struct NhwcSplit {
  int tpr, rpi, threads;
  int64_t chunk, K;
};
inline NhwcSplit nhwc_split(const Problem& p, int V, int64_t target) {
  constexpr int kThreads = 256;
  NhwcSplit s{};
  const int CV = static_cast<int>(p.C / V);
  s.tpr = std::min(CV, kThreads);
  s.rpi = std::max(1, kThreads / s.tpr);
  s.threads = static_cast<int>(round_up(static_cast<int64_t>(s.tpr) * s.rpi, 32));
  // About target_ctas() CTAs, and at most kMaxNhwcRows rows per CTA: with many large images (L2#19:
  // 128 x 66564 rows) a CTA per fifth of an image left the SMs 60% occupied, too few warps to hide
  // the latency of the GELU prologue's math (H100: 2048 rows per CTA took the fp32 GELU-prologue
  // passes from 1.00 + 2.19 ms to 0.82 + 1.93 ms; docs/kernels.md).
  constexpr int64_t kMaxNhwcRows = 2048;
  int64_t K = std::max(ceil_div(target, p.N), ceil_div(p.HxW, kMaxNhwcRows));
  K = std::min(K, ceil_div(p.HxW, static_cast<int64_t>(s.rpi) * kUnroll));
  K = std::min(K, std::max<int64_t>(1, (int64_t{1} << 15) / p.D));
  s.chunk = ceil_div(p.HxW, std::max<int64_t>(K, 1));
  s.K = ceil_div(p.HxW, s.chunk);
  return s;
}

// NCHW: each of the N*C rows of HxW split into K chunks of `chunk` elements (a multiple of V), one
// CTA each, so that about `target` CTAs run; at most max_k chunks per row.
struct RowSplit {
  int64_t K, chunk;
  int threads;
};
inline RowSplit nchw_row_split(const Problem& p, int V, int64_t max_k, int64_t target) {
  const int64_t rows = p.N * p.C;
  const int64_t K = rows >= target ? 1 : std::min(ceil_div(target, rows), std::max<int64_t>(1, max_k));
  RowSplit s{};
  // Chunks start on 1 KB boundaries (64 vectors) of an aligned row. Rounded to a vector only, a
  // chunk of HxW / 3 or / 5 started 48-112 bytes into a cache line, and every warp's loads straddled
  // one more line: H100 (bench_results/chunk_align_probe_h100.log, ms at the default 528 CTAs,
  // vector-aligned -> 1 KB-aligned) 1x128x2048x2048 bf16 NCHW forward 1.162 -> 1.115, backward
  // 2.046 -> 1.889; 1x256x1024x1024 bf16 0.596 -> 0.573 and 1.010 -> 0.947; with 128-byte alignment
  // (8 vectors) within 3% of that. GNEXT_CHUNK_ALIGN=v sets it in vectors (measurements).
  const int64_t align = V * std::max(1, env_int("GNEXT_CHUNK_ALIGN", 64));
  s.chunk = round_up(ceil_div(p.HxW, K), align);
  s.K = ceil_div(p.HxW, s.chunk);
  s.threads = static_cast<int>(std::clamp<int64_t>(round_up(ceil_div(s.chunk / V, kUnroll), 32), 32, kMaxThreads));
  return s;
}

// CTAs the backward's two-pass kernels aim for: twice target_ctas() for the elementwise (affine) pass (NHWC:
// without an output activation) and the NCHW reduction; the NHWC reduction keeps target_ctas(). H100, kernel
// µs at 528 -> 1056 CTAs (same process, scripts/dev/profile_kernels.py --env GNEXT_TARGET_CTAS=528,264;
// bench_results/bwd_ctas_after_h100.log, nhwc_ctas_h100.log, affine_ctas_h100.log, 2026-11-24): backward affine
// 1x128x1024x1024 fp16 NCHW 286.6 -> 274.0 (with SiLU 305.6 -> 277.5), channels_last 292.2 -> 276.6,
// 16x512x128x128 bf16 channels_last 292.1 -> 275.7, 2x640x64x64 fp16 CL 12.7 -> 11.8, 2x1280x16x16 and
// 16x256x16000 unchanged; NCHW backward reduction 190.0 -> 185.4. Not taken: the NHWC affine with SiLU
// (1x128x1024x1024 CL 352.1 -> 355.2, 2x640x64x64 CL 15.4 -> 18.2), the NHWC backward reduction
// (185.8 -> 186.5), the forward passes (reduction 1x128x1024x1024 fp16 CL 104.2 -> 113.0, affine
// 2x640x64x64 CL 9.8 -> 10.7).
inline int64_t bwd_target_ctas() { return 2 * target_ctas(); }

inline ReduceGeometry reduce_geometry(const Problem& p, bool nhwc, int V, size_t state_bytes, bool bwd = false) {
  ReduceGeometry g{};
  g.nhwc = nhwc;
  g.vec = V;
  if (nhwc) {
    const NhwcSplit s = nhwc_split(p, V, target_ctas());
    g.tpr = s.tpr, g.rpi = s.rpi, g.threads = s.threads, g.chunk = s.chunk, g.K = s.K;
    // Chunks of at least min(64, HxW / 32) pixel rows where HxW >= 1024. The split above aims at CTA
    // count alone and cuts images of a few thousand pixels into chunks of 8-16 rows, whose N*K*C
    // partials (12 bytes each) the finalize must merge. H100, GroupNorm kernel us fwd/bwd, plain
    // split -> this rule (bench_results/nhwc_min_rows_h100.log): 2x640x64x64 fp16 CL 30.5/29.2 ->
    // 21.8/29.7 (GN+SiLU 31.4/37.9 -> 23.1/36.4), 2x320x64x64 21.0/17.5 -> 16.8/16.1, 1x512x64x64
    // 18.7/15.8 -> 14.5/15.5, 4x512x32x32 13.9/14.8 -> 12.8/14.2, 8x320x64x64 bf16 35.0/49.3 ->
    // 35.1/47.1; the 268 MB maps unchanged. Smaller images keep the split: 2x1280x16x16 took
    // 12.5/14.4 us with it, 13.2/17.1 with 32-row chunks. GNEXT_NHWC_MIN_ROWS=R overrides (0: the
    // plain split), for measurements.
    const int64_t rule = p.HxW >= 1024 ? std::min<int64_t>(64, p.HxW / 32) : 0;
    if (const int64_t min_rows = env_int("GNEXT_NHWC_MIN_ROWS", static_cast<int>(rule));
        min_rows > 0 && g.chunk < min_rows) {
      g.chunk = std::min(p.HxW, min_rows);
      g.K = ceil_div(p.HxW, g.chunk);
    }
    g.smem = static_cast<size_t>(g.rpi) * p.C * state_bytes;
    return g;
  }
  const RowSplit s = nchw_row_split(p, V, p.HxW / 4096, bwd ? bwd_target_ctas() : target_ctas());
  g.K = s.K, g.chunk = s.chunk, g.threads = s.threads;
  return g;
}

// bwd: the backward's pass (dx), act: with an output activation's derivative.
inline AffineGeometry affine_geometry(const Problem& p, bool nhwc, int V, bool bwd = false, bool act = false) {
  AffineGeometry g{};
  g.nhwc = nhwc;
  g.vec = V;
  const int64_t target = bwd && !(nhwc && act) ? bwd_target_ctas() : target_ctas();
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
  if (rows_per_cta > 1) {  // short rows, packed rows_per_cta to a CTA
    g.rows_per_cta = static_cast<int>(rows_per_cta);
    g.threads = static_cast<int>(std::min<int64_t>(kMaxThreads, round_up(rows_per_cta * hwv, 32)));
    g.grid_x = static_cast<unsigned>(ceil_div(rows, rows_per_cta));
    g.grid_y = 1;
    g.chunk = p.HxW;
    return g;
  }
  const RowSplit s = nchw_row_split(p, V, hwv / kVecsPerCta, target);  // long rows, split in chunks
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

// Layout the kernels run in: NHWC for channels_last input and for HxW == 1 (where (N, C) memory
// is the same in both); NCHW otherwise, or when NHWC's shared memory (rpi * C states) won't fit.
inline bool use_nhwc(const Tensor& x, const Problem& p, size_t state_bytes, std::initializer_list<const void*> ptrs) {
  if (x.is_contiguous() && p.HxW != 1) return false;
  const int V = vector_width(x.scalar_type(), p.C, ptrs);
  const ReduceGeometry g = reduce_geometry(p, true, V, state_bytes);
  return g.smem <= device_props().sharedMemPerBlockOptin;
}

// Persistent kernels (one-pass, wide: a tile staged in shared memory while the CTA waits for the rest of its
// group) against the streamed two-pass kernels, by the device's peak DRAM bandwidth. The persistent kernels'
// rate is set by the bytes they keep in flight per SM, not by DRAM: forward, bytes read + written, 2.0-2.7 TB/s
// on both an H100 and an H200. The two-pass kernels stream at about 0.95 of the copy bandwidth but move 1.5x
// the bytes (forward 2R + 1W against 1R + 1W). So the persistent plan pays while 2 / 2.4 < 3 / (0.95 * BW),
// i.e. BW under about 3.8 TB/s. Example: 8x256x256x256 bf16 G=32 forward, one-pass / two-pass us: H100
// (3352 GB/s) 269 / 276, H200 (4916 GB/s) 247 / 210 (docs/decisions/persistent-vs-streamed.md).
constexpr int64_t kPersistentMaxPeakGBs = 3800;
inline bool persistent_kernels_pay(int64_t peak_gbs) { return peak_gbs < kPersistentMaxPeakGBs; }
// Where that rule applies to the one-pass forward: groups of at least 1 MiB (smaller ones are one or two
// tiles with little waiting: 16x512x64x64 fp16, 128 KB groups, H200 one-pass 69.5 us / two-pass 77.6) and at
// least 64 of them (32 groups of 8 MiB tie on the H200: 1x256x512x512 fp32 210 / 213 us).
constexpr int64_t kStreamedMinGroupBytes = int64_t{1} << 20;
constexpr int64_t kStreamedMinGroups = 64;

// Ragged one-pass forward below a group per SM: tensors of at most this many bytes (onepass_geometry).
constexpr int kRaggedSmallBytes = 1 << 20;

// One-pass plan (see OnePassGeometry in group_norm_launch.h), or nullopt when the two-pass
// kernels must run: rows (HxW for NCHW, C for NHWC) not 16-byte aligned, a group (NHWC: a block
// of whole groups) too large to be held in shared memory across the grid, an NHWC plan that would
// not pay (below; GNEXT_ONEPASS=2 takes it anyway), or GNEXT_ONEPASS=0.
// Tuning knobs (environment, for measurements): GNEXT_ONEPASS_CTAS (CTAs per SM, default 2; 4 for
// many small NCHW groups, below),
// GNEXT_ONEPASS_NBUF (shared-memory stages, default 2). Defaults from scripts/onepass_sweep.py on the
// H100 (docs/kernels.md): larger tiles beat deeper prefetch; 2 CTAs per SM overlap their waits.
// pack_ctas / pack_tile: the re-plan below (more CTAs per SM for the same tiles); 0 otherwise.
inline std::optional<OnePassGeometry> onepass_geometry(const Problem& p, ScalarType t, bool bwd, bool nhwc,
                                                bool prologue, std::initializer_list<const void*> ptrs,
                                                int pack_ctas = 0, int64_t pack_tile = 0) {
  const int onepass = env_int("GNEXT_ONEPASS", 1);
  if (onepass == 0) return std::nullopt;
  int V = vector_width(t, nhwc ? p.C : p.HxW, ptrs);
  // NCHW forward, HxW not a multiple of the vector (ResNet-GN 7x7, 14x14; odd maps): a group is still
  // D*HxW contiguous elements, so whole-group tiles are vectorizable when D*HxW is ("ragged" tiles).
  // The two-pass kernels would run scalar. The backward's per-channel sums and an input prologue
  // (`prologue`: its per-channel bias) need channel-aligned vectors: two-pass there.
  const int Vg = V == 1 && !nhwc && !bwd && !prologue ? vector_width(t, p.D * p.HxW, ptrs) : 1;
  const bool ragged = Vg > 1;
  if (ragged) V = Vg;
  if (V == 1) return std::nullopt;
  const DeviceProps* prop = &device_props();
  const int64_t esize = element_size(t);
  if (!bwd && !nhwc && !ragged && onepass != 2 && !persistent_kernels_pay(peak_dram_gbs(*prop)) &&
      p.D * p.HxW * esize >= kStreamedMinGroupBytes && p.N * p.G >= kStreamedMinGroups)
    return std::nullopt;
  const int64_t bytes = esize * (bwd ? 2 : 1);  // stage bytes per element
  // NCHW with many small groups (at least 2 per SM, <= 16 KB of stage bytes each): 4 CTAs per SM of
  // 128 threads. Each streams its groups one after another, so 2 CTAs of 256 threads left each SM
  // with two long chains of load -> reduce -> normalize. H100 kernel us, 2 -> 4 CTAs per SM
  // (bench_results/onepass_ctas_h100.log): forward 32x2048x7x7 bf16 29.2 -> 20.9, 32x1024x14x14
  // fp16 33.2 -> 22.5, 16x2048x7x7 fp32 16.1 -> 12.2, 32x2048x8x8 bf16 21.6 -> 13.8 (backward
  // 49.1 -> 45.6), 64x512x4x4 fp16 33.7 -> 17.6 (backward 42.4 -> 32.5). Larger groups lose
  // (32x512x28x28 fp32, 50 KB: 52.9 -> 56.4), so do few groups (2x1280x8x8 fp16, 64 groups: 7.0 -> 7.3).
  const bool many_small = !nhwc && p.N * p.G >= 2 * prop->multiProcessorCount && p.D * p.HxW * bytes <= 16384;
  const int ctas = pack_ctas > 0 ? pack_ctas : std::clamp(env_int("GNEXT_ONEPASS_CTAS", many_small ? 4 : 2), 1, 4);
  const int stages = std::clamp(env_int("GNEXT_ONEPASS_NBUF", 2), 2, 4);
  const int order = env_int("GNEXT_ONEPASS_EARLY", -1);  // publish order (make, below)
  const int64_t slots = static_cast<int64_t>(prop->multiProcessorCount) * ctas;  // co-resident CTAs
  const int threads = std::max(128, gn::kOnePassThreads / ctas / 32 * 32);
  const int64_t per_cta = ctas == 1 ? static_cast<int64_t>(prop->sharedMemPerBlockOptin)
                                    : static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / ctas -
                                          static_cast<int64_t>(prop->reservedSharedMemPerBlock);
  const int64_t avail0 = std::min<int64_t>(per_cta, prop->sharedMemPerBlockOptin) - gn::kOnePassStaticSmem;
  // Plan for NHWC blocks of cb channels (cb = 0: NCHW).
  auto plan = [&](int64_t cb) -> std::optional<OnePassGeometry> {
    // NHWC: per-thread channel sums and per-channel coefficients follow the stages.
    const int64_t extra = nhwc ? threads * V * 8 + cb * 16 : 0;
    const int64_t avail = avail0 - extra;
    const int64_t U = nhwc ? p.N * (p.C / cb) : p.N * p.G;  // units: groups (NCHW), channel blocks (NHWC)
    const int64_t L = nhwc ? cb * p.HxW : p.D * p.HxW;      // elements per unit
    // Tiles of at most `cap` elements. NCHW: whole channels (balanced over the group) or equal
    // pieces of one; NHWC: equal ranges of pixel rows.
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
      // Ragged: whole-group tiles only, and at least a group per SM (fewer groups leave SMs idle where
      // the scalar two-pass kernels spread the rows over every SM), except for groups of at most 4 KB in a
      // tensor of at most GNEXT_RAGGED_SMALL bytes (default kRaggedSmallBytes; 0: never): one launch instead
      // of three. H100 forward kernel µs, two-pass / ragged (bench_results/ragged_small_h100.log, 2026-11-24):
      // 4x100x10x10 fp16 G=10 (2 KB groups) 7.7 / 6.2, 2x48x7x7 bf16 G=3 (1.5 KB) 6.5 / 6.2; larger groups
      // lose: 1x120x17x19 bf16 G=5 (15.5 KB) 7.4 / 10.1, 4x64x30x30 bf16 G=8 (14 KB) GroupNorm+SiLU 7.9 / 8.2.
      const bool tiny = L * esize <= 4096 &&
                        p.N * p.C * p.HxW * esize <= env_int("GNEXT_RAGGED_SMALL", kRaggedSmallBytes);
      if (ragged && (g.T != 1 || (U < prop->multiProcessorCount && !tiny))) return std::nullopt;
      g.ragged = ragged;
      // Publish order (OnePassGeometry::early): groups of several tiles publish early. The late order lets a
      // CTA's next copy overlap its finish, but a CTA then publishes a tile only after finishing the one
      // before, and every wave waits for the slowest CTA of the last one. H100, forward kernel µs early / late
      // (profile_kernels.py --env GNEXT_ONEPASS_EARLY=1,0; bench_results/onepass_order_h100.log, 2026-11-24):
      // 1x128x1024x1024 fp16 (T = 76) 247.1 / 399.5, L1#35 6207 / 9723, 16x256x16000 bf16 (T = 16) 140.7 /
      // 136.0; whole-group tiles (T = 1, no waits) gain: 32x256x56x56 bf16 54.6 / 53.5 (backward with SiLU
      // 120.7 / 118.3), 32x512x28x28 fp32 51.9 / 50.9 (backward 91.7 / 90.3).
      g.early = order == -1 ? g.T > 1 : order != 0;
      const int64_t tiles = g.units * g.T;
      g.grid = static_cast<unsigned>(std::min(tiles, slots));
      if (g.T > g.grid || (nbuf == 1 && tiles > g.grid)) return std::nullopt;
      g.smem = static_cast<size_t>(nbuf * g.tile * bytes + extra);
      return g;
    };
    // Few units: split each over slots / U CTAs, one tile per CTA. Up to one unit per CTA: one
    // tile each, no inter-CTA waits. Otherwise stream tiles through `stages` (else 2) stages.
    if (avail <= 0) return std::nullopt;
    if (pack_tile > 0) return make(stages, pack_tile);  // the re-plan at more CTAs per SM (below)
    if (4 * U <= slots)
      // NHWC: the cap in whole pixel rows, rounded up (rounding down could give more tiles than slots).
      if (auto g = make(1, std::min(avail / bytes, round_up(ceil_div(L, slots / U), nhwc ? cb : V)))) return g;
    if (U <= slots)
      if (auto g = make(1, avail / bytes)) return g;
    // NHWC streamed through stages measured slower than the two-pass kernels (UNet
    // 16x512x128x128 bf16 CL on the H100: 0.48-0.92 ms vs 0.31 ms; docs/kernels.md): not used.
    if (nhwc) return std::nullopt;
    // Backward, streamed, groups of 3 or more tiles, more groups than SMs: the two-pass kernels win
    // (CTAs wait on the other tiles of their group wave after wave). H100 backward op ms one-pass /
    // two-pass (scripts/dev/onepass_bwd_probe.py, bench_results/onepass_bwd_rule_before_h100.log):
    // 8x512x4096 fp32 (T = 10) 0.133 / 0.127, 16x256x16000 bf16 0.262 / 0.239, 8x128x128x128 fp16
    // 0.074 / 0.070, 32x128x8000 bf16 0.134 / 0.131, 16x256x64x64 bf16 0.072 / 0.071. One-pass kept
    // where it won: T <= 2 (32x256x56x56 bf16 0.102 / 0.108) or at most a group per SM (4x32x512x512
    // fp32 0.203 / 0.246, 4x128x16384 fp32 0.067 / 0.070). GNEXT_ONEPASS=2 takes it anyway.
    // Except on tensors of 512 MiB and more, where the two-pass kernels' second read of x and dy comes from
    // DRAM: H100 2026-11-24, backward op ms one-pass / two-pass (onepass_bwd_probe.py --big,
    // bench_results/onepass_bwd_big_h100.log): 128x64x258x258 fp32 (L2#19's GroupNorm, 2.2 GB) 3.007 / 3.842,
    // 32x64x258x258 fp32 (545 MB) 0.767 / 0.975. Between 100 and 300 MB it goes both ways (8x128x256x256
    // bf16 0.210 / 0.241, 64x256x64x64 fp16 0.232 / 0.247, but 16x256x16000 bf16 0.274 / 0.239, 32x128x128x128
    // bf16 0.254 / 0.239): the rule above stays there.
    const bool big = p.N * p.C * p.HxW * esize >= (int64_t{512} << 20);
    auto streamed = [&](const OnePassGeometry& g) -> std::optional<OnePassGeometry> {
      if (bwd && onepass != 2 && !big && g.T >= 3 && U > prop->multiProcessorCount) return std::nullopt;
      return g;
    };
    if (auto g = make(stages, avail / stages / bytes)) return streamed(*g);
    if (stages != 2)
      if (auto g = make(2, avail / 2 / bytes)) return streamed(*g);
    return std::nullopt;
  };
  if (!nhwc) {
    const std::optional<OnePassGeometry> g = plan(0);
    if (pack_ctas > 0 || !g || g->units * g->T <= g->grid || env_int("GNEXT_ONEPASS_CTAS", 0) != 0 ||
        env_int("GNEXT_ONEPASS_PACK", 1) == 0)
      return g;
    // Streamed NCHW tiles of whole channels can leave most of a CTA's stages unused (16x256x16000 bf16: one
    // 16000-element channel per 28K-element stage); then more CTAs per SM fit with the same tiles. H100,
    // forward kernel µs at 2 -> 3 CTAs per SM (scripts/dev/profile_kernels.py --env GNEXT_ONEPASS_PACK=0,1;
    // bench_results/onepass_pack_h100.log, 2026-11-24): 16x256x16000 bf16 140.7 -> 122.2 (GroupNorm+SiLU
    // 158.8 -> 139.9); the other streamed shapes there have no room for a third CTA. Raising the CTA count
    // with smaller tiles instead went both ways (onepass_ctas_probe_h100.log: 4x256x256x256 bf16 139.2 ->
    // 127.7 at 4 CTAs, 32x512x28x28 fp32 51.5 -> 54.1). GNEXT_ONEPASS_PACK=0 turns it off (measurements).
    const int64_t need = static_cast<int64_t>(g->smem + gn::kOnePassStaticSmem + prop->reservedSharedMemPerBlock);
    const int fit = static_cast<int>(std::min<int64_t>(4, static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / need));
    if (fit <= ctas) return g;
    const std::optional<OnePassGeometry> q = onepass_geometry(p, t, bwd, nhwc, prologue, ptrs, fit, g->tile);
    return q && q->T == g->T && q->tile == g->tile && q->nbuf == g->nbuf ? q : g;
  }
  // NHWC one-pass pays only with few tiles per unit over a few MB. H100, fp16/bf16 channels_last,
  // 2026-11-23 (bench_results/profile_nhwc_onepass_h100.log), forward kernel µs one-pass / two-pass:
  // won at 2x1280x32x32 (T = 16 tiles per unit, 5 MB: 21.7 / 31.3) and 2x640x64x64 (T = 33, 10 MB:
  // 25.1 / 30.6); lost at 4x512x64x64 (T = 33, 17 MB: 32.1 / 29.2), 8x256x32x32 (T = 32: 30.4 / 13.2),
  // 2x320x64x64 (T = 66: 31.1 / 21.2), 1x512x64x64 (T = 128: 41.8 / 18.8), 1x256x128x128 (T = 261:
  // 93.8 / 25.7) and under 4 MB (2x1280x16x16, T = 16: 20.2 / 12.5). Rule: T <= 16 and >= 4 MiB.
  auto pays = [&](const std::optional<OnePassGeometry>& g) -> std::optional<OnePassGeometry> {
    if (!g || onepass == 2) return g;  // 2: wherever it fits (tests, measurements)
    if (g->T > 16 || p.N * p.C * p.HxW * esize < (int64_t{4} << 20)) return std::nullopt;
    return g;
  };
  // NHWC: blocks of whole groups with rows of 16-byte multiples and at most `threads` channels (a
  // thread per channel in the finish). The widest block that fits wins (longer contiguous pieces
  // of each pixel row); blocks under 128 bytes per row only when nothing wider fits. Only plans
  // whose tiles all fit one wave of CTAs are used (the streamed NHWC plan lost, above).
  int64_t narrow = 0;
  for (int64_t cb = std::min<int64_t>(p.C, threads) / p.D * p.D; cb >= p.D; cb -= p.D) {
    if (p.C % cb != 0 || (cb * esize) % 16 != 0) continue;
    if (cb * esize < 128) {
      if (narrow == 0) narrow = cb;  // the widest narrow block
      continue;
    }
    if (auto g = plan(cb)) return pays(g);
  }
  return narrow > 0 ? pays(plan(narrow)) : std::nullopt;
}

// Small-group forward or backward plan (group_norm_small.cu), or nullopt: NCHW memory (or HxW == 1), no input prologue,
// groups of D*HxW elements in at most kSmallMaxVecs 16-byte vectors (aligned), held in registers by the
// fewest lanes (a power of two) that take at most 4 vectors each (8 at 32 lanes), more while the grid is
// small (kSmallFillCtas below), at least 64 groups.
// H100, forward kernel µs one-pass or two-pass -> this kernel (profile_kernels.py --env GNEXT_SMALL=0,1;
// bench_results/small_groups_h100.log, 2026-11-24): 64x512x1x1 fp16 CL 15.8 -> 4.6 (three NHWC kernels before),
// 256x1024x1x1 bf16 44.2 -> 9.0, 64x512x4x4 fp16 17.3 -> 3.8, 1024x512x4x4 fp16 240.2 -> 16.5, 32x256x7x7 bf16
// 11.8 -> 7.2, 256x256x7x7 fp32 72.4 -> 13.9, 16x4096x4x4 fp16 G=64 10.1 -> 4.4, 2x1280x1x1 fp16 (64 groups)
// 7.6 -> 5.7. Fewer groups leave lanes idle where the one-pass kernel puts a CTA on each: 2x48x7x7 bf16 G=3
// (6 groups) 6.5 -> 7.0 (GroupNorm+SiLU 6.6 -> 8.0), 4x100x10x10 fp16 G=10 (40) GroupNorm+SiLU 7.8 -> 8.6.
// GNEXT_SMALL=0: never.
// Backward (bwd; H100 backward kernel µs GNEXT_SMALL=0 -> 1, bench_results/small_bwd_h100.log, 2026-11-24):
// 1024x512x4x4 fp16 367.6 -> 42.5, 256x1024x1x1 bf16 64.3 -> 21.3, 256x256x7x7 fp32 83.6 -> 27.2, 64x512x4x4 fp16
// 26.3 -> 8.0, 32x256x7x7 bf16 16.5 -> 9.5, 64x512x1x1 fp16 CL 17.8 -> 10.2, 48x60x5x4 fp16 12.1 -> 8.2.
// The same plan, and the per-channel pieces of a CTA's groups (SmallPieces; none when a piece is a whole
// channel) must fit kSmallMaxSmem.
// Grid fill: with only the rule above, HxW = 1 and 4x4 maps ran on a few dozen CTAs (256x1024x1x1: 32 CTAs of
// 8 warps, one group of 4 vectors per lane) and were latency-bound; lanes are added (down to one vector each)
// until the grid has kSmallFillCtas CTAs per SM. H100 kernel µs forward / backward, GroupNorm and
// GroupNorm+SiLU, GNEXT_SMALL_FILL=0 (off) -> 2 (profile_kernels.py --summary; bench_results/small_fill_h100.log,
// 2026-11-24): 256x1024x1x1 bf16 9.1 / 29.2 -> 4.0 / 10.1, SiLU 9.7 / 49.1 -> 4.4 / 11.4; 64x512x1x1 fp16 CL
// 4.7 / 10.1 -> 3.6 / 7.0; 64x512x4x4 fp16 3.8 / 8.0 -> 3.5 / 6.0, SiLU backward 23.9 -> 8.3; 32x256x7x7 bf16
// 7.5 / 9.5 -> 5.9 / 7.4, SiLU backward 27.4 -> 13.3; 1, 2 and 4 CTAs per SM alike; shapes whose grid was
// already full (1024x512x4x4, 256x256x7x7, 16x4096x4x4) unchanged. GNEXT_SMALL_FILL=n: n CTAs per SM, 0 off.
// Groups of more than kSmallMaxVecs vectors, up to 8 per thread of a CTA (32 KB of fp16/bf16, 8 KB elements of
// fp32): a CTA per group (lanes_log2 = kSmallCtaLog2), its sums through shared memory, where there are at least
// kSmallCtaMinSms groups per SM (GNEXT_SMALL_CTA_MIN=n: n): ResNet-GN maps at batch 32, UNet2DModel's at batch 8
// (the SD UNets' N = 2 maps have 64 groups); identity, SiLU, ReLU and GELU only (small_cta_act). It replaces the
// one-pass forward and the two-pass backward (four kernels; scalar where HxW is not a multiple of the vector).
// H100 kernel µs forward / backward with the inputs in DRAM (L2 flushed), GNEXT_SMALL_CTA=0 -> 2
// (profile_kernels.py --summary --flush; bench_results/small_cta_flush_h100.log, small_cta_flush2_h100.log,
// 2026-11-24): 32x2048x7x7 bf16 22.4 / 109.9 -> 13.8 / 18.6 (GroupNorm+SiLU 24.8 / 115.7 -> 15.5 / 22.0);
// 32x1024x14x14 bf16 27.8 / 71.4 -> 20.6 / 27.6 (SiLU 30.9 / 84.9 -> 23.3 / 41.8); 32x256x28x28 bf16 19.4 / 29.9
// -> 13.9 / 22.8; 16x2048x7x7 fp32 14.6 / 60.2 -> 10.0 / 14.7; 32x512x28x28 bf16 (8 vectors per thread) 30.1 /
// 49.5 -> 30.0 / 39.1; 8x128x64x64 bf16 12.9 / 18.5 -> 10.2 / 16.2; 8x256x32x32 9.5 / 12.7 -> 6.7 / 11.2;
// 8x512x16x16 7.7 / 10.4 -> 4.7 / 8.4; 8x1024x14x14 12.0 / 25.2 -> 9.4 / 12.3. The 256-group maps (UNet2DModel)
// came with the rule going from 2 groups per SM to 1 (bench_results/small_cta_min_h100.log).
// GNEXT_SMALL_CTA=0: never; 1: backward only; 2: forward and backward.
constexpr int64_t kSmallFillCtas = 2;
constexpr int64_t kSmallMinGroups = 64;
constexpr int kSmallCtaDefault = 2;
constexpr int64_t kSmallCtaMinSms = 1;
inline std::optional<SmallGeometry> small_geometry(const Problem& p, ScalarType t, bool prologue, int act,
                                                   std::initializer_list<const void*> ptrs, bool bwd = false) {
  if (env_int("GNEXT_SMALL", 1) == 0 || prologue || p.N * p.G < kSmallMinGroups) return std::nullopt;
  const int64_t L = p.D * p.HxW;
  const int V = vector_width(t, L, ptrs);
  if (V == 1) return std::nullopt;
  const int64_t nvec = L / V;
  SmallGeometry g{};
  g.vec = V;
  const bool cta_plan = nvec > kSmallMaxVecs;
  if (cta_plan) {  // a CTA per group (kSmallCtaMinSms above)
    if (!small_cta_act(act)) return std::nullopt;
    const int cta = env_int("GNEXT_SMALL_CTA", kSmallCtaDefault);
    const bool fits = nvec <= int64_t{kSmallThreads} * (kSmallMaxVecs / 32) &&
                      p.N * p.G >= env_int("GNEXT_SMALL_CTA_MIN", kSmallCtaMinSms) * device_props().multiProcessorCount;
    // The backward with an activation stops at 4 vectors per thread: at 8, keeping dy' took 210 registers (one
    // CTA per SM; 32x512x28x28 bf16 GroupNorm+SiLU 77.0 µs against GroupNorm's 39.5) and computing it twice lost
    // to the one-pass kernel with inputs from DRAM (8x128x64x64 bf16 30.3 against 23.3 µs,
    // bench_results/small_cta_flush_h100.log).
    const bool act_bwd_fits = !bwd || act == kActIdentity || nvec <= int64_t{kSmallThreads} * 4;
    if (!fits || !act_bwd_fits || cta == 0 || (cta == 1 && !bwd)) return std::nullopt;
    g.lanes_log2 = kSmallCtaLog2;
    g.k = static_cast<int>(ceil_div(nvec, int64_t{kSmallThreads}));
    g.grid = static_cast<unsigned>(p.N * p.G);
  } else {
    g.lanes_log2 = 0;
    while (g.lanes_log2 < 5 && (int64_t{4} << g.lanes_log2) < nvec) ++g.lanes_log2;
    auto grid_of = [&](int lanes_log2) {
      return ceil_div(ceil_div(p.N * p.G, int64_t{32} >> lanes_log2), int64_t{kSmallThreads / 32});
    };
    // Then more lanes per group (fewer vectors each) while the grid has fewer than kSmallFillCtas CTAs per SM.
    const int64_t fill = int64_t{env_int("GNEXT_SMALL_FILL", kSmallFillCtas)} * device_props().multiProcessorCount;
    while (g.lanes_log2 < 5 && (int64_t{1} << g.lanes_log2) < nvec && grid_of(g.lanes_log2) < fill) ++g.lanes_log2;
    g.k = static_cast<int>(ceil_div(nvec, int64_t{1} << g.lanes_log2));
    g.grid = static_cast<unsigned>(grid_of(g.lanes_log2));
  }
  // The kernels' registers sized by k, rounded up to 1, 2, 4 or 8 (group_norm_small.cu, with_small), for the
  // activations that have those variants (small_sized_act; a CTA-per-group plan has one of them, and k >= 2);
  // GNEXT_SMALL_KREG=8: 8 vector registers per lane for every warp plan, as before 2026-11-24.
  const bool sized = cta_plan || (small_sized_act(act) && env_int("GNEXT_SMALL_KREG", 0) != 8);
  g.kreg = !sized ? 8 : g.k <= 1 ? 1 : g.k <= 2 ? 2 : g.k <= 4 ? 4 : 8;
  g.smem = 0;
  if (bwd) {  // a CTA's pieces: one group's (CTA per group) or those of all its warps' groups
    const SmallPieces pc(static_cast<uint32_t>(p.HxW), static_cast<uint32_t>(V));
    const int64_t groups_per_cta = cta_plan ? 1 : (kSmallThreads / 32) * (int64_t{32} >> g.lanes_log2);
    if (!pc.direct) g.smem = static_cast<size_t>(groups_per_cta * p.D * pc.slots * 8);
    if (g.smem > kSmallMaxSmem) return std::nullopt;
  }
  return g;
}

// Stage buffers of a wide plan whose grid and slice are set: `tensors` staged tensors (the backward: x and dy),
// 1 + ahead buffers each, out of `avail` bytes of shared memory, plus `extra` bytes; each buffer holds the
// first bytes of a slice, a multiple of `align` (GNEXT_WIDE_HELD=bytes caps it). L2 holds the rest of every
// unit between its two reads: a forward with the look-ahead has three units' rests there at once (the one
// normalized, the ones read), kept under half of L2 (the writes stream through the rest), else it drops the
// look-ahead; GNEXT_WIDE_AHEAD=0 drops it always. Sets g.held, g.ahead, g.smem; returns the bytes of a unit
// (all staged tensors) beyond shared memory.
inline int64_t wide_stages(WideGeometry& g, int64_t esize, int64_t unit_bytes, int tensors, bool ahead,
                           int64_t avail, int64_t align, int64_t extra) {
  int64_t rest = 0;
  auto fill = [&](int a) {
    const int64_t parts = int64_t{tensors} * (1 + a);
    int64_t held = std::min<int64_t>(avail / parts / align * align, g.slice * esize);
    if (const int cap = env_int("GNEXT_WIDE_HELD", -1); cap >= 0) held = std::min<int64_t>(held, cap / 16 * 16);
    g.held = held / esize;
    g.ahead = a;
    g.smem = static_cast<size_t>(parts * held + extra);
    rest = tensors * (unit_bytes - static_cast<int64_t>(g.grid) * held);
  };
  fill(ahead && env_int("GNEXT_WIDE_AHEAD", 1) != 0 ? 1 : 0);
  if (g.ahead == 1 && 3 * rest > static_cast<int64_t>(device_props().l2CacheSize) / 2) fill(0);
  return rest;
}

// Wide forward plan (group_norm_wide.cuh) for an NCHW forward that the one-pass plan did not take, or
// nullopt. One CTA per SM, each a 1 KB-aligned slice of every group, as much of it as fits kept in
// shared memory (~29 MB over the H100's 132 SMs; ~15 MB per group with the look-ahead's two buffers) and
// the rest left in L2 between the two reads. It pays only for large groups: every group costs a grid-wide
// wait, which the saved re-read of x (the group's bytes at DRAM speed) must outweigh. H100, forward ms,
// two-pass / wide without look-ahead / wide with it / torch.compile (scripts/dev/l2_resident_probe.py
// --no-probe; bench_results/wide_final_h100.log 2026-11-24 and wide_ahead_h100.log 2026-11-24 10:50 UTC):
//   1x256x1024x1024 bf16 (16.8 MB groups): 0.571 / 0.559 / 0.505 / 0.588; GroupNorm+SiLU 0.576 / 0.601 / 0.542
//   1x128x2048x2048 bf16 (33.6 MB): 1.119 / 0.966 / - (3 groups' L2 parts would not fit half of L2) / 1.083;
//   GroupNorm+SiLU 1.121 / 1.024
//   1x96x2048x2048 bf16 (25.2 MB): 0.871 / 0.746 / - / 0.868; GroupNorm+SiLU 0.881 / 0.802
//   1x128x1024x1024 fp16 (8.4 MB, the one-pass plan's: 0.255): 0.300 / 0.362 / 0.297; GroupNorm+SiLU
//   one-pass 0.288, wide 0.312
//   4x256x512x512 bf16 (4.2 MB, one-pass 0.510): 0.555 / 0.945 / 0.735
// Taken for groups of at least kWideMinBytes, with or without an output activation, where what shared
// memory cannot hold is at most a quarter of L2 (with the look-ahead: a sixth).
// GNEXT_WIDE: 0 off, 1 that rule (default), 2 wherever it applies (tests, measurements);
// GNEXT_WIDE_HELD=bytes caps the shared memory per CTA and buffer (tests: the L2 part of a slice);
// GNEXT_WIDE_AHEAD=0: no look-ahead (measurements, tests).
constexpr int64_t kWideMinBytes = int64_t{16} << 20;
// Backward (x and dy staged; bytes of both). H100, 2026-11-24 07:31 UTC, backward op ms two-pass / wide
// (bench_results/wide_bwd_h100.log): 1x128x2048x2048 bf16 (x + dy 67 MB per group) 1.888 / 1.732,
// 1x96x2048x2048 (50 MB) 1.453 / 1.257, 1x256x1024x1024 (33.6 MB) 0.943 / 0.799, 8x256x1024x1024 7.253 /
// 6.346; 16.8 MB: 1x128x1024x1024 fp16 0.485 / 0.476 but L1#35 112x64x512x512 fp32 12.566 / 12.846;
// 8.4 MB (4x256x512x512 bf16) 0.784 / 1.205. So from 24 MiB, and the part beyond shared memory may fill
// L2 (37 MB at the 2048^2 map still won). With an output activation from 48 MiB: GroupNorm+SiLU backward
// 1x256x1024x1024 bf16 0.967 / 1.002 (lost), 1x128x2048x2048 2.012 / 1.946 (wide_bwd_final_h100.log).
constexpr int64_t kWideMinBytesBwd = int64_t{24} << 20;
constexpr int64_t kWideMinBytesBwdAct = int64_t{48} << 20;
inline std::optional<WideGeometry> wide_geometry(const Problem& p, ScalarType t, bool prologue, bool epilogue,
                                                 std::initializer_list<const void*> ptrs, bool bwd = false) {
  const int mode = env_int("GNEXT_WIDE", 1);
  const DeviceProps& prop = device_props();
  if (mode == 0 || prologue || prop.major < 8 || vector_width(t, p.HxW, ptrs) == 1) return std::nullopt;
  const int64_t esize = element_size(t), L = p.D * p.HxW, tensors = bwd ? 2 : 1, bytes = tensors * L * esize;
  if (L >= (int64_t{1} << 31)) return std::nullopt;  // offsets within a group are 32-bit
  WideGeometry g{};
  g.slice = round_up(ceil_div(L, prop.multiProcessorCount), 1024 / esize);
  // The backward keeps per-channel sums of a slice's first and second channel only.
  if (bwd && g.slice > p.HxW) return std::nullopt;
  g.grid = static_cast<unsigned>(ceil_div(L, g.slice));
  g.threads = kWideThreads;
  // The backward's one or two rests of a group in L2 are kept under all of it (below).
  const int64_t rest = wide_stages(g, esize, L * esize, static_cast<int>(tensors), /*ahead=*/!bwd,
                                   static_cast<int64_t>(prop.sharedMemPerBlockOptin) - kWideStaticSmem, 1024, 0);
  const int64_t l2 = static_cast<int64_t>(prop.l2CacheSize);
  if (mode == 2) return g;
  // H200, op us two-pass / wide: 1x512x1024x1024 fp16 forward 790 / 807, backward 1273 / 1342; 1x128x2048x2048
  // bf16 backward 1282 / 1348 (the H100 gains 5-14% from the wide kernels on the same shapes).
  if (!persistent_kernels_pay(peak_dram_gbs(prop))) return std::nullopt;
  const int64_t min_bytes = bwd ? (epilogue ? kWideMinBytesBwdAct : kWideMinBytesBwd) : kWideMinBytes;
  const int64_t max_rest = bwd ? l2 : l2 / 4;
  if (bytes < min_bytes || rest > max_rest) return std::nullopt;
  return g;
}

// Channels_last wide forward (wide_nhwc_forward_kernel, group_norm_wide.cuh): images whose statistics pass and
// normalize pass can share one read from DRAM (an image in shared memory over all SMs plus L2), or nullopt.
// Needs 16-byte vectors of channels (C % V == 0, aligned pointers), at most two groups per vector, lcm(C / V,
// 32) <= kWideThreads. Threads: the most whole rows of C / V vectors (and whole warps) within kWideThreads; slice: whole rows,
// ceil(HxW / SMs) each; shared memory: two stage buffers (one with GNEXT_WIDE_AHEAD=0) after the per-thread
// and per-group statistics. Taken (GNEXT_WIDE_NHWC=1) for a single image (N = 1) of at least kWideNhwcMinBytes
// whose part beyond shared memory fits the L2 budget of wide_geometry; GNEXT_WIDE_NHWC=2 wherever it applies
// (tests, measurements), 0 never. H100 forward op µs, GroupNorm / GroupNorm+SiLU, default kernels -> this one
// (scripts/dev/knob_ab.py --env GNEXT_WIDE_NHWC=0,2; bench_results/wide_nhwc_n1_h100.log, 2026-11-24):
// 1x512x128x128 fp16 31.5 -> 28.8 / 33.8 -> 30.4 (bf16 30.4 -> 29.0 / 31.6 -> 31.4), 1x256x256x256 fp16 48.9 ->
// 43.7 / 50.1 -> 45.8, 1x640x128x128 fp32 74.0 -> 51.9 / 75.2 -> 52.6, 1x128x256x256 fp32 46.2 -> 42.0,
// 1x128x16x64x64 bf16 32.5 -> 29.5 / 33.4 -> 32.7, 1x320x128x128 fp16 25.1 -> 24.4 / 25.9 -> 26.3. Several
// images lose: each image costs the kernel ~9 µs beyond its DRAM time (the grid-wide wait and the statistics
// steps, during which no CTA streams; merging the partials with all warps instead of one per group did not
// move it), against the ~5.6 µs per 16.8 MB image that the saved re-read is worth: 16x512x128x128 bf16 291.4
// -> 359.9, 2x320x128x128 fp16 35.2 -> 45.4, 4x256x128x128 fp32 85.4 -> 93.1 (wide_nhwc_ab2_h100.log; Nsight
// Compute on the first: DRAM 42% busy, 16 warps per SM issuing every 9.4 cycles, ncu_wide_nhwc_h100.txt).
constexpr int64_t kWideNhwcMinBytes = int64_t{8} << 20;
inline std::optional<WideGeometry> wide_nhwc_geometry(const Problem& p, ScalarType t, bool prologue,
                                                      std::initializer_list<const void*> ptrs) {
  const int mode = env_int("GNEXT_WIDE_NHWC", 1);
  const DeviceProps& prop = device_props();
  const int64_t esize = element_size(t), V = 16 / esize;
  if (mode == 0 || prologue || prop.major < 8 || vector_width(t, p.C, ptrs) != V) return std::nullopt;
  const int64_t CV = p.C / V, L = p.C * p.HxW;
  if (CV > kWideThreads) return std::nullopt;
  for (int64_t cv = 0; cv < CV; ++cv)  // at most two groups per vector
    if ((cv * V + V - 1) / p.D - (cv * V) / p.D > 1) return std::nullopt;
  const int64_t unit = std::lcm(CV, int64_t{32});  // whole rows and whole warps
  if (unit > kWideThreads) return std::nullopt;
  WideGeometry g{};
  g.threads = static_cast<int>(kWideThreads / unit * unit);
  const int64_t srows = ceil_div(p.HxW, int64_t{prop.multiProcessorCount});
  g.slice = srows * p.C;
  g.grid = static_cast<unsigned>(ceil_div(p.HxW, srows));
  const int64_t stats = int64_t{g.threads} * 2 * static_cast<int64_t>(sizeof(float)) * 3 + p.G * 8;
  const int64_t avail = static_cast<int64_t>(prop.sharedMemPerBlockOptin) - kWideStaticSmem - round_up(stats, 16);
  if (avail <= 0) return std::nullopt;
  const int64_t rest = wide_stages(g, esize, L * esize, 1, /*ahead=*/p.N > 1, avail, 16, round_up(stats, 16));
  const int64_t l2 = static_cast<int64_t>(prop.l2CacheSize);
  if (mode == 2) return g;
  if (p.N != 1 || L * esize < kWideNhwcMinBytes || rest > l2 / 4) return std::nullopt;
  return g;
}

}  // namespace gn
}  // namespace gnext
