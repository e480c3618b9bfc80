// CUDA implementation of the GroupNorm ops: argument checks, layout choice, launch geometry,
// allocation. The kernels are behind group_norm_launch.h (group_norm_kernels.cu).
#include <algorithm>
#include <cstdlib>
#include <optional>

#include "../common/cuda_utils.h"
#include "group_norm.h"
#include "group_norm_launch.h"

namespace gnext {
namespace {

using gn::AffineGeometry;
using gn::OnePassArgs;
using gn::OnePassGeometry;
using gn::PartialLayout;
using gn::Problem;
using gn::ReduceGeometry;
using gn::ScalarKind;

using gn::kMaxThreads;
using gn::kUnroll;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace

ScalarKind scalar_kind(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return ScalarKind::Float;
    case ScalarType::Half:
      return ScalarKind::Half;
    case ScalarType::BFloat16:
      return ScalarKind::BFloat16;
    default:
      fail("gnext: unsupported dtype ", t, " (expected float32, float16 or bfloat16)");
  }
}

namespace {

int64_t element_size(ScalarType t) { return t == ScalarType::Float ? 4 : 2; }

// CTAs to aim for per launch: enough to fill every SM a few times over.
int64_t target_ctas() { return 4 * static_cast<int64_t>(device_props().multiProcessorCount); }

// Widest vector (elements per 16-byte access) when rows have `inner` elements and every pointer
// is 16-byte aligned; 1 otherwise.
int vector_width(ScalarType t, int64_t inner, std::initializer_list<const void*> ptrs) {
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
NhwcSplit nhwc_split(const Problem& p, int V) {
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
  int64_t K = std::max(ceil_div(target_ctas(), p.N), ceil_div(p.HxW, kMaxNhwcRows));
  K = std::min(K, ceil_div(p.HxW, static_cast<int64_t>(s.rpi) * kUnroll));
  K = std::min(K, std::max<int64_t>(1, (int64_t{1} << 15) / p.D));
  s.chunk = ceil_div(p.HxW, std::max<int64_t>(K, 1));
  s.K = ceil_div(p.HxW, s.chunk);
  return s;
}

// NCHW: each of the N*C rows of HxW split into K chunks of `chunk` elements (a multiple of V), one
// CTA each, so that about target_ctas() CTAs run; at most max_k chunks per row.
struct RowSplit {
  int64_t K, chunk;
  int threads;
};
RowSplit nchw_row_split(const Problem& p, int V, int64_t max_k) {
  const int64_t rows = p.N * p.C;
  const int64_t K = rows >= target_ctas() ? 1 : std::min(ceil_div(target_ctas(), rows), std::max<int64_t>(1, max_k));
  RowSplit s{};
  s.chunk = round_up(ceil_div(p.HxW, K), V);
  s.K = ceil_div(p.HxW, s.chunk);
  s.threads = static_cast<int>(std::clamp<int64_t>(round_up(ceil_div(s.chunk / V, kUnroll), 32), 32, kMaxThreads));
  return s;
}

ReduceGeometry reduce_geometry(const Problem& p, bool nhwc, int V, size_t state_bytes) {
  ReduceGeometry g{};
  g.nhwc = nhwc;
  g.vec = V;
  if (nhwc) {
    const NhwcSplit s = nhwc_split(p, V);
    g.tpr = s.tpr, g.rpi = s.rpi, g.threads = s.threads, g.chunk = s.chunk, g.K = s.K;
    g.smem = static_cast<size_t>(g.rpi) * p.C * state_bytes;
    return g;
  }
  const RowSplit s = nchw_row_split(p, V, p.HxW / 4096);
  g.K = s.K, g.chunk = s.chunk, g.threads = s.threads;
  return g;
}

AffineGeometry affine_geometry(const Problem& p, bool nhwc, int V) {
  AffineGeometry g{};
  g.nhwc = nhwc;
  g.vec = V;
  if (nhwc) {
    const NhwcSplit s = nhwc_split(p, V);
    g.tpr = s.tpr, g.rpi = s.rpi, g.threads = s.threads, g.chunk = s.chunk;
    g.grid_x = static_cast<unsigned>(p.N);
    g.grid_y = static_cast<unsigned>(s.K);
    return g;
  }
  const int64_t rows = p.N * p.C, hwv = p.HxW / V;
  constexpr int64_t kVecsPerCta = kMaxThreads * kUnroll;
  int64_t rows_per_cta = std::max<int64_t>(1, kVecsPerCta / hwv);
  rows_per_cta = std::min(rows_per_cta, std::max<int64_t>(1, rows / target_ctas()));
  if (rows_per_cta > 1) {  // short rows, packed rows_per_cta to a CTA
    g.rows_per_cta = static_cast<int>(rows_per_cta);
    g.threads = static_cast<int>(std::min<int64_t>(kMaxThreads, round_up(rows_per_cta * hwv, 32)));
    g.grid_x = static_cast<unsigned>(ceil_div(rows, rows_per_cta));
    g.grid_y = 1;
    g.chunk = p.HxW;
    return g;
  }
  const RowSplit s = nchw_row_split(p, V, hwv / kVecsPerCta);  // long rows, split in chunks
  g.rows_per_cta = 1;
  g.chunk = s.chunk;
  g.threads = s.threads;
  g.grid_x = static_cast<unsigned>(rows);
  g.grid_y = static_cast<unsigned>(s.K);
  return g;
}

PartialLayout partial_layout(const Problem& p, const ReduceGeometry& g) {
  if (g.nhwc) return {g.K, g.K * p.C, 1, p.C};  // partial[(n * K + k) * C + c]
  return {g.K, p.C * g.K, g.K, 1};               // partial[(n * C + c) * K + k]
}

// Layout the kernels run in: NHWC for channels_last input and for HxW == 1 (where (N, C) memory
// is the same in both); NCHW otherwise, or when NHWC's shared memory (rpi * C states) won't fit.
bool use_nhwc(const Tensor& x, const Problem& p, size_t state_bytes, std::initializer_list<const void*> ptrs) {
  if (x.is_contiguous() && p.HxW != 1) return false;
  const int V = vector_width(x.scalar_type(), p.C, ptrs);
  const ReduceGeometry g = reduce_geometry(p, true, V, state_bytes);
  return g.smem <= device_props().sharedMemPerBlockOptin;
}

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::atoi(v) : dflt;
}

// One-pass plan (see OnePassGeometry in group_norm_launch.h), or nullopt when the two-pass
// kernels must run: rows (HxW for NCHW, C for NHWC) not 16-byte aligned, a group (NHWC: a block
// of whole groups) too large to be held in shared memory across the grid, or GNEXT_ONEPASS=0.
// Tuning knobs (environment, for measurements): GNEXT_ONEPASS_CTAS (CTAs per SM, default 2),
// GNEXT_ONEPASS_NBUF (shared-memory stages, default 2). Defaults from scripts/onepass_sweep.py on the
// H100 (docs/kernels.md): larger tiles beat deeper prefetch; 2 CTAs per SM overlap their waits.
std::optional<OnePassGeometry> onepass_geometry(const Problem& p, ScalarType t, bool bwd, bool nhwc,
                                                std::initializer_list<const void*> ptrs) {
  if (env_int("GNEXT_ONEPASS", 1) == 0) return std::nullopt;
  const int V = vector_width(t, nhwc ? p.C : p.HxW, ptrs);
  if (V == 1) return std::nullopt;
  const DeviceProps* prop = &device_props();
  const int ctas = std::clamp(env_int("GNEXT_ONEPASS_CTAS", 2), 1, 4);
  const int stages = std::clamp(env_int("GNEXT_ONEPASS_NBUF", 2), 2, 4);
  const int64_t slots = static_cast<int64_t>(prop->multiProcessorCount) * ctas;  // co-resident CTAs
  const int threads = std::max(128, gn::kOnePassThreads / ctas / 32 * 32);
  const int64_t esize = element_size(t);
  const int64_t bytes = esize * (bwd ? 2 : 1);  // stage bytes per element
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
      const int64_t tiles = g.units * g.T;
      g.grid = static_cast<unsigned>(std::min(tiles, slots));
      if (g.T > g.grid || (nbuf == 1 && tiles > g.grid)) return std::nullopt;
      g.smem = static_cast<size_t>(nbuf * g.tile * bytes + extra);
      return g;
    };
    // Few units: split each over slots / U CTAs, one tile per CTA. Up to one unit per CTA: one
    // tile each, no inter-CTA waits. Otherwise stream tiles through `stages` (else 2) stages.
    if (avail <= 0) return std::nullopt;
    if (4 * U <= slots)
      if (auto g = make(1, std::min(avail / bytes, round_up(ceil_div(L, slots / U), V)))) return g;
    if (U <= slots)
      if (auto g = make(1, avail / bytes)) return g;
    // NHWC streamed through stages measured slower than the two-pass kernels (UNet
    // 16x512x128x128 bf16 CL on the H100: 0.48-0.92 ms vs 0.31 ms; docs/kernels.md): not used.
    if (nhwc) return std::nullopt;
    if (auto g = make(stages, avail / stages / bytes)) return g;
    if (stages != 2)
      if (auto g = make(2, avail / 2 / bytes)) return g;
    return std::nullopt;
  };
  if (!nhwc) return plan(0);
  // NHWC: blocks of whole groups with rows of 16-byte multiples and at most `threads` channels (a
  // thread per channel in the finish). The widest block that fits wins (longer contiguous pieces
  // of each pixel row); blocks under 128 bytes per row only when nothing wider fits. Only plans
  // whose tiles all fit one wave of CTAs (small tensors, e.g. SD 2x640x64x64) are used.
  int64_t narrow = 0;
  for (int64_t cb = std::min<int64_t>(p.C, threads) / p.D * p.D; cb >= p.D; cb -= p.D) {
    if (p.C % cb != 0 || (cb * esize) % 16 != 0) continue;
    if (cb * esize < 128) {
      if (narrow == 0) narrow = cb;  // the widest narrow block
      continue;
    }
    if (auto g = plan(cb)) return g;
  }
  return narrow > 0 ? plan(narrow) : std::nullopt;
}

// Element type of gamma/beta: float32 or the input's.
ScalarKind param_kind(const OptTensor& a, const OptTensor& b, ScalarType fallback) {
  if (defined(a)) return scalar_kind(a->scalar_type());
  if (defined(b)) return scalar_kind(b->scalar_type());
  return scalar_kind(fallback);
}

// Zeroed per-unit counters for a one-pass launch whose units span several tiles (zeroed_counters:
// no allocation or memset outside CUDA-graph capture); null when every unit is one tile.
Counters onepass_counters(const OnePassGeometry& g, const Tensor& like, cudaStream_t stream) {
  return g.T == 1 ? Counters{} : zeroed_counters(like, g.units, stream);
}

Problem to_problem(const GNShape& s) { return {s.N, s.C, s.G, s.D, s.HxW}; }

// Kernel arguments of the pointwise extension. residual: in the layout of the kernels' x (or
// undefined); rstd, gamma, beta: for the epilogue's backward.
gn::PwArgs pw_args(const Pointwise& pro, const Tensor& residual, const float* rstd, const OptTensor& gamma,
                   const OptTensor& beta) {
  gn::PwArgs a{};
  a.mode = pw_mode(pro.kind, pro.act);
  a.bias = ptr_or_null(pro.bias);
  a.bias_t = defined(pro.bias) ? scalar_kind(pro.bias->scalar_type()) : ScalarKind::Float;
  a.residual = residual.defined() ? residual.data_ptr() : nullptr;
  a.rstd = rstd;
  a.gamma = ptr_or_null(gamma);
  a.beta = ptr_or_null(beta);
  a.wt = defined(gamma) ? scalar_kind(gamma->scalar_type())
                        : defined(beta) ? scalar_kind(beta->scalar_type()) : ScalarKind::Float;
  return a;
}

// The one-pass kernels take a pointwise extension only in NCHW (the NHWC one has none).
bool onepass_allows(const Pointwise& pro, bool nhwc) {
  return !nhwc || (pro.kind == kPreNone && pro.act == kActIdentity && !defined(pro.residual));
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> group_norm_cuda_pre(const char* op, const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps,
                                                       const Pointwise& pro) {
  const GNShape s = check_group_norm_args(op, input, num_groups, weight, bias);
  check_pointwise(op, input, pro);
  const Problem p = to_problem(s);
  DeviceGuard guard(input);
  const Tensor x_in = dense_input(input);
  Tensor out = empty_as(input, group_norm_memory_format(input));
  Tensor mean = empty_on(input, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(input, {s.N, s.G}, ScalarType::Float);
  if (input.numel() == 0) {
    fill_empty_stats(mean, rstd);
    return {out, mean, rstd};
  }
  const OptTensor w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  const OptTensor b = defined(bias) ? OptTensor(contig(*bias)) : std::nullopt;
  const bool nhwc = use_nhwc(x_in, p, gn::kMomentsStateBytes, {x_in.data_ptr(), out.data_ptr()});
  // channels_last input too wide for the NHWC kernels' shared memory runs in NCHW.
  // channels_last input too wide for the NHWC kernels' shared memory runs in NCHW (out is
  // channels_last: the result is computed into a contiguous y and copied).
  const bool relayout = !nhwc && !x_in.is_contiguous();
  const Tensor x = relayout ? contig(x_in) : x_in;
  Tensor y = relayout ? empty_as(x, MemoryFormat::Contiguous) : out;
  const ScalarKind t = scalar_kind(input.scalar_type());
  const Tensor res = defined(pro.residual) ? dense_in(*pro.residual, suggest_format(x)) : Tensor();
  const void* res_ptr = res.defined() ? res.data_ptr() : nullptr;
  const gn::PwArgs pw = pw_args(pro, res, nullptr, w, b);
  const int V = vector_width(input.scalar_type(), nhwc ? s.C : s.HxW, {x.data_ptr(), y.data_ptr(), res_ptr});
  const cudaStream_t stream = current_stream(x);
  const auto og = onepass_allows(pro, nhwc)
                      ? onepass_geometry(p, input.scalar_type(), false, nhwc, {x.data_ptr(), y.data_ptr(), res_ptr})
                      : std::nullopt;
  if (og) {
    Tensor partial = empty_on(x, {s.N * s.G * og->T * 3}, ScalarType::Float);  // per (tile, group)
    const Counters counters = onepass_counters(*og, mean, stream);
    OnePassArgs a{};
    a.x = x.data_ptr(), a.out = y.data_ptr(), a.gamma = ptr_or_null(w), a.beta = ptr_or_null(b);
    a.wt = param_kind(w, b, ScalarType::Float);
    a.mean = ptr<float>(mean), a.rstd = ptr<float>(rstd), a.partial = ptr<float>(partial);
    a.counters = counters.ptr, a.eps = static_cast<float>(eps), a.pw = pw;
    GNEXT_CUDA_CHECK(gn::launch_onepass(false, t, p, *og, a, stream));
    if (relayout) copy_into(out, y);
    return {out, mean, rstd};
  }
  const ReduceGeometry rg = reduce_geometry(p, nhwc, V, gn::kMomentsStateBytes);
  Tensor partial = empty_on(x, {s.N * s.C * rg.K * 3}, ScalarType::Float);
  Tensor coef = empty_on(x, {s.N, s.C, 4}, ScalarType::Float);
  GNEXT_CUDA_CHECK(
      gn::launch_reduce(false, t, p, rg, x.data_ptr(), nullptr, nullptr, ptr<float>(partial), pw, stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_forward(param_kind(w, b, ScalarType::Float), p, partial_layout(p, rg),
                                             ptr<float>(partial), ptr_or_null(w), ptr_or_null(b),
                                             ptr<float>(mean), ptr<float>(rstd), ptr<float>(coef),
                                             static_cast<float>(eps), nullptr, stream));
  GNEXT_CUDA_CHECK(gn::launch_affine(false, t, p, affine_geometry(p, nhwc, V), x.data_ptr(), nullptr, y.data_ptr(),
                                   ptr<float>(coef), pw, stream));
  if (relayout) copy_into(out, y);
  return {out, mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cuda_pre(
    const char* op, const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd,
    const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask, const Pointwise& pro) {
  const GNShape s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups);
  check_pointwise(op, input, pro);
  const Problem p = to_problem(s);
  if (defined(pro.gn_bias)) check_group_norm_args(op, input, num_groups, weight, pro.gn_bias);
  DeviceGuard guard(input);
  const bool need_params = output_mask[1] || output_mask[2];
  auto [dx, dgamma, dbeta] = alloc_backward_outputs(input, s, weight, output_mask);
  if (input.numel() == 0 || (!output_mask[0] && !need_params)) return {dx, dgamma, dbeta};
  const Tensor x_in = dense_input(input);
  const Tensor mean_c = contig(mean), rstd_c = contig(rstd);
  const OptTensor w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  const Tensor dy_in = dense_in(grad_out, group_norm_memory_format(x_in));
  const bool nhwc = use_nhwc(x_in, p, gn::kGradStateBytes,
                             {x_in.data_ptr(), dy_in.data_ptr(), dx ? dx->data_ptr() : nullptr});
  const bool relayout = !nhwc && !x_in.is_contiguous();
  const Tensor x = relayout ? contig(x_in) : x_in;
  const Tensor dy = relayout ? contig(grad_out) : dy_in;
  const Tensor dx_work = !dx ? Tensor() : relayout ? empty_as(x, MemoryFormat::Contiguous) : *dx;
  const ScalarKind t = scalar_kind(input.scalar_type());
  const int V = vector_width(input.scalar_type(), nhwc ? s.C : s.HxW,
                             {x.data_ptr(), dy.data_ptr(), dx_work.defined() ? dx_work.data_ptr() : nullptr});
  Tensor dsum = need_params ? empty_on(x, {s.N, s.C, 2}, ScalarType::Float) : Tensor();
  const OptTensor b = defined(pro.gn_bias) ? OptTensor(contig(*pro.gn_bias)) : std::nullopt;
  const gn::PwArgs pw = pw_args(pro, Tensor(), ptr<float>(rstd_c), w, b);
  const cudaStream_t stream = current_stream(x);
  auto gamma_beta = [&] {
    if (need_params)
      GNEXT_CUDA_CHECK(gn::launch_gamma_beta_backward(scalar_kind(param_grad_dtype(input, weight)), p,
                                                    ptr<float>(dsum), ptr<float>(rstd_c),
                                                    dgamma ? dgamma->data_ptr() : nullptr,
                                                    dbeta ? dbeta->data_ptr() : nullptr, stream));
  };
  const auto og = !output_mask[0] || !onepass_allows(pro, nhwc)
                      ? std::nullopt
                      : onepass_geometry(p, input.scalar_type(), true, nhwc,
                                         {x.data_ptr(), dy.data_ptr(), dx_work.data_ptr()});
  if (og) {
    // NCHW: per (n, c, piece); NHWC: per (tile, channel), then per (tile, group)
    Tensor partial = empty_on(x, {og->nhwc ? (s.N * s.C + s.N * s.G) * og->T * 2 : s.N * s.C * og->sub * 2},
                              ScalarType::Float);
    const Counters counters = onepass_counters(*og, mean_c, stream);
    OnePassArgs a{};
    a.x = x.data_ptr(), a.dy = dy.data_ptr(), a.out = dx_work.data_ptr(), a.gamma = ptr_or_null(w);
    a.beta = ptr_or_null(b);
    a.wt = param_kind(w, b, ScalarType::Float);
    a.mean = ptr<float>(mean_c), a.rstd = ptr<float>(rstd_c);
    a.partial = ptr<float>(partial), a.dsum = need_params ? ptr<float>(dsum) : nullptr;
    a.counters = counters.ptr, a.pw = pw;
    GNEXT_CUDA_CHECK(gn::launch_onepass(true, t, p, *og, a, stream));
    gamma_beta();
    if (relayout) copy_into(*dx, dx_work);
    return {dx, dgamma, dbeta};
  }
  const ReduceGeometry rg = reduce_geometry(p, nhwc, V, gn::kGradStateBytes);
  Tensor partial = empty_on(x, {s.N * s.C * rg.K * 2}, ScalarType::Float);
  Tensor coef = output_mask[0] ? empty_on(x, {s.N, s.C, 4}, ScalarType::Float) : Tensor();
  GNEXT_CUDA_CHECK(gn::launch_reduce(true, t, p, rg, x.data_ptr(), dy.data_ptr(), ptr<float>(mean_c),
                                   ptr<float>(partial), pw, stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_backward(
      param_kind(w, std::nullopt, ScalarType::Float), p, partial_layout(p, rg), ptr<float>(partial),
      ptr<float>(mean_c), ptr<float>(rstd_c), ptr_or_null(w),
      need_params ? ptr<float>(dsum) : nullptr, output_mask[0] ? ptr<float>(coef) : nullptr, stream));
  gamma_beta();
  if (output_mask[0]) {
    GNEXT_CUDA_CHECK(gn::launch_affine(true, t, p, affine_geometry(p, nhwc, V), x.data_ptr(), dy.data_ptr(),
                                     dx_work.data_ptr(), ptr<float>(coef), pw, stream));
    if (relayout) copy_into(*dx, dx_work);
  }
  return {dx, dgamma, dbeta};
}

std::tuple<Tensor, Tensor> group_norm_stats_cuda(const Tensor& x_in, const GNShape& s, const Tensor& shift,
                                                 double eps) {
  const Problem p = to_problem(s);
  Tensor mean = empty_on(x_in, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(x_in, {s.N, s.G}, ScalarType::Float);
  if (x_in.numel() == 0) {
    fill_empty_stats(mean, rstd);
    return {mean, rstd};
  }
  const bool nhwc = use_nhwc(x_in, p, gn::kMomentsStateBytes, {x_in.data_ptr()});
  const Tensor x = nhwc || x_in.is_contiguous() ? x_in : contig(x_in);
  const int V = vector_width(x.scalar_type(), nhwc ? s.C : s.HxW, {x.data_ptr()});
  const ReduceGeometry rg = reduce_geometry(p, nhwc, V, gn::kMomentsStateBytes);
  Tensor partial = empty_on(x, {s.N * s.C * rg.K * 3}, ScalarType::Float);
  const cudaStream_t stream = current_stream(x);
  GNEXT_CUDA_CHECK(gn::launch_reduce(false, scalar_kind(x.scalar_type()), p, rg, x.data_ptr(), nullptr, nullptr,
                                   ptr<float>(partial), gn::PwArgs{}, stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_forward(ScalarKind::Float, p, partial_layout(p, rg), ptr<float>(partial),
                                             nullptr, nullptr, ptr<float>(mean), ptr<float>(rstd),
                                             /*coef=*/nullptr, static_cast<float>(eps),
                                             shift.defined() ? ptr<float>(shift) : nullptr, stream));
  return {mean, rstd};
}

Tensor group_norm_affine_cuda(const Tensor& x, const GNShape& s, const Tensor& coef, const Pointwise& pro) {
  const Problem p = to_problem(s);
  Tensor out = empty_as(x, group_norm_memory_format(x));
  if (x.numel() == 0) return out;
  const bool nhwc = !x.is_contiguous();  // x is dense: channels_last, or contiguous
  const int V = vector_width(x.scalar_type(), nhwc ? s.C : s.HxW, {x.data_ptr(), out.data_ptr()});
  GNEXT_CUDA_CHECK(gn::launch_affine(false, scalar_kind(x.scalar_type()), p, affine_geometry(p, nhwc, V),
                                     x.data_ptr(), nullptr, out.data_ptr(), ptr<float>(coef),
                                     pw_args(pro, Tensor(), nullptr, std::nullopt, std::nullopt), current_stream(x)));
  return out;
}

Tensor group_norm_grad_finalize_cuda(const Tensor& partial, int64_t K, const GNShape& s, const Tensor& mean,
                                     const Tensor& rstd, const OptTensor& weight, const OptTensor& dgamma,
                                     const OptTensor& dbeta, bool want_coef) {
  const Problem p = to_problem(s);
  const bool need_params = dgamma.has_value() || dbeta.has_value();
  const OptTensor w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  Tensor dsum = need_params ? empty_on(mean, {s.N, s.C, 2}, ScalarType::Float) : Tensor();
  Tensor coef = want_coef ? empty_on(mean, {s.N, s.C, 4}, ScalarType::Float) : Tensor();
  if (!need_params && !want_coef) return coef;
  const cudaStream_t stream = current_stream(mean);
  const PartialLayout L{K, K * s.C, 1, s.C};  // partial[(n * K + k) * C + c], as the NHWC reduction
  GNEXT_CUDA_CHECK(gn::launch_finalize_backward(param_kind(w, std::nullopt, ScalarType::Float), p, L, ptr<float>(partial),
                                              ptr<float>(mean), ptr<float>(rstd), ptr_or_null(w),
                                              need_params ? ptr<float>(dsum) : nullptr,
                                              want_coef ? ptr<float>(coef) : nullptr, stream));
  if (need_params) {
    const Tensor& any = dgamma ? *dgamma : *dbeta;
    GNEXT_CUDA_CHECK(gn::launch_gamma_beta_backward(scalar_kind(any.scalar_type()), p, ptr<float>(dsum),
                                                  ptr<float>(rstd), dgamma ? dgamma->data_ptr() : nullptr,
                                                  dbeta ? dbeta->data_ptr() : nullptr, stream));
  }
  return coef;
}

namespace {

std::tuple<Tensor, Tensor, Tensor> group_norm_cuda(const Tensor& input, int64_t num_groups, const OptTensor& weight,
                                                   const OptTensor& bias, double eps) {
  return group_norm_cuda_pre("gnext.group_norm", input, num_groups, weight, bias, eps, Pointwise{});
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cuda(const Tensor& grad_out, const Tensor& input,
                                                                     const Tensor& mean, const Tensor& rstd,
                                                                     const OptTensor& weight, int64_t num_groups,
                                                                     std::vector<bool> output_mask) {
  return group_norm_backward_cuda_pre("gnext.group_norm_backward", grad_out, input, mean, rstd, weight, num_groups,
                                      mask_array<3>("gnext.group_norm_backward", output_mask), Pointwise{});
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("group_norm", TORCH_BOX(&group_norm_cuda));
  m.impl("group_norm_backward", TORCH_BOX(&group_norm_backward_cuda));
}

}  // namespace gnext
