// Argument checks and layout rules shared by the CPU and CUDA GroupNorm implementations.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <array>
#include <limits>
#include <tuple>

#include "../common/pointwise.h"

namespace gnext {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Sizes of a GroupNorm problem: input (N, C, *spatial), HxW = prod(spatial), D = C / G.
struct GNShape {
  int64_t N, C, G, D, HxW;
};

inline bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }
// Saved-tensor conversions of the C++ autograd Functions: undefined <-> nullopt.
inline OptTensor as_opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
inline Tensor or_undef(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checks input/num_groups/weight/bias and returns the problem sizes. `op` names the caller in messages.
inline GNShape check_group_norm_args(const char* op, const Tensor& input, int64_t num_groups,
                                     const OptTensor& weight, const OptTensor& bias) {
  TORCH_CHECK(input.dim() >= 2, op, ": input must have shape (N, C, *) with at least 2 dims, got input.dim()=",
              input.dim(), " (shape ", input.sizes(), ")");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  TORCH_CHECK(num_groups > 0, op, ": num_groups must be positive, got num_groups=", num_groups);
  const int64_t N = input.size(0), C = input.size(1);
  TORCH_CHECK(C % num_groups == 0, op, ": num_channels C=", C, " must be divisible by num_groups=",
              num_groups, " (input shape ", input.sizes(), ")");
  const std::pair<const OptTensor*, const char*> params[] = {{&weight, "weight"}, {&bias, "bias"}};
  for (const auto& [p, name] : params) {
    if (!defined(*p)) continue;
    const Tensor& t = **p;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must have shape (C,) = (", C, "), got ",
                name, ".shape=", t.sizes());
    TORCH_CHECK(t.device() == input.device(), op, ": ", name, " is on ", t.device(),
                " but input is on ", input.device());
    TORCH_CHECK(t.scalar_type() == input.scalar_type() || t.scalar_type() == at::kFloat, op, ": ", name,
                " dtype must match input (", input.scalar_type(), ") or be float32, got ", t.scalar_type());
  }
  if (defined(weight) && defined(bias)) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), op, ": weight (", weight->scalar_type(),
                ") and bias (", bias->scalar_type(), ") must have the same dtype");
  }
  int64_t HxW = 1;
  for (int64_t d = 2; d < input.dim(); ++d) HxW *= input.size(d);
  return {N, C, num_groups, C / num_groups, HxW};
}

// Memory layout a kernel works on. The output keeps the input's memory format:
// NCHW-contiguous in -> contiguous out; channels_last(_3d) in -> channels_last(_3d) out;
// any other strides are first made contiguous. (The fake kernel in _ops.py follows the same rule.)
inline at::MemoryFormat group_norm_memory_format(const Tensor& input) {
  if (input.is_contiguous()) return at::MemoryFormat::Contiguous;
  if (input.dim() == 4 && input.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (input.dim() == 5 && input.is_contiguous(at::MemoryFormat::ChannelsLast3d))
    return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

// Returns `input` with dense strides in group_norm_memory_format(input) (a copy only for other strides).
inline Tensor dense_input(const Tensor& input) {
  const auto fmt = group_norm_memory_format(input);
  return fmt == at::MemoryFormat::Contiguous ? input.contiguous() : input;
}

// Dtype of grad_weight / grad_bias: the weight's, else the input's.
inline at::ScalarType param_grad_dtype(const Tensor& input, const OptTensor& weight) {
  return defined(weight) ? weight->scalar_type() : input.scalar_type();
}

// Checks every argument of the backward op and returns the problem sizes.
inline GNShape check_group_norm_backward_args(const char* op, const Tensor& grad_out, const Tensor& input,
                                              const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
                                              int64_t num_groups) {
  const GNShape s = check_group_norm_args(op, input, num_groups, weight, std::nullopt);
  TORCH_CHECK(grad_out.sizes() == input.sizes(), op, ": grad_out.shape=", grad_out.sizes(),
              " must equal input.shape=", input.sizes());
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(), op, ": grad_out dtype (", grad_out.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  TORCH_CHECK(grad_out.device() == input.device(), op, ": grad_out is on ", grad_out.device(),
              " but input is on ", input.device());
  const std::pair<const Tensor*, const char*> stats[] = {{&mean, "mean"}, {&rstd, "rstd"}};
  for (const auto& [t, name] : stats) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t->scalar_type());
    TORCH_CHECK(t->numel() == s.N * s.G, op, ": ", name, " must have N*G=", s.N * s.G, " elements, got shape ",
                t->sizes());
    TORCH_CHECK(t->device() == input.device(), op, ": ", name, " is on ", t->device(), " but input is on ",
                input.device());
  }
  return s;
}

// Forward statistics of an input with no elements: undefined, NaN.
inline void fill_empty_stats(Tensor& mean, Tensor& rstd) {
  mean.fill_(std::numeric_limits<float>::quiet_NaN());
  rstd.fill_(std::numeric_limits<float>::quiet_NaN());
}

// Backward outputs selected by output_mask, allocated: dx in the input's memory format,
// grad_weight / grad_bias (C,) of param_grad_dtype. For an input with no elements the parameter
// gradients are zeros.
inline std::tuple<OptTensor, OptTensor, OptTensor> alloc_backward_outputs(const Tensor& input, const GNShape& s,
                                                                           const OptTensor& weight,
                                                                           std::array<bool, 3> output_mask) {
  const auto popts = input.options().dtype(param_grad_dtype(input, weight));
  auto param = [&](bool wanted) -> OptTensor {
    if (!wanted) return std::nullopt;
    return input.numel() == 0 ? at::zeros({s.C}, popts) : at::empty({s.C}, popts);
  };
  OptTensor dx;
  if (output_mask[0]) dx = at::empty(input.sizes(), input.options().memory_format(group_norm_memory_format(input)));
  return {dx, param(output_mask[1]), param(output_mask[2])};
}

// Pointwise extensions of the GroupNorm kernels (common/pointwise.h), at most one of:
//  * input prologue (kind != kPreNone): normalize a = act(x + bias[c]) instead of x; the backward's
//    grad_input is then d/dx = dL/da * act'(x + bias). Used by the fused ConvTranspose2d+GELU+GroupNorm op.
//  * output epilogue (act != kActIdentity, or a residual): out = act(GroupNorm(x)) + residual; the
//    backward takes dL/dout and returns the gradients of x, gamma, beta (the residual's is dL/dout).
struct Pointwise {
  int kind = kPreNone;
  OptTensor bias;
  int act = kActIdentity;
  OptTensor residual;  // forward only
  OptTensor gn_bias;   // backward with an activation: GroupNorm's beta, to recompute act's input
};

inline void check_pointwise(const char* op, const Tensor& input, const Pointwise& pro) {
  TORCH_CHECK(pro.kind >= kPreNone && pro.kind <= kPreBiasGeluTanh, op, ": unknown prologue kind ", pro.kind);
  TORCH_CHECK(pro.act >= kActIdentity && pro.act < kActCount, op, ": unknown activation kind ", pro.act);
  TORCH_CHECK(pro.kind == kPreNone || (pro.act == kActIdentity && !defined(pro.residual)), op,
              ": a prologue and an epilogue cannot be combined");
  if (defined(pro.residual)) {
    const Tensor& r = *pro.residual;
    TORCH_CHECK(r.sizes() == input.sizes(), op, ": residual.shape=", r.sizes(), " must equal input.shape=",
                input.sizes());
    TORCH_CHECK(r.scalar_type() == input.scalar_type(), op, ": residual dtype (", r.scalar_type(),
                ") must equal input dtype (", input.scalar_type(), ")");
    TORCH_CHECK(r.device() == input.device(), op, ": residual is on ", r.device(), " but input is on ",
                input.device());
  }
  if (!defined(pro.bias)) return;
  const Tensor& b = *pro.bias;
  TORCH_CHECK(b.dim() == 1 && b.size(0) == input.size(1) && b.is_contiguous(), op,
              ": conv_bias must be a contiguous (C,) = (", input.size(1), ") tensor, got shape ", b.sizes());
  TORCH_CHECK(b.device() == input.device(), op, ": conv_bias is on ", b.device(), " but input is on ",
              input.device());
  TORCH_CHECK(b.scalar_type() == input.scalar_type() || b.scalar_type() == at::kFloat, op,
              ": conv_bias dtype must match input (", input.scalar_type(), ") or be float32, got ", b.scalar_type());
}

// CUDA GroupNorm with a prologue (group_norm_cuda.cpp); `op` names the caller in messages.
std::tuple<Tensor, Tensor, Tensor> group_norm_cuda_pre(const char* op, const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps,
                                                       const Pointwise& pro);
std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cuda_pre(
    const char* op, const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd,
    const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask, const Pointwise& pro);

// Building blocks for other CUDA ops on gnext's GroupNorm kernels (group_norm_cuda.cpp):
//  * statistics only: mean, rstd (N, G) float32 of x + shift[c] (shift: float32 (C,) or undefined);
//    x dense (contiguous or channels_last).
//  * the backward finalize from per-channel partials (sum dy*(x - mean), sum dy), float2 at
//    partial[(n*K + k)*C + c]: writes dgamma / dbeta (those given, of one dtype) and returns, if
//    want_coef, coef (N, C, 4) = (mean, c2, rstd*gamma, c3) with dx = rstd*gamma*dy + c2*(x - mean) + c3.
std::tuple<Tensor, Tensor> group_norm_stats_cuda(const Tensor& x, const GNShape& s, const Tensor& shift, double eps);
Tensor group_norm_grad_finalize_cuda(const Tensor& partial, int64_t K, const GNShape& s, const Tensor& mean,
                                     const Tensor& rstd, const OptTensor& weight, const OptTensor& dgamma,
                                     const OptTensor& dbeta, bool want_coef);

// needs_input_grad slot of each Tensor argument of a C++ autograd Function: optional Tensors that are
// None are not inputs of the node, so the slots of the ones after them shift; -1 for an absent one.
template <size_t K>
std::array<int, K> grad_slots(const std::array<bool, K>& present) {
  std::array<int, K> slot{};
  int n = 0;
  for (size_t i = 0; i < K; ++i) slot[i] = present[i] ? n++ : -1;
  return slot;
}

std::tuple<Tensor, Tensor, Tensor> group_norm_cpu(const Tensor& input, int64_t num_groups, const OptTensor& weight,
                                                  const OptTensor& bias, double eps);
std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cpu(const Tensor& grad_out, const Tensor& input,
                                                                    const Tensor& mean, const Tensor& rstd,
                                                                    const OptTensor& weight, int64_t num_groups,
                                                                    std::array<bool, 3> output_mask);

}  // namespace gnext
