// SPDX-License-Identifier: BSD-3-Clause
// CUDA implementation of the GroupNorm ops: check -> plan (group_norm_plan.h: which kernel, what geometry, a pure
// function of the problem and the device) -> allocate -> launch. Kernels: group_norm_launch.h.
#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include "../common/cuda_utils.h"
#include "group_norm.h"
#include "group_norm_plan.h"
#include "group_norm_launch.h"

namespace gnext {
namespace {

using gn::AffineGeometry;
using gn::Kernel;
using gn::OnePassArgs;
using gn::OnePassGeometry;
using gn::PartialLayout;
using gn::Plan;
using gn::ScalarKind;

using gn::partial_layout;

}  // namespace

gn::Device plan_device() {
  const DeviceProps& d = device_props();
  return {d.multiProcessorCount,
          d.major,
          static_cast<int64_t>(d.sharedMemPerMultiprocessor),
          static_cast<int64_t>(d.sharedMemPerBlockOptin),
          static_cast<int64_t>(d.reservedSharedMemPerBlock),
          static_cast<int64_t>(d.l2CacheSize),
          peak_dram_gbs(d)};
}

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

// The two-pass elementwise pass of NHWC x into an NCHW output (want_nchw): sets pw.out_nchw where the NCHW-out
// tile applies (a prologue, affine_out_nchw_fits) and then makes ag's chunks whole 16-byte runs of pixels; returns
// pw.out_nchw (false: the pass writes x's layout and the caller copies into the NCHW output).
bool plan_out_nchw(AffineGeometry& ag, gn::PwArgs& pw, bool want_nchw, const Pointwise& pro, const Problem& p,
                   size_t esize) {
  pw.out_nchw = want_nchw && pro.kind != kPreNone && gn::affine_out_nchw_fits(ag, p.C, esize);
  if (pw.out_nchw) ag = gn::affine_out_nchw_chunks(ag, p.HxW);
  return pw.out_nchw;
}

// The planner's view of a call: x's element size and layout and the pointwise extension (alignment: the caller).
gn::Request request_of(const Tensor& x, const Pointwise& pro) {
  gn::Request r;
  r.esize = static_cast<int64_t>(x.element_size());
  r.contiguous = x.is_contiguous();
  r.prologue = pro.kind != kPreNone;
  r.act = pro.act;
  r.residual = defined(pro.residual);
  r.input_shift = defined(pro.input_bias);
  return r;
}

// The two-pass statistics of x (reduction, then finalize): mean and rstd, and the (n, c) coefficients of the
// elementwise pass in `coef`, a slice of `ws` (alive until that pass is enqueued). pw: the reduction's prologue.
struct TwoPassStats {
  Scratch ws;
  float* coef = nullptr;
};
// A (C,) contiguous tensor as the kernels' input shift, read in its dtype; none where t is undefined.
gn::ChannelShift channel_shift(const Tensor& t) {
  return t.defined() ? gn::ChannelShift{t.data_ptr(), scalar_kind(t.scalar_type())}
                     : gn::ChannelShift{nullptr, ScalarKind::Float};
}

// shift: the statistics are those of x + shift[c] where given (the coefficients still apply to x).
TwoPassStats two_pass_stats(ScalarKind t, const Problem& p, const gn::ReduceGeometry& rg, const Tensor& x,
                            const gn::PwArgs& pw, const OptTensor& w, const OptTensor& b, const Tensor& mean,
                            const Tensor& rstd, double eps, cudaStream_t stream, gn::ChannelShift shift = {}) {
  const int64_t n_partial = p.N * p.C * rg.K * 3, n_coef = p.N * p.C * 4;
  TwoPassStats st{scratch(x, scratch_floats({n_partial, n_coef}), stream)};
  float* partial = st.ws.take(n_partial);
  st.coef = st.ws.take(n_coef);
  GNEXT_CUDA_CHECK(gn::launch_reduce(false, t, p, rg, x.data_ptr(), nullptr, nullptr, partial, pw, stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_forward(param_kind(w, b, ScalarType::Float), p, partial_layout(p, rg),
                                             partial, ptr_or_null(w), ptr_or_null(b), ptr<float>(mean),
                                             ptr<float>(rstd), st.coef, static_cast<float>(eps), shift, stream));
  return st;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> group_norm_cuda_pre(const char* op, const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps,
                                                       const Pointwise& pro, bool out_nchw) {
  const Problem s = check_group_norm_args(op, input, num_groups, weight, bias);
  check_pointwise(op, input, pro);
  GNEXT_CHECK(!out_nchw || !defined(pro.residual), op, ": an NCHW output takes no residual");
  const Problem& p = s;
  DeviceGuard guard(input);
  const Tensor x_in = dense_input(input);
  Tensor out = empty_as(input, out_nchw ? MemoryFormat::Contiguous : group_norm_memory_format(input));
  Tensor mean = empty_on(input, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(input, {s.N, s.G}, ScalarType::Float);
  if (input.numel() == 0) {
    fill_empty_stats(mean, rstd);
    return {out, mean, rstd};
  }
  const OptTensor w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  const OptTensor b = defined(bias) ? OptTensor(contig(*bias)) : std::nullopt;
  gn::Request req = request_of(x_in, pro);
  req.aligned = aligned16({x_in.data_ptr(), out.data_ptr(), defined(pro.residual) ? pro.residual->data_ptr() : nullptr});
  const Plan plan = gn::plan_forward(p, req, plan_device(), gn::tuning());
  const bool nhwc = plan.nhwc;
  // channels_last input too wide for the NHWC kernels' shared memory runs in NCHW (out is
  // channels_last: the result is computed into a contiguous y and copied).
  const bool relayout = !nhwc && !x_in.is_contiguous();
  const Tensor x = relayout ? contig(x_in) : x_in;
  // y: what the kernels write, contiguous for the NCHW kernels (copied into a channels_last out), out's own
  // layout for the NHWC ones. out_nchw with the NHWC kernels: the two-pass elementwise pass writes out
  // directly (PwArgs::out_nchw, with a prologue); the other NHWC plans write x's layout into a temporary.
  const bool y_copy = relayout && !out_nchw;
  Tensor y = y_copy ? empty_as(x, MemoryFormat::Contiguous) : out;
  const bool nhwc_out_nchw = nhwc && out_nchw;
  const ScalarKind t = scalar_kind(input.scalar_type());
  const Tensor res = defined(pro.residual) ? dense_in(*pro.residual, suggest_format(x)) : Tensor();
  const gn::PwArgs pw = pw_args(pro, res, nullptr, w, b);
  const cudaStream_t stream = current_stream(x);
  // The input shift, read in its dtype; the planner gave a kernel that takes it (two-pass or wide channels_last).
  const Tensor shift_t = defined(pro.input_bias) ? contig(*pro.input_bias) : Tensor();
  const gn::ChannelShift shift = channel_shift(shift_t);
  GNEXT_CHECK(!shift.p || plan.kernel == Kernel::kTwoPass || plan.kernel == Kernel::kWideNhwc, op,
              ": internal error: a plan without an input shift for input_bias");
  // The kernels that take OnePassArgs (one-pass, wide, small-group) get the same arguments: n_partial floats of
  // scratch for their partials (none: no allocation), `counters`, and launch(args).
  auto run_persistent = [&](int64_t n_partial, const Counters& counters,
                            auto&& launch) -> std::tuple<Tensor, Tensor, Tensor> {
    Scratch ws = scratch(x, n_partial, stream);
    const Tensor yk = nhwc_out_nchw ? empty_as(x, group_norm_memory_format(x)) : y;
    OnePassArgs a{};
    a.x = x.data_ptr(), a.out = yk.data_ptr(), a.gamma = ptr_or_null(w), a.beta = ptr_or_null(b);
    a.wt = param_kind(w, b, ScalarType::Float);
    a.mean = ptr<float>(mean), a.rstd = ptr<float>(rstd), a.partial = ws.take(n_partial);
    a.counters = counters.ptr, a.eps = static_cast<float>(eps), a.pw = pw, a.in_shift = shift;
    GNEXT_CUDA_CHECK(launch(a));
    if (y_copy) copy_into(out, y);
    if (nhwc_out_nchw) copy_into(out, yk);
    return {out, mean, rstd};
  };
  switch (plan.kernel) {
    case Kernel::kSmall:  // no scratch
      return run_persistent(0, Counters{}, [&](const OnePassArgs& a) {
        return gn::launch_small_forward(t, p, plan.small, a, stream);
      });
    case Kernel::kBulk:  // partials per (group, CTA)
      return run_persistent(s.N * s.G * plan.bulk.grid * 3, zeroed_counters(mean, s.N * s.G, stream),
                            [&](const OnePassArgs& a) { return gn::launch_bulk_forward(t, p, plan.bulk, a, stream); });
    case Kernel::kBulkNhwc:  // partials per (image, CTA of its team, group)
      return run_persistent(s.N * s.G * plan.bulk.grid * 3, zeroed_counters(mean, 2 * s.N, stream), [&](const OnePassArgs& a) {
        return gn::launch_bulk_nhwc_forward(t, p, plan.bulk, a, stream);
      });
    case Kernel::kOnePass:  // partials per (tile, group)
      return run_persistent(s.N * s.G * plan.onepass.T * 3, onepass_counters(plan.onepass, mean, stream),
                            [&](const OnePassArgs& a) { return gn::launch_onepass(false, t, p, plan.onepass, a, stream); });
    case Kernel::kWide:  // partials per (group, CTA)
      return run_persistent(s.N * s.G * plan.wide.grid * 3, zeroed_counters(mean, s.N * s.G, stream),
                            [&](const OnePassArgs& a) { return gn::launch_wide_forward(t, p, plan.wide, a, stream); });
    case Kernel::kWideNhwc:  // partials per (image, group, CTA)
      return run_persistent(s.N * s.G * plan.wide.grid * 3, zeroed_counters(mean, s.N, stream), [&](const OnePassArgs& a) {
        return gn::launch_wide_nhwc_forward(t, p, plan.wide, a, stream);
      });
    case Kernel::kTwoPass:
      break;
  }
  const TwoPassStats st = two_pass_stats(t, p, plan.reduce, x, pw, w, b, mean, rstd, eps, stream, shift);
  AffineGeometry ag = plan.affine;
  gn::PwArgs pw_out = pw;
  const bool copy_nchw = nhwc_out_nchw && !plan_out_nchw(ag, pw_out, nhwc_out_nchw, pro, p, x.element_size());
  const Tensor yk = copy_nchw ? empty_as(x, group_norm_memory_format(x)) : y;
  GNEXT_CUDA_CHECK(gn::launch_affine(false, t, p, ag, x.data_ptr(), nullptr, yk.data_ptr(), st.coef, pw_out, stream));
  if (y_copy) copy_into(out, y);
  if (copy_nchw) copy_into(out, yk);
  return {out, mean, rstd};
}

namespace {

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_impl(
    const char* op, const Problem& s, const Tensor& grad_out, const Tensor& input, const Tensor& mean,
    const Tensor& rstd, const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask,
    const Pointwise& pro) {
  check_pointwise(op, input, pro);
  const Problem& p = s;
  if (defined(pro.gn_bias)) check_group_norm_args(op, input, num_groups, weight, pro.gn_bias);
  DeviceGuard guard(input);
  const bool need_params = output_mask[1] || output_mask[2];
  auto [dx, dgamma, dbeta] = alloc_backward_outputs(input, s, weight, output_mask);
  if (input.numel() == 0 || (!output_mask[0] && !need_params)) return {dx, dgamma, dbeta};
  const Tensor x_in = dense_input(input);
  const Tensor mean_c = contig(mean), rstd_c = contig(rstd);
  const OptTensor w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  // grad_out in the input's layout. An NCHW-contiguous grad_out of a channels_last input (a loss or a
  // following op that made the gradient contiguous) is read in place by the NHWC two-pass kernels
  // (pw.dy_nchw) instead of being copied first, without an output activation (GroupNorm, the fused
  // conv op's prologue); the NHWC one-pass kernel and group_norm_act's backward still take the copy.
  // Tuning::dy_nchw = 0 always copies (measurements).
  const MemoryFormat fmt = group_norm_memory_format(x_in);
  const gn::Tuning& tun = gn::tuning();
  const bool dy_nchw_ok = fmt != MemoryFormat::Contiguous && pro.act == kActIdentity && grad_out.is_contiguous() &&
                          !is_dense_in(grad_out, fmt) && tun.dy_nchw != 0;
  Tensor dy_in = dy_nchw_ok ? grad_out : dense_in(grad_out, fmt);
  gn::Request req = request_of(x_in, pro);
  req.aligned = aligned16({x_in.data_ptr(), dy_in.data_ptr(), dx ? dx->data_ptr() : nullptr});
  req.flat = x_in.is_contiguous() && dy_in.is_contiguous();
  req.need_dx = output_mask[0];
  const Plan plan = gn::plan_backward(p, req, plan_device(), tun);
  const bool nhwc = plan.nhwc;
  const bool relayout = !nhwc && !x_in.is_contiguous();
  const Tensor x = relayout ? contig(x_in) : x_in;
  const Tensor dx_work = !dx ? Tensor() : relayout ? empty_as(x, MemoryFormat::Contiguous) : *dx;
  bool dy_nchw = nhwc && dy_nchw_ok;
  if (dy_nchw && plan.kernel == Kernel::kOnePass) {
    dy_in = dense_in(grad_out, fmt);
    dy_nchw = false;
  }
  const Tensor dy = relayout ? contig(grad_out) : dy_in;
  const ScalarKind t = scalar_kind(input.scalar_type());
  const OptTensor b = defined(pro.gn_bias) ? OptTensor(contig(*pro.gn_bias)) : std::nullopt;
  gn::PwArgs pw = pw_args(pro, Tensor(), ptr<float>(rstd_c), w, b);
  pw.dy_nchw = dy_nchw;
  const cudaStream_t stream = current_stream(x);
  float* dsum = nullptr;  // (N, C, 2): per-channel sums for dgamma/dbeta, in the scratch below
  const int64_t n_dsum = need_params ? s.N * s.C * 2 : 0;
  auto gamma_beta = [&] {
    if (need_params)
      GNEXT_CUDA_CHECK(gn::launch_gamma_beta_backward(scalar_kind(param_grad_dtype(input, weight)), p,
                                                    dsum, ptr<float>(rstd_c),
                                                    dgamma ? dgamma->data_ptr() : nullptr,
                                                    dbeta ? dbeta->data_ptr() : nullptr, stream));
  };
  // The persistent kernels (one-pass, wide) take the same arguments: n_partial floats of scratch for their
  // partials (then dsum), `counters`, and launch(args); dgamma/dbeta follow from dsum.
  auto run_persistent = [&](int64_t n_partial, const Counters& counters,
                            auto&& launch) -> std::tuple<OptTensor, OptTensor, OptTensor> {
    Scratch ws = scratch(x, scratch_floats({n_partial, n_dsum}), stream);
    OnePassArgs a{};
    a.x = x.data_ptr(), a.dy = dy.data_ptr(), a.out = dx_work.defined() ? dx_work.data_ptr() : nullptr;
    a.gamma = ptr_or_null(w);
    a.beta = ptr_or_null(b);
    a.wt = param_kind(w, b, ScalarType::Float);
    a.mean = ptr<float>(mean_c), a.rstd = ptr<float>(rstd_c);
    a.partial = ws.take(n_partial);
    dsum = a.dsum = ws.take(n_dsum);
    a.counters = counters.ptr, a.pw = pw;
    GNEXT_CUDA_CHECK(launch(a));
    gamma_beta();
    if (relayout) copy_into(*dx, dx_work);
    return {dx, dgamma, dbeta};
  };
  const OnePassGeometry& og = plan.onepass;
  switch (plan.kernel) {
    case Kernel::kSmall:
      return run_persistent(0, Counters{}, [&](const OnePassArgs& a) {
        return gn::launch_small_backward(t, p, plan.small, a, stream);
      });
    case Kernel::kOnePass:  // NCHW: partials per (n, c, piece); NHWC: per (tile, channel), then per (tile, group)
      return run_persistent(og.nhwc ? (s.N * s.C + s.N * s.G) * og.T * 2 : s.N * s.C * og.sub * 2,
                            onepass_counters(og, mean_c, stream),
                            [&](const OnePassArgs& a) { return gn::launch_onepass(true, t, p, og, a, stream); });
    case Kernel::kWide:  // partials: a float4 per (group, CTA)
      return run_persistent(s.N * s.G * plan.wide.grid * 4, zeroed_counters(mean_c, s.N * s.G, stream),
                            [&](const OnePassArgs& a) { return gn::launch_wide_backward(t, p, plan.wide, a, stream); });
    case Kernel::kBulk:  // partials: a float4 per (group, CTA)
      return run_persistent(s.N * s.G * plan.bulk.grid * 4, zeroed_counters(mean_c, s.N * s.G, stream),
                            [&](const OnePassArgs& a) { return gn::launch_bulk_backward(t, p, plan.bulk, a, stream); });
    case Kernel::kBulkNhwc:
    case Kernel::kWideNhwc:
    case Kernel::kTwoPass:
      break;
  }
  const gn::ReduceGeometry& rg = plan.reduce;
  const int64_t n_partial = s.N * s.C * rg.K * 2, n_coef = output_mask[0] ? s.N * s.C * 4 : 0;
  Scratch ws = scratch(x, scratch_floats({n_partial, n_dsum, n_coef}), stream);
  float* partial = ws.take(n_partial);
  dsum = ws.take(n_dsum);
  float* coef = ws.take(n_coef);
  GNEXT_CUDA_CHECK(gn::launch_reduce(true, t, p, rg, x.data_ptr(), dy.data_ptr(), ptr<float>(mean_c), partial, pw,
                                   stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_backward(param_kind(w, std::nullopt, ScalarType::Float), p,
                                              partial_layout(p, rg), partial, ptr<float>(mean_c), ptr<float>(rstd_c),
                                              ptr_or_null(w), dsum, coef, stream));
  gamma_beta();
  if (output_mask[0]) {
    GNEXT_CUDA_CHECK(gn::launch_affine(true, t, p, plan.affine, x.data_ptr(), dy.data_ptr(), dx_work.data_ptr(), coef, pw,
                                     stream));
    if (relayout) copy_into(*dx, dx_work);
  }
  return {dx, dgamma, dbeta};
}

}  // namespace

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cuda_pre(
    const char* op, const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd,
    const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask, const Pointwise& pro) {
  const Problem s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups);
  auto res = group_norm_backward_impl(op, s, grad_out, input, mean, rstd, weight, num_groups, output_mask, pro);
  // A group of one element normalizes to 0 whatever x is, so grad_input is exactly 0 (as eager's). The
  // kernels' rstd*gamma*dy + c3 leaves the rounding of two products instead (~1e-5 at rstd = 1/sqrt(eps)).
  if (auto& dx = std::get<0>(res); dx && s.D * s.HxW == 1 && input.numel() > 0) torch::stable::zero_(*dx);
  return res;
}

std::tuple<Tensor, Tensor> group_norm_stats_cuda(const Tensor& x_in, const Problem& s, const Tensor& shift,
                                                 double eps) {
  const Problem& p = s;
  Tensor mean = empty_on(x_in, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(x_in, {s.N, s.G}, ScalarType::Float);
  if (x_in.numel() == 0) {
    fill_empty_stats(mean, rstd);
    return {mean, rstd};
  }
  gn::Request req = request_of(x_in, Pointwise{});
  req.aligned = aligned16({x_in.data_ptr()});
  const Plan plan = gn::plan_stats(p, req, plan_device(), gn::tuning());
  const Tensor x = plan.nhwc || x_in.is_contiguous() ? x_in : contig(x_in);
  const gn::ReduceGeometry& rg = plan.reduce;
  Tensor partial = empty_on(x, {s.N * s.C * rg.K * 3}, ScalarType::Float);
  const cudaStream_t stream = current_stream(x);
  GNEXT_CUDA_CHECK(gn::launch_reduce(false, scalar_kind(x.scalar_type()), p, rg, x.data_ptr(), nullptr, nullptr,
                                   ptr<float>(partial), gn::PwArgs{}, stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_forward(ScalarKind::Float, p, partial_layout(p, rg), ptr<float>(partial),
                                             nullptr, nullptr, ptr<float>(mean), ptr<float>(rstd),
                                             /*coef=*/nullptr, static_cast<float>(eps),
                                             channel_shift(shift), stream));
  return {mean, rstd};
}

Tensor group_norm_grad_finalize_cuda(const Tensor& partial, int64_t K, const Problem& s, const Tensor& mean,
                                     const Tensor& rstd, const OptTensor& weight, const OptTensor& dgamma,
                                     const OptTensor& dbeta, bool want_coef) {
  const Problem& p = s;
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

// The two-pass GroupNorm split at its statistics: each pass an op of its own, the statistics (or the backward's
// group sums) supplied by the caller, who merges them across ranks in between (groupnorm_ext.distributed).
// Same kernels and geometry as the two-pass plan of group_norm_cuda_pre / group_norm_backward_impl.

Tensor group_norm_apply_cuda_pre(const char* op, const Tensor& input, const Tensor& mean, const Tensor& rstd,
                                 int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
                                 const Pointwise& pro) {
  const Problem s = check_group_norm_args(op, input, num_groups, weight, bias);
  check_stats_args(op, s, input, mean, rstd);
  check_pointwise(op, input, pro);
  DeviceGuard guard(input);
  const Tensor x_in = dense_input(input);
  Tensor out = empty_as(input, group_norm_memory_format(input));
  if (input.numel() == 0) return out;
  const OptTensor w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  const OptTensor b = defined(bias) ? OptTensor(contig(*bias)) : std::nullopt;
  const Tensor mean_c = contig(mean), rstd_c = contig(rstd);
  gn::Request req = request_of(x_in, pro);
  req.aligned = aligned16({x_in.data_ptr(), out.data_ptr(), defined(pro.residual) ? pro.residual->data_ptr() : nullptr});
  const Plan plan = gn::plan_two_pass(s, req, false, plan_device(), gn::tuning());
  const bool relayout = !plan.nhwc && !x_in.is_contiguous();
  const Tensor x = relayout ? contig(x_in) : x_in;
  const Tensor y = relayout ? empty_as(x, MemoryFormat::Contiguous) : out;
  const Tensor res = defined(pro.residual) ? dense_in(*pro.residual, suggest_format(x)) : Tensor();
  const gn::PwArgs pw = pw_args(pro, res, nullptr, w, b);
  const cudaStream_t stream = current_stream(x);
  Scratch ws = scratch(x, s.N * s.C * 4, stream);
  float* coef = ws.take(s.N * s.C * 4);
  GNEXT_CUDA_CHECK(gn::launch_coef(param_kind(w, b, ScalarType::Float), s, ptr<float>(mean_c), ptr<float>(rstd_c),
                                 ptr_or_null(w), ptr_or_null(b), nullptr, coef, stream));
  GNEXT_CUDA_CHECK(gn::launch_affine(false, scalar_kind(input.scalar_type()), s, plan.affine, x.data_ptr(), nullptr,
                                   y.data_ptr(), coef, pw, stream));
  if (relayout) copy_into(out, y);
  return out;
}

namespace {

// The statistics of the ops whose second pass walks NCHW rows (padded and modulated outputs): x (and weight/bias)
// contiguous, the two-pass reduction into mean/rstd and the rows' coefficients (st.coef), pw the output activation.
struct NchwStats {
  Tensor x, input_bias;  // input_bias: (C,) contiguous, or undefined
  OptTensor w, b;
  cudaStream_t stream;
  ScalarKind t;
  TwoPassStats st;
  gn::PwArgs pw;
};
// input_bias: the statistics are those of input + input_bias[c], input read as it is (the finalize shifts each
// channel's partial means, and the coefficients become x - (mean - b)).
NchwStats nchw_stats(const Problem& s, const Tensor& input, const OptTensor& weight, const OptTensor& bias,
                     const Tensor& mean, const Tensor& rstd, double eps, const Pointwise& pro,
                     const OptTensor& input_bias = {}) {
  NchwStats r;
  r.x = contig(input);
  if (defined(input_bias)) r.input_bias = contig(*input_bias);
  r.w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  r.b = defined(bias) ? OptTensor(contig(*bias)) : std::nullopt;
  gn::Request req = request_of(r.x, Pointwise{});
  req.aligned = aligned16({r.x.data_ptr()});
  const Plan plan = gn::plan_stats(s, req, plan_device(), gn::tuning());
  r.stream = current_stream(r.x);
  r.t = scalar_kind(input.scalar_type());
  r.st = two_pass_stats(r.t, s, plan.reduce, r.x, gn::PwArgs{}, r.w, r.b, mean, rstd, eps, r.stream,
                        channel_shift(r.input_bias));
  r.pw = pw_args(pro, Tensor(), nullptr, r.w, r.b);
  return r;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> group_norm_pad_cuda_pre(const char* op, const Tensor& input, int64_t num_groups,
                                                           const OptTensor& weight, const OptTensor& bias,
                                                           double eps, const Pointwise& pro,
                                                           const std::vector<int64_t>& pad, bool replicate,
                                                           double value, const OptTensor& input_bias) {
  const Problem s = check_group_norm_args(op, input, num_groups, weight, bias);
  check_input_bias(op, input, input_bias);
  check_pointwise(op, input, pro);
  GNEXT_CHECK(pro.kind == kPreNone && !defined(pro.residual), op, ": a padded output takes no prologue or residual");
  const std::vector<int64_t> sizes = check_pad_args(op, input, pad, replicate);
  DeviceGuard guard(input);
  Tensor out = empty_on(input, IntArrayRef(sizes.data(), sizes.size()), input.scalar_type());
  Tensor mean = empty_on(input, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(input, {s.N, s.G}, ScalarType::Float);
  if (input.numel() == 0) {
    fill_empty_stats(mean, rstd);
    if (out.numel() > 0) fill(out, value);
    return {out, mean, rstd};
  }
  // The statistics pass reads x in its own layout (NCHW or NHWC); the padded pass needs NCHW rows.
  const NchwStats ns = nchw_stats(s, input, weight, bias, mean, rstd, eps, pro, input_bias);
  // (NC, D, H, W) of x and out, the spatial dims right-aligned (a 4-D input has D = 1).
  const int64_t sd = input.dim() - 2;
  int64_t in[3] = {1, 1, 1}, op_[3] = {1, 1, 1};
  int lo[3] = {0, 0, 0};
  for (int64_t i = 0; i < sd; ++i) {
    in[3 - sd + i] = input.size(2 + i);
    op_[3 - sd + i] = sizes[2 + i];
  }
  for (size_t k = 0; k < pad.size() / 2; ++k) lo[2 - k] = static_cast<int>(pad[2 * k]);
  gn::PadShape ps{s.N * s.C, s.C, in[0], in[1], in[2], op_[0], op_[1], op_[2], lo[0], lo[1], lo[2]};
  const gn::PadPlan pp = gn::pad_plan(ps.W, input.element_size(), aligned16({ns.x.data_ptr()}), gn::tuning());
  GNEXT_CUDA_CHECK(gn::launch_affine_pad(ns.t, ps, ns.x.data_ptr(), out.data_ptr(), ns.st.coef, ns.pw, replicate,
                                       static_cast<float>(value), pp, plan_device().sms, ns.stream));
  return {out, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> group_norm_modulate_cuda_pre(const char* op, const Tensor& input,
                                                                int64_t num_groups, const OptTensor& weight,
                                                                const OptTensor& bias, double eps,
                                                                const Tensor& scale, const Tensor& shift,
                                                                const Pointwise& pro, const Tensor* into,
                                                                const OptTensor& input_bias) {
  const Problem s = check_group_norm_args(op, input, num_groups, weight, bias);
  check_input_bias(op, input, input_bias);
  check_pointwise(op, input, pro);
  GNEXT_CHECK(pro.kind == kPreNone && !defined(pro.residual), op, ": a modulated output takes no prologue or residual");
  const bool up = check_modulation(op, "scale", scale, input);
  GNEXT_CHECK(check_modulation(op, "shift", shift, input) == up && same_shape(scale.sizes(), shift.sizes()), op,
              ": shift.shape=", shape(shift), " must equal scale.shape=", shape(scale));
  if (into != nullptr) check_rows_out(op, *into, input);
  DeviceGuard guard(input);
  Tensor out = into != nullptr ? *into : empty_on(input, input.sizes(), input.scalar_type());
  Tensor mean = empty_on(input, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(input, {s.N, s.G}, ScalarType::Float);
  if (input.numel() == 0) {
    fill_empty_stats(mean, rstd);
    return {out, mean, rstd};
  }
  // The pass walks NCHW rows: x, scale and shift contiguous (copied where they are not); out's rows at its strides.
  const NchwStats ns = nchw_stats(s, input, weight, bias, mean, rstd, eps, pro, input_bias);
  const Tensor sc = contig(scale), sh = contig(shift);
  const gn::OutRows o{s.C, out.stride(0), out.stride(1)};
  const int64_t es = static_cast<int64_t>(out.element_size());
  const bool rows16 = (o.sn * es) % 16 == 0 && (o.sc * es) % 16 == 0;  // every row starts 16-byte aligned
  if (up) {  // (D, H, W) of x against (D, h, w) of scale and shift; a 4-D input has D = 1
    const int64_t d = input.dim();
    gn::ModShape m{s.N * s.C, d == 5 ? input.size(2) : 1, input.size(d - 2), input.size(d - 1), scale.size(d - 2),
                   scale.size(d - 1), 0.f, 0.f};
    // F.interpolate's nearest source scale: (float)input_size / output_size
    m.sh = static_cast<float>(m.h) / static_cast<float>(m.H);
    m.sw = static_cast<float>(m.w) / static_cast<float>(m.W);
    GNEXT_CUDA_CHECK(gn::launch_affine_modulate_up(ns.t, m, ns.x.data_ptr(), sc.data_ptr(), sh.data_ptr(),
                                                   out.data_ptr(), o,
                                                   rows16 && aligned16({ns.x.data_ptr(), out.data_ptr()}), ns.st.coef,
                                                   ns.pw, plan_device().sms, ns.stream));
    return {out, mean, rstd};
  }
  const bool aligned = rows16 && aligned16({ns.x.data_ptr(), sc.data_ptr(), sh.data_ptr(), out.data_ptr()});
  GNEXT_CUDA_CHECK(gn::launch_affine_modulate(ns.t, s.N * s.C, s.HxW, ns.x.data_ptr(), sc.data_ptr(), sh.data_ptr(),
                                              out.data_ptr(), o, aligned, ns.st.coef, ns.pw, plan_device().sms,
                                              ns.stream));
  return {out, mean, rstd};
}

namespace {

// The checks of a split backward pass (arguments, activation, GroupNorm bias); returns the problem sizes.
Problem check_split_backward(const char* op, const Tensor& grad_out, const Tensor& input, const Tensor& mean,
                             const Tensor& rstd, const OptTensor& weight, int64_t num_groups, const Pointwise& pro) {
  const Problem s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups);
  check_pointwise(op, input, pro);
  if (defined(pro.gn_bias)) check_group_norm_args(op, input, num_groups, weight, pro.gn_bias);
  return s;
}

// x and dy of a split backward in the layout its plan reads (the same for the sums and the apply pass);
// relayout: the plan is NCHW and x was made contiguous, so dx is computed contiguous and copied.
struct SplitBackward {
  Plan plan;
  bool relayout;
  Tensor x, dy;
  OptTensor w, b;
  Tensor mean, rstd;
  gn::PwArgs pw;
};

SplitBackward split_backward(const Problem& s, const Tensor& grad_out, const Tensor& input, const Tensor& mean,
                             const Tensor& rstd, const OptTensor& weight, const Pointwise& pro, const void* dx) {
  SplitBackward r;
  const Tensor x_in = dense_input(input);
  const Tensor dy_in = dense_in(grad_out, group_norm_memory_format(x_in));
  gn::Request req = request_of(x_in, pro);
  req.aligned = aligned16({x_in.data_ptr(), dy_in.data_ptr(), dx});
  req.flat = x_in.is_contiguous() && dy_in.is_contiguous();
  req.need_dx = dx != nullptr;
  r.plan = gn::plan_two_pass(s, req, true, plan_device(), gn::tuning());
  r.relayout = !r.plan.nhwc && !x_in.is_contiguous();
  r.x = r.relayout ? contig(x_in) : x_in;
  r.dy = r.relayout ? contig(grad_out) : dy_in;
  r.w = defined(weight) ? OptTensor(contig(*weight)) : std::nullopt;
  r.b = defined(pro.gn_bias) ? OptTensor(contig(*pro.gn_bias)) : std::nullopt;
  r.mean = contig(mean), r.rstd = contig(rstd);
  r.pw = pw_args(pro, Tensor(), ptr<float>(r.rstd), r.w, r.b);
  return r;
}

}  // namespace

Tensor group_norm_backward_sums_cuda_pre(const char* op, const Tensor& grad_out, const Tensor& input,
                                         const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                                         int64_t num_groups, const Pointwise& pro) {
  const Problem s = check_split_backward(op, grad_out, input, mean, rstd, weight, num_groups, pro);
  DeviceGuard guard(input);
  if (input.numel() == 0) return zeros_on(input, {s.N, s.C, 2}, ScalarType::Float);
  const SplitBackward b = split_backward(s, grad_out, input, mean, rstd, weight, pro, nullptr);
  Tensor dsum = empty_on(input, {s.N, s.C, 2}, ScalarType::Float);
  const gn::ReduceGeometry& rg = b.plan.reduce;
  const cudaStream_t stream = current_stream(b.x);
  Scratch ws = scratch(b.x, s.N * s.C * rg.K * 2, stream);
  float* partial = ws.take(s.N * s.C * rg.K * 2);
  GNEXT_CUDA_CHECK(gn::launch_reduce(true, scalar_kind(input.scalar_type()), s, rg, b.x.data_ptr(), b.dy.data_ptr(),
                                   ptr<float>(b.mean), partial, b.pw, stream));
  GNEXT_CUDA_CHECK(gn::launch_finalize_backward(param_kind(b.w, std::nullopt, ScalarType::Float), s,
                                              partial_layout(s, rg), partial, ptr<float>(b.mean), ptr<float>(b.rstd),
                                              ptr_or_null(b.w), ptr<float>(dsum), /*coef=*/nullptr, stream));
  return dsum;
}

Tensor group_norm_backward_apply_cuda_pre(const char* op, const Tensor& grad_out, const Tensor& input,
                                          const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                                          const Tensor& group_sums, int64_t num_groups, const Pointwise& pro) {
  const Problem s = check_split_backward(op, grad_out, input, mean, rstd, weight, num_groups, pro);
  GNEXT_CHECK(group_sums.scalar_type() == ScalarType::Float && group_sums.numel() == s.N * s.G * 2, op,
              ": group_sums must be float32 with N*G*2=", s.N * s.G * 2, " elements, got ", group_sums.scalar_type(),
              " of shape ", shape(group_sums));
  GNEXT_CHECK(same_device(group_sums, input), op, ": group_sums is on ", device_name(group_sums),
              " but input is on ", device_name(input));
  DeviceGuard guard(input);
  Tensor dx = empty_as(input, group_norm_memory_format(input));
  if (input.numel() == 0) return dx;
  const SplitBackward b = split_backward(s, grad_out, input, mean, rstd, weight, pro, dx.data_ptr());
  const Tensor dx_work = b.relayout ? empty_as(b.x, MemoryFormat::Contiguous) : dx;
  const Tensor gs = contig(group_sums);
  const cudaStream_t stream = current_stream(b.x);
  Scratch ws = scratch(b.x, s.N * s.C * 4, stream);
  float* coef = ws.take(s.N * s.C * 4);
  GNEXT_CUDA_CHECK(gn::launch_coef(param_kind(b.w, std::nullopt, ScalarType::Float), s, ptr<float>(b.mean),
                                 ptr<float>(b.rstd), ptr_or_null(b.w), nullptr, ptr<float>(gs), coef, stream));
  GNEXT_CUDA_CHECK(gn::launch_affine(true, scalar_kind(input.scalar_type()), s, b.plan.affine, b.x.data_ptr(),
                                   b.dy.data_ptr(), dx_work.data_ptr(), coef, b.pw, stream));
  if (b.relayout) copy_into(dx, dx_work);
  return dx;
}

Tensor group_norm_moments_cuda(const Tensor& input, int64_t num_groups) {
  const Problem s = check_group_norm_args("gnext.group_norm_moments", input, num_groups, std::nullopt, std::nullopt);
  DeviceGuard guard(input);
  Tensor out = empty_on(input, {3, s.N, s.G}, ScalarType::Double);
  if (input.numel() == 0) {
    fill(out, 0.0);
    return out;
  }
  const auto [mean, rstd] = group_norm_stats_cuda(dense_input(input), s, Tensor(), 0.0);
  GNEXT_CUDA_CHECK(gn::launch_pack_moments(ptr<float>(mean), ptr<float>(rstd), s.D * s.HxW, ptr<double>(out),
                                         s.N * s.G, current_stream(input)));
  return out;
}

std::tuple<Tensor, Tensor, Tensor> group_norm_moments_merge_cuda(const Tensor& moments, double eps) {
  constexpr const char* op = "gnext.group_norm_moments_merge";
  GNEXT_CHECK(moments.dim() == 4 && moments.size(1) == 3 && moments.scalar_type() == ScalarType::Double, op,
              ": moments must be (world, 3, N, G) float64, got shape ", shape(moments), " ", moments.scalar_type());
  DeviceGuard guard(moments);
  const Tensor m = contig(moments);
  const int64_t N = m.size(2), G = m.size(3);
  Tensor mean = empty_on(m, {N, G}, ScalarType::Float);
  Tensor rstd = empty_on(m, {N, G}, ScalarType::Float);
  Tensor count = empty_on(m, {N, G}, ScalarType::Double);
  GNEXT_CUDA_CHECK(gn::launch_merge_moments(ptr<double>(m), m.size(0), N * G, static_cast<float>(eps), ptr<float>(mean),
                                          ptr<float>(rstd), ptr<double>(count), current_stream(m)));
  return {mean, rstd, count};
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
  for (const char* suffix : {"", "_no_autograd"}) {  // each with its twin of no Autograd kernel (csrc/gnext.cpp)
    const std::string s = suffix;
    m.impl(("group_norm" + s).c_str(), TORCH_BOX(&group_norm_cuda));
    m.impl(("group_norm_backward" + s).c_str(), TORCH_BOX(&group_norm_backward_cuda));
  }
  m.impl("group_norm_moments", TORCH_BOX(&group_norm_moments_cuda));
  m.impl("group_norm_moments_merge", TORCH_BOX(&group_norm_moments_merge_cuda));
}

}  // namespace gnext
