// SPDX-License-Identifier: BSD-3-Clause
// CUDA implementation of group_norm_act_logsumexp: GroupNorm statistics of v = input + input_bias from
// gnext's GroupNorm reduction, then one pixel-walking kernel (group_norm_act_lse_kernels.cu) that normalizes,
// activates, adds the residual and reduces logsumexp over the channels: the (N, C, *) result of the
// activation is never written. Backward: two passes of the same kernel (per-channel gradient sums,
// then grad_input) around gnext's GroupNorm backward finalize.
#include <algorithm>
#include <limits>

#include "../common/cuda_utils.h"
#include "group_norm_act.h"
#include "group_norm_act_lse_launch.h"

namespace gnext {
namespace {

using lse::LseArgs;

Tensor float_or_undef(const OptTensor& t) {
  return defined(t) ? contig(to_dtype(*t, ScalarType::Float)) : Tensor();
}
const float* fptr(const Tensor& t) { return t.defined() ? ptr<float>(t) : nullptr; }

// Layout, vector width and launch geometry for x (dense: contiguous or channels_last).
LseArgs make_args(const char* op, int phase, const Tensor& x, const Problem& s, int act, bool residual,
                  std::initializer_list<const void*> ptrs) {
  LseArgs a{};
  a.N = s.N, a.C = s.C, a.G = s.G, a.HxW = s.HxW, a.act = act, a.residual = residual;
  a.t = scalar_kind(x.scalar_type());
  const bool channels_inner = !x.is_contiguous() || s.HxW == 1;
  a.sC = channels_inner ? 1 : s.HxW;
  a.sP = channels_inner ? s.C : 1;
  const bool lanes = channels_inner && s.C % lse::kLanesCpt == 0 && s.C <= 32 * lse::kLanesCpt && aligned16(ptrs);
  a.tpp = 0;
  if (lanes) {
    a.tpp = 1;
    while (a.tpp * lse::kLanesCpt < s.C) a.tpp *= 2;
  }
  const DeviceProps* prop = &device_props();
  a.threads = lse::kLseThreads;
  while (a.threads > 32 && lse::lse_smem_bytes(phase, s.C, a.threads, a.tpp) > prop->sharedMemPerBlockOptin)
    a.threads /= 2;
  a.smem = lse::lse_smem_bytes(phase, s.C, a.threads, a.tpp);
  GNEXT_CHECK(a.smem <= prop->sharedMemPerBlockOptin, op, ": C=", s.C,
              " channels need more shared memory per block (", a.smem, " bytes) than this GPU has (",
              prop->sharedMemPerBlockOptin, ")");
  // About 8 CTAs per SM in all, each a whole number of sweeps of `step` pixels.
  const int64_t step = a.tpp > 0 ? a.threads / a.tpp : a.threads;
  const int64_t target = 8 * static_cast<int64_t>(prop->multiProcessorCount);
  const int64_t sweeps = (s.HxW + step - 1) / step;
  const int64_t K = std::clamp<int64_t>((target + s.N - 1) / s.N, 1, sweeps);
  a.chunk = (sweeps + K - 1) / K * step;
  a.K = (s.HxW + a.chunk - 1) / a.chunk;
  return a;
}

std::tuple<Tensor, Tensor, Tensor> lse_cuda(const Tensor& input, const OptTensor& input_bias, int64_t num_groups,
                                            const OptTensor& weight, const OptTensor& bias, double eps,
                                            const std::string& activation, bool residual) {
  constexpr const char* op = "gnext.group_norm_act_logsumexp";
  const Problem s = check_lse_args(op, input, input_bias, num_groups, weight, bias);
  const int act = parse_activation(op, activation);
  DeviceGuard guard(input);
  Tensor out = empty_on(input, lse_out_shape(input), input.scalar_type());
  const Tensor x = dense_input(input);
  const Tensor shift = float_or_undef(input_bias);
  auto [mean, rstd] = group_norm_stats_cuda(x, s, shift, eps);
  if (out.numel() == 0) return {out, mean, rstd};
  if (input.numel() == 0) {  // C == 0: logsumexp over no channels
    fill(out, -std::numeric_limits<double>::infinity());
    return {out, mean, rstd};
  }
  const Tensor gamma = float_or_undef(weight), beta = float_or_undef(bias);
  LseArgs a = make_args(op, lse::kLseForward, x, s, act, residual, {x.data_ptr()});
  a.x = x.data_ptr(), a.shift = fptr(shift), a.mean = ptr<float>(mean), a.rstd = ptr<float>(rstd);
  a.gamma = fptr(gamma), a.beta = fptr(beta), a.out = out.data_ptr();
  GNEXT_CUDA_CHECK(lse::launch_lse(lse::kLseForward, a, current_stream(x)));
  return {out, mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor> lse_backward_cuda(
    const Tensor& grad_out, const Tensor& out, const Tensor& input, const OptTensor& input_bias, const Tensor& mean,
    const Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    const std::string& activation, bool residual, const std::vector<bool>& output_mask) {
  constexpr const char* op = "gnext.group_norm_act_logsumexp_backward";
  const std::array<bool, 4> mask = mask_array<4>(op, output_mask);
  const Problem s = check_lse_args(op, input, input_bias, num_groups, weight, bias);
  check_lse_backward_args(op, s, input, grad_out, out, mean, rstd);
  const int act = parse_activation(op, activation);
  GNEXT_CHECK(!mask[1] || defined(input_bias), op, ": grad of input_bias requested without input_bias");
  DeviceGuard guard(input);
  const ScalarType pt = param_grad_dtype(input, weight);
  const bool empty = input.numel() == 0;
  const int64_t C = s.C;
  auto param = [&](bool wanted, ScalarType t) -> OptTensor {
    if (!wanted) return std::nullopt;
    return empty ? zeros_on(input, {C}, t) : empty_on(input, {C}, t);
  };
  OptTensor dx, dib = param(mask[1], defined(input_bias) ? input_bias->scalar_type() : pt);
  OptTensor dw = param(mask[2], pt), db = param(mask[3], pt);
  if (mask[0]) dx = empty_as(input, group_norm_memory_format(input));
  if (empty || !(mask[0] || mask[1] || mask[2] || mask[3])) return {dx, dib, dw, db};
  const Tensor x = dense_input(input);
  const Tensor gout = contig(grad_out), lse_out = contig(out);
  const Tensor mean_c = contig(mean), rstd_c = contig(rstd);
  const Tensor shift = float_or_undef(input_bias), gamma = float_or_undef(weight), beta = float_or_undef(bias);
  const cudaStream_t stream = current_stream(x);
  // Pass 1: per-channel sums (sum dy*(v - mean), sum dy) of dy = dL/dGroupNorm(v).
  LseArgs a = make_args(op, lse::kLseGradStats, x, s, act, residual, {x.data_ptr()});
  a.x = x.data_ptr(), a.shift = fptr(shift), a.mean = ptr<float>(mean_c), a.rstd = ptr<float>(rstd_c);
  a.gamma = fptr(gamma), a.beta = fptr(beta), a.out = const_cast<void*>(lse_out.data_ptr()), a.grad = gout.data_ptr();
  Tensor partial = empty_on(x, {s.N * a.K * s.C * 2}, ScalarType::Float);
  a.partial = ptr<float>(partial);
  GNEXT_CUDA_CHECK(lse::launch_lse(lse::kLseGradStats, a, stream));
  const bool want_dv = mask[0] || mask[1];
  const Tensor coef =
      group_norm_grad_finalize_cuda(partial, a.K, s, mean_c, rstd_c, weight, dw, db, /*want_coef=*/want_dv);
  if (!want_dv) return {dx, dib, dw, db};
  // Pass 2: grad of v (= grad input), and its per-channel sums for grad input_bias.
  // dx has x's layout (dense_input and group_norm_memory_format follow the same rule).
  const Tensor dv_out = mask[0] ? *dx : empty_as(x, suggest_format(x));
  LseArgs b = make_args(op, lse::kLseGradInput, x, s, act, residual, {x.data_ptr(), dv_out.data_ptr()});
  b.x = a.x, b.shift = a.shift, b.mean = a.mean, b.rstd = a.rstd, b.gamma = a.gamma, b.beta = a.beta, b.out = a.out;
  b.grad = a.grad, b.coef = reinterpret_cast<const float4*>(ptr<float>(coef)), b.dx = dv_out.data_ptr();
  Tensor bias_partial = mask[1] ? empty_on(x, {s.N * b.K, s.C}, ScalarType::Float) : Tensor();
  b.partial = mask[1] ? ptr<float>(bias_partial) : nullptr;
  GNEXT_CUDA_CHECK(lse::launch_lse(lse::kLseGradInput, b, stream));
  if (mask[1]) copy_into(*dib, torch::stable::sum(bias_partial, std::vector<int64_t>{0}));
  return {dx, dib, dw, db};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("group_norm_act_logsumexp", TORCH_BOX(&lse_cuda));
  m.impl("group_norm_act_logsumexp_backward", TORCH_BOX(&lse_backward_cuda));
}

}  // namespace gnext
