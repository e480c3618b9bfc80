// group_norm_act: activation names, the CPU composite (reference-quality, float32 accumulation
// through group_norm_cpu), C++ autograd and the CPU registration (CUDA: group_norm_act_cuda.cpp).
#include "group_norm_act.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <array>
#include <utility>

namespace gnext {

namespace {
constexpr std::pair<const char*, int> kActivations[] = {
    {"identity", kActIdentity}, {"silu", kActSilu},   {"gelu", kActGelu},           {"gelu_tanh", kActGeluTanh},
    {"relu", kActRelu},         {"tanh", kActTanh},   {"hardswish", kActHardswish}, {"tanh_hardswish", kActTanhHardswish},
};
}  // namespace

int parse_activation(const char* op, c10::string_view activation) {
  for (const auto& [name, kind] : kActivations)
    if (activation == name) return kind;
  TORCH_CHECK(false, op, ": activation must be one of identity, silu, gelu, gelu_tanh, relu, tanh, hardswish, "
              "tanh_hardswish; got '", std::string(activation), "'");
}

Tensor apply_act(const Tensor& n, int act) {
  switch (act) {
    case kActSilu:
      return at::silu(n);
    case kActGelu:
      return at::gelu(n);
    case kActGeluTanh:
      return at::gelu(n, "tanh");
    case kActRelu:
      return at::relu(n);
    case kActTanh:
      return at::tanh(n);
    case kActHardswish:
      return at::hardswish(n);
    case kActTanhHardswish:
      return at::hardswish(at::tanh(n));
    default:
      return n;
  }
}

// dL/dn from dL/dout = g at the activation's input n.
Tensor act_backward(const Tensor& g, const Tensor& n, int act) {
  switch (act) {
    case kActSilu:
      return at::silu_backward(g, n);
    case kActGelu:
      return at::gelu_backward(g, n);
    case kActGeluTanh:
      return at::gelu_backward(g, n, "tanh");
    case kActRelu:
      return at::threshold_backward(g, n, 0);
    case kActTanh:
      return at::tanh_backward(g, at::tanh(n));
    case kActHardswish:
      return at::hardswish_backward(g, n);
    case kActTanhHardswish: {
      const Tensor t = at::tanh(n);
      return at::tanh_backward(at::hardswish_backward(g, t), t);
    }
    default:
      return g;
  }
}

namespace {

constexpr const char* kOp = "gnext.group_norm_act";
constexpr const char* kBwdOp = "gnext.group_norm_act_backward";

std::tuple<Tensor, Tensor, Tensor> group_norm_act_cpu(const Tensor& input, int64_t num_groups,
                                                      const OptTensor& weight, const OptTensor& bias, double eps,
                                                      c10::string_view activation, const OptTensor& residual) {
  Pointwise pw;
  pw.act = parse_activation(kOp, activation);
  pw.residual = residual;
  check_group_norm_args(kOp, input, num_groups, weight, bias);
  check_pointwise(kOp, input, pw);
  auto [n, mean, rstd] = group_norm_cpu(input, num_groups, weight, bias, eps);
  Tensor out = apply_act(n, pw.act);
  if (defined(residual)) out = out + *residual;
  return {out.contiguous(group_norm_memory_format(input)), mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_act_backward_cpu(
    const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
    const OptTensor& bias, int64_t num_groups, c10::string_view activation, std::array<bool, 3> output_mask) {
  const int act = parse_activation(kBwdOp, activation);
  const GNShape s = check_group_norm_backward_args(kBwdOp, grad_out, input, mean, rstd, weight, num_groups);
  if (defined(bias)) check_group_norm_args(kBwdOp, input, num_groups, weight, bias);
  Tensor dn = grad_out;
  if (act != kActIdentity && input.numel() > 0) {
    // n = GroupNorm(x) recomputed from mean/rstd in float32.
    const Tensor xg = input.to(at::kFloat).contiguous().view({s.N, s.G, s.D, s.HxW});
    Tensor n = (xg - mean.view({s.N, s.G, 1, 1})) * rstd.view({s.N, s.G, 1, 1});
    if (defined(weight)) n = n * weight->to(at::kFloat).view({1, s.G, s.D, 1});
    if (defined(bias)) n = n + bias->to(at::kFloat).view({1, s.G, s.D, 1});
    dn = act_backward(grad_out.to(at::kFloat).contiguous().view(n.sizes()), n, act)
             .view(input.sizes())
             .to(input.scalar_type());
  }
  return group_norm_backward_cpu(dn, input, mean, rstd, weight, num_groups, output_mask);
}

// ---------------------------------------------------------------------------------------------
// Autograd: edges input, weight, bias, residual (its gradient is grad_out); None ones are skipped.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using FwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, int64_t, const OptTensor&, const OptTensor&, double,
                                                  c10::string_view, const OptTensor&);
using BwdSig = std::tuple<OptTensor, OptTensor, OptTensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                           const OptTensor&, const OptTensor&, int64_t,
                                                           c10::string_view, std::array<bool, 3>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gnext::group_norm_act", "").typed<FwdSig>();
  return op;
}
const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gnext::group_norm_act_backward", "").typed<BwdSig>();
  return op;
}


class GroupNormActFunction : public torch::autograd::Function<GroupNormActFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& input, int64_t num_groups,
                               const OptTensor& weight, const OptTensor& bias, double eps,
                               c10::string_view activation, const OptTensor& residual) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = fwd_op().call(input, num_groups, weight, bias, eps, activation, residual);
    ctx->save_for_backward({input, or_undef(weight), or_undef(bias), mean, rstd});
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["has_residual"] = defined(residual);
    if (defined(bias)) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {out, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sv = ctx->get_saved_variables();
    const Tensor &input = sv[0], &weight = sv[1], &bias = sv[2], &mean = sv[3], &rstd = sv[4];
    variable_list res(7);
    if (!grads[0].defined()) return res;
    const auto slot = grad_slots<4>({true, weight.defined(), bias.defined(), ctx->saved_data["has_residual"].toBool()});
    auto needs = [&](int i) { return slot[i] >= 0 && ctx->needs_input_grad(slot[i]); };
    if (needs(3)) res[6] = grads[0];  // residual
    const std::array<bool, 3> mask = {needs(0), needs(1), needs(2)};
    if (!(mask[0] || mask[1] || mask[2])) return res;
    auto [dx, dw, db] = bwd_op().call(grads[0], input, mean, rstd, as_opt(weight), as_opt(bias),
                                      ctx->saved_data["num_groups"].toInt(),
                                      ctx->saved_data["activation"].toStringRef(), mask);
    res[0] = or_undef(dx), res[2] = or_undef(dw);
    res[3] = db ? db->to(ctx->saved_data["bias_dtype"].toScalarType()) : Tensor();
    return res;
  }
};

std::tuple<Tensor, Tensor, Tensor> group_norm_act_autograd(const Tensor& input, int64_t num_groups,
                                                           const OptTensor& weight, const OptTensor& bias, double eps,
                                                           c10::string_view activation, const OptTensor& residual) {
  const auto r = GroupNormActFunction::apply(input, num_groups, weight, bias, eps, activation, residual);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gnext, CPU, m) {
  m.impl("group_norm_act", &group_norm_act_cpu);
  m.impl("group_norm_act_backward", &group_norm_act_backward_cpu);
}

TORCH_LIBRARY_IMPL(gnext, Autograd, m) {
  m.impl("group_norm_act", &group_norm_act_autograd);
  m.impl("group_norm_act_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace gnext
