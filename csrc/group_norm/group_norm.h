// SPDX-License-Identifier: BSD-3-Clause
// Argument checks and layout rules of the GroupNorm ops' CUDA implementations (stable ABI, see
// common/stable.h). The CPU implementations (groupnorm_ext/_cpu.py) raise the same messages.
#pragma once
#include <array>
#include <limits>
#include <string_view>
#include <tuple>
#include <vector>

#include "../common/pointwise.h"
#include "../common/stable.h"
#include "group_norm_launch.h"

namespace gnext {

// Sizes of a GroupNorm problem (group_norm_launch.h), the one struct the checks, the planner and the kernels share.
using gn::Problem;

inline bool is_supported_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

// Checks input/num_groups/weight/bias and returns the problem sizes. `op` names the caller in messages.
inline Problem check_group_norm_args(const char* op, const Tensor& input, int64_t num_groups,
                                     const OptTensor& weight, const OptTensor& bias) {
  GNEXT_CHECK(input.dim() >= 2, op, ": input must have shape (N, C, *) with at least 2 dims, got input.dim()=",
              input.dim(), " (shape ", shape(input), ")");
  GNEXT_CHECK(is_supported_dtype(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  GNEXT_CHECK(num_groups > 0, op, ": num_groups must be positive, got num_groups=", num_groups);
  const int64_t N = input.size(0), C = input.size(1);
  GNEXT_CHECK(C % num_groups == 0, op, ": num_channels C=", C, " must be divisible by num_groups=",
              num_groups, " (input shape ", shape(input), ")");
  const std::pair<const OptTensor*, const char*> params[] = {{&weight, "weight"}, {&bias, "bias"}};
  for (const auto& [p, name] : params) {
    if (!defined(*p)) continue;
    const Tensor& t = **p;
    GNEXT_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must have shape (C,) = (", C, "), got ",
                name, ".shape=", shape(t));
    GNEXT_CHECK(same_device(t, input), op, ": ", name, " is on ", device_name(t), " but input is on ",
                device_name(input));
    GNEXT_CHECK(t.scalar_type() == input.scalar_type() || t.scalar_type() == ScalarType::Float, op, ": ", name,
                " dtype must match input (", input.scalar_type(), ") or be float32, got ", t.scalar_type());
  }
  if (defined(weight) && defined(bias)) {
    GNEXT_CHECK(weight->scalar_type() == bias->scalar_type(), op, ": weight (", weight->scalar_type(),
                ") and bias (", bias->scalar_type(), ") must have the same dtype");
  }
  int64_t HxW = 1;
  for (int64_t d = 2; d < input.dim(); ++d) HxW *= input.size(d);
  return {N, C, num_groups, C / num_groups, HxW};
}

// Memory layout a kernel works on. The output keeps the input's memory format:
// NCHW-contiguous in -> contiguous out; channels_last(_3d) in -> channels_last(_3d) out;
// any other strides are first made contiguous. (The fake kernel in _ops.py follows the same rule.)
inline MemoryFormat group_norm_memory_format(const Tensor& input) { return suggest_format(input); }

// Returns `input` with dense strides in group_norm_memory_format(input) (a copy only for other strides).
inline Tensor dense_input(const Tensor& input) { return dense_in(input, group_norm_memory_format(input)); }

// Dtype of grad_weight / grad_bias: the weight's, else the input's.
inline ScalarType param_grad_dtype(const Tensor& input, const OptTensor& weight) {
  return defined(weight) ? weight->scalar_type() : input.scalar_type();
}

// mean / rstd: float32 with N*G elements on input's device.
inline void check_stats_args(const char* op, const Problem& s, const Tensor& input, const Tensor& mean,
                             const Tensor& rstd) {
  const std::pair<const Tensor*, const char*> stats[] = {{&mean, "mean"}, {&rstd, "rstd"}};
  for (const auto& [t, name] : stats) {
    GNEXT_CHECK(t->scalar_type() == ScalarType::Float, op, ": ", name, " must be float32, got ", t->scalar_type());
    GNEXT_CHECK(t->numel() == s.N * s.G, op, ": ", name, " must have N*G=", s.N * s.G, " elements, got shape ",
                shape(*t));
    GNEXT_CHECK(same_device(*t, input), op, ": ", name, " is on ", device_name(*t), " but input is on ",
                device_name(input));
  }
}

// Checks every argument of the backward op and returns the problem sizes.
inline Problem check_group_norm_backward_args(const char* op, const Tensor& grad_out, const Tensor& input,
                                              const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                                              int64_t num_groups) {
  const Problem s = check_group_norm_args(op, input, num_groups, weight, std::nullopt);
  GNEXT_CHECK(same_shape(grad_out.sizes(), input.sizes()), op, ": grad_out.shape=", shape(grad_out),
              " must equal input.shape=", shape(input));
  GNEXT_CHECK(grad_out.scalar_type() == input.scalar_type(), op, ": grad_out dtype (", grad_out.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  GNEXT_CHECK(same_device(grad_out, input), op, ": grad_out is on ", device_name(grad_out), " but input is on ",
              device_name(input));
  check_stats_args(op, s, input, mean, rstd);
  return s;
}

// pad as F.pad takes it (2 values, before and after, per padded spatial dim, the last dim first; non-negative) for
// an input of 1 to 3 spatial dims; replicate padding needs the padded dims non-empty. Returns the output's sizes.
inline std::vector<int64_t> check_pad_args(const char* op, const Tensor& input, const std::vector<int64_t>& pad,
                                           bool replicate) {
  const int64_t sd = input.dim() - 2;
  GNEXT_CHECK(sd >= 1 && sd <= 3, op, ": a padded output needs input of shape (N, C, *) with 1 to 3 spatial dims, ",
              "got input.shape=", shape(input));
  const int64_t n_pad = static_cast<int64_t>(pad.size());
  GNEXT_CHECK(n_pad > 0 && n_pad % 2 == 0 && n_pad <= 2 * sd, op, ": pad must hold 2 values (before, after) per ",
              "padded spatial dim, the last dim first, at most ", 2 * sd, " for input.shape=", shape(input),
              ", got pad=", Shape{pad});
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
  for (int64_t k = 0; k < n_pad / 2; ++k) {
    GNEXT_CHECK(pad[2 * k] >= 0 && pad[2 * k + 1] >= 0 && pad[2 * k] < (1 << 20) && pad[2 * k + 1] < (1 << 20), op,
                ": pad values must be in [0, 2^20), got pad=", Shape{pad});
    int64_t& n = sizes[input.dim() - 1 - k];
    GNEXT_CHECK(!replicate || n > 0, op, ": replicate padding needs the padded dims non-empty, got input.shape=",
                shape(input), " and pad=", Shape{pad});
    n += pad[2 * k] + pad[2 * k + 1];
  }
  const int64_t plane = sizes[input.dim() - 1] * (sd >= 2 ? sizes[input.dim() - 2] : 1);
  GNEXT_CHECK(plane < (int64_t{1} << 31), op, ": the padded output's last two dims must hold fewer than 2^31 ",
              "elements, got output shape ", Shape{sizes});
  return sizes;
}

// Forward statistics of an input with no elements: undefined, NaN.
inline void fill_empty_stats(Tensor& mean, Tensor& rstd) {
  fill(mean, std::numeric_limits<double>::quiet_NaN());
  fill(rstd, std::numeric_limits<double>::quiet_NaN());
}

// Backward outputs selected by output_mask, allocated: dx in the input's memory format,
// grad_weight / grad_bias (C,) of param_grad_dtype. For an input with no elements the parameter
// gradients are zeros.
inline std::tuple<OptTensor, OptTensor, OptTensor> alloc_backward_outputs(const Tensor& input, const Problem& s,
                                                                           const OptTensor& weight,
                                                                           std::array<bool, 3> output_mask) {
  const ScalarType pt = param_grad_dtype(input, weight);
  const int64_t C = s.C;
  auto param = [&](bool wanted) -> OptTensor {
    if (!wanted) return std::nullopt;
    return input.numel() == 0 ? zeros_on(input, {C}, pt) : empty_on(input, {C}, pt);
  };
  OptTensor dx;
  if (output_mask[0]) dx = empty_as(input, group_norm_memory_format(input));
  return {dx, param(output_mask[1]), param(output_mask[2])};
}

// Pointwise extensions of the GroupNorm kernels (common/pointwise.h), at most one of:
//  * input prologue (kind != kPreNone): normalize a = act(x + bias[c]) instead of x; the backward's
//    grad_input is then d/dx = dL/da * act'(x + bias). Used by the fused ConvTranspose2d+GELU+GroupNorm op.
//  * output epilogue (act != kActIdentity, or a residual): out = act(GroupNorm(x)) + residual; the
//    backward takes dL/dout and returns the gradients of x, gamma, beta (the residual's is dL/dout).
// An input shift (forward, with the epilogue or none, not with a prologue) goes with either: GroupNorm of
// x + input_bias[c], read as x is (the bias of the convolution that wrote x, run without it).
struct Pointwise {
  int kind = kPreNone;
  OptTensor bias;
  int act = kActIdentity;
  OptTensor residual;  // forward only
  OptTensor input_bias;  // forward only: (C,) of x's dtype or float32, or none
  OptTensor gn_bias;   // backward with an activation: GroupNorm's beta, to recompute act's input
};

// t must have input's dtype and device.
inline void check_dtype_device_like_input(const char* op, const char* name, const Tensor& t, const Tensor& input) {
  GNEXT_CHECK(t.scalar_type() == input.scalar_type(), op, ": ", name, " dtype (", t.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  GNEXT_CHECK(same_device(t, input), op, ": ", name, " is on ", device_name(t), " but input is on ",
              device_name(input));
}

// t (the residual, a modulation's scale or shift) must have input's shape, dtype and device.
inline void check_like_input(const char* op, const char* name, const Tensor& t, const Tensor& input) {
  GNEXT_CHECK(same_shape(t.sizes(), input.sizes()), op, ": ", name, ".shape=", shape(t), " must equal input.shape=",
              shape(input));
  check_dtype_device_like_input(op, name, t, input);
}

// input_bias (a per-channel bias that input does not hold yet: group_norm_act_logsumexp's, the modulated norm's):
// None, or (C,) of input's dtype or float32 on input's device.
inline void check_input_bias(const char* op, const Tensor& input, const OptTensor& input_bias) {
  if (!defined(input_bias)) return;
  const Tensor& b = *input_bias;
  GNEXT_CHECK(b.dim() == 1 && b.size(0) == input.size(1), op, ": input_bias must have shape (C,) = (", input.size(1),
              "), got input_bias.shape=", shape(b));
  GNEXT_CHECK(same_device(b, input), op, ": input_bias is on ", device_name(b), " but input is on ",
              device_name(input));
  GNEXT_CHECK(b.scalar_type() == input.scalar_type() || b.scalar_type() == ScalarType::Float, op,
              ": input_bias dtype must match input (", input.scalar_type(), ") or be float32, got ", b.scalar_type());
}

// A modulation's scale or shift: input's dtype and device, and input's shape, or (4-D and 5-D inputs) input's shape
// with smaller last two sizes (h, w), at least 1 each, read by nearest-neighbour upsampling. Returns whether it is
// the smaller one. The plane D * H * W of such an input must fit 31 bits (the pass's 32-bit indexing).
inline bool check_modulation(const char* op, const char* name, const Tensor& t, const Tensor& input) {
  const int64_t d = input.dim();
  bool up = false, ok = t.dim() == d;
  for (int64_t i = 0; ok && i < d; ++i) {
    if (t.size(i) == input.size(i)) continue;
    up = true;
    ok = (d == 4 || d == 5) && i >= d - 2 && t.size(i) >= 1 && t.size(i) < input.size(i);
  }
  GNEXT_CHECK(ok, op, ": ", name, ".shape=", shape(t), " must equal input.shape=", shape(input),
              " or, for a 4-D or 5-D input, differ only in smaller last two sizes (nearest upsampling)");
  int64_t plane = 1;
  for (int64_t i = 2; i < d; ++i) plane *= input.size(i);
  GNEXT_CHECK(!up || plane < (int64_t{1} << 31) - 4096, op, ": ", name,
              " smaller than input needs input's per-channel plane below 2^31 elements, got ", shape(input));
  check_dtype_device_like_input(op, name, t, input);
  return up;
}

// The output of group_norm_act_modulate_into: input's shape, dtype and device, each (n, c) plane contiguous (dims 2..
// packed) and no two planes overlapping (e.g. a slice along dim 2 of a contiguous buffer).
inline void check_rows_out(const char* op, const Tensor& out, const Tensor& input) {
  check_like_input(op, "out", out, input);
  int64_t plane = 1;
  bool packed = true;
  for (int64_t i = out.dim() - 1; i >= 2; --i) {
    packed = packed && (out.size(i) == 1 || out.stride(i) == plane);
    plane *= out.size(i);
  }
  const int64_t N = out.size(0), C = out.size(1);
  std::vector<int64_t> strides;
  for (int64_t i = 0; i < out.dim(); ++i) strides.push_back(out.stride(i));
  const bool apart = (C <= 1 || out.stride(1) >= plane) && (N <= 1 || out.stride(0) >= (C - 1) * out.stride(1) + plane);
  GNEXT_CHECK(out.numel() == 0 || (packed && apart), op, ": out must have each (n, c) plane contiguous and the planes "
              "apart (e.g. a slice along dim 2 of a contiguous tensor); got shape ", shape(out), " and strides ",
              Shape{strides});
}

inline void check_pointwise(const char* op, const Tensor& input, const Pointwise& pro) {
  GNEXT_CHECK(pro.kind >= kPreNone && pro.kind <= kPreBiasGeluTanh, op, ": unknown prologue kind ", pro.kind);
  GNEXT_CHECK(pro.act >= kActIdentity && pro.act < kActCount, op, ": unknown activation kind ", pro.act);
  GNEXT_CHECK(pro.kind == kPreNone || (pro.act == kActIdentity && !defined(pro.residual)), op,
              ": a prologue and an epilogue cannot be combined");
  if (defined(pro.residual)) check_like_input(op, "residual", *pro.residual, input);
  GNEXT_CHECK(pro.kind == kPreNone || !defined(pro.input_bias), op, ": a prologue takes no input_bias");
  check_input_bias(op, input, pro.input_bias);
  if (!defined(pro.bias)) return;
  const Tensor& b = *pro.bias;
  GNEXT_CHECK(b.dim() == 1 && b.size(0) == input.size(1) && b.is_contiguous(), op,
              ": conv_bias must be a contiguous (C,) = (", input.size(1), ") tensor, got shape ", shape(b));
  GNEXT_CHECK(same_device(b, input), op, ": conv_bias is on ", device_name(b), " but input is on ",
              device_name(input));
  GNEXT_CHECK(b.scalar_type() == input.scalar_type() || b.scalar_type() == ScalarType::Float, op,
              ": conv_bias dtype must match input (", input.scalar_type(), ") or be float32, got ", b.scalar_type());
}

// A schema bool[K] argument (output_mask) as an array; raises unless it has K elements.
template <size_t K>
std::array<bool, K> mask_array(const char* op, const std::vector<bool>& m) {
  GNEXT_CHECK(m.size() == K, op, ": output_mask must have ", K, " elements, got ", m.size());
  std::array<bool, K> a{};
  for (size_t i = 0; i < K; ++i) a[i] = m[i];
  return a;
}

// Kernel element type of a dtype (float32, float16, bfloat16); raises for any other.
gn::ScalarKind scalar_kind(ScalarType t);

// CUDA GroupNorm with a prologue (group_norm_cuda.cpp); `op` names the caller in messages. out_nchw: the output
// NCHW-contiguous whatever the input's layout (no residual), else in the input's layout.
std::tuple<Tensor, Tensor, Tensor> group_norm_cuda_pre(const char* op, const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps,
                                                       const Pointwise& pro, bool out_nchw = false);
// The same with the output padded as F.pad(out, pad, mode) does (replicate, or constant `value`), in one pass
// after the statistics, of input + input_bias[c] where given; contiguous output, no prologue or residual
// (group_norm_cuda.cpp).
std::tuple<Tensor, Tensor, Tensor> group_norm_pad_cuda_pre(const char* op, const Tensor& input, int64_t num_groups,
                                                           const OptTensor& weight, const OptTensor& bias,
                                                           double eps, const Pointwise& pro,
                                                           const std::vector<int64_t>& pad, bool replicate,
                                                           double value, const OptTensor& input_bias = {});
// act(GroupNorm(x) * scale + shift), scale and shift of input's shape and dtype, in one pass after the statistics;
// contiguous output, no prologue or residual (group_norm_cuda.cpp).
std::tuple<Tensor, Tensor, Tensor> group_norm_modulate_cuda_pre(const char* op, const Tensor& input,
                                                                int64_t num_groups, const OptTensor& weight,
                                                                const OptTensor& bias, double eps,
                                                                const Tensor& scale, const Tensor& shift,
                                                                const Pointwise& pro, const Tensor* into = nullptr,
                                                                const OptTensor& input_bias = {});
std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cuda_pre(
    const char* op, const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd,
    const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask, const Pointwise& pro);

// Building blocks for other CUDA ops on gnext's GroupNorm kernels (group_norm_cuda.cpp):
//  * statistics only: mean, rstd (N, G) float32 of x + shift[c] (shift: float32 (C,) or undefined);
//    x dense (contiguous or channels_last).
//  * the backward finalize from per-channel partials (sum dy*(x - mean), sum dy), float2 at
//    partial[(n*K + k)*C + c]: writes dgamma / dbeta (those given, of one dtype) and returns, if
//    want_coef, coef (N, C, 4) = (mean, c2, rstd*gamma, c3) with dx = rstd*gamma*dy + c2*(x - mean) + c3.
// The two-pass GroupNorm split at its statistics, for statistics merged across ranks between the passes
// (groupnorm_ext.distributed; group_norm_cuda.cpp):
//  * apply: out = act((x - mean) * rstd * gamma + beta) + residual from the given mean / rstd (N, G) float32;
//  * backward sums: (N, C, 2) float32 (sum dy'*(x - mean), sum dy') per channel of this tensor, dy' = dL/dout *
//    act'(.), the gradient at the GroupNorm's output;
//  * backward apply: dx from group_sums (N, G, 2) float32, the group means over the whole tensor of
//    gamma*dy'*(x - mean) and gamma*dy': dx = rstd*gamma*dy' - rstd^3 (x - mean) gs.x - rstd gs.y.
Tensor group_norm_apply_cuda_pre(const char* op, const Tensor& input, const Tensor& mean, const Tensor& rstd,
                                 int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
                                 const Pointwise& pro);
Tensor group_norm_backward_sums_cuda_pre(const char* op, const Tensor& grad_out, const Tensor& input,
                                         const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                                         int64_t num_groups, const Pointwise& pro);
Tensor group_norm_backward_apply_cuda_pre(const char* op, const Tensor& grad_out, const Tensor& input,
                                          const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                                          const Tensor& group_sums, int64_t num_groups, const Pointwise& pro);
std::tuple<Tensor, Tensor> group_norm_stats_cuda(const Tensor& x, const Problem& s, const Tensor& shift, double eps);
Tensor group_norm_grad_finalize_cuda(const Tensor& partial, int64_t K, const Problem& s, const Tensor& mean,
                                     const Tensor& rstd, const OptTensor& weight, const OptTensor& dgamma,
                                     const OptTensor& dbeta, bool want_coef);

}  // namespace gnext
