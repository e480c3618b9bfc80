// group_norm_act_logsumexp: argument checks, the CPU composite (float32 math through group_norm_cpu),
// C++ autograd and the CPU registration (CUDA: group_norm_act_lse_cuda.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "group_norm_act.h"

namespace gnext {

GNShape check_lse_args(const char* op, const Tensor& input, const OptTensor& input_bias, int64_t num_groups,
                       const OptTensor& weight, const OptTensor& bias) {
  const GNShape s = check_group_norm_args(op, input, num_groups, weight, bias);
  if (defined(input_bias)) {
    const Tensor& b = *input_bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == s.C, op, ": input_bias must have shape (C,) = (", s.C, "), got ",
                "input_bias.shape=", b.sizes());
    TORCH_CHECK(b.device() == input.device(), op, ": input_bias is on ", b.device(), " but input is on ",
                input.device());
    TORCH_CHECK(b.scalar_type() == input.scalar_type() || b.scalar_type() == at::kFloat, op,
                ": input_bias dtype must match input (", input.scalar_type(), ") or be float32, got ",
                b.scalar_type());
  }
  return s;
}

std::vector<int64_t> lse_out_shape(const Tensor& input) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape[1] = 1;
  return shape;
}

void check_lse_backward_args(const char* op, const GNShape& s, const Tensor& input, const Tensor& grad_out,
                             const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const auto shape = lse_out_shape(input);
  const std::pair<const Tensor*, const char*> outs[] = {{&grad_out, "grad_out"}, {&out, "out"}};
  for (const auto& [t, name] : outs) {
    TORCH_CHECK(t->sizes() == at::IntArrayRef(shape), op, ": ", name, ".shape=", t->sizes(), " must be (N, 1, *) = ",
                at::IntArrayRef(shape));
    TORCH_CHECK(t->scalar_type() == input.scalar_type(), op, ": ", name, " dtype (", t->scalar_type(),
                ") must equal input dtype (", input.scalar_type(), ")");
    TORCH_CHECK(t->device() == input.device(), op, ": ", name, " is on ", t->device(), " but input is on ",
                input.device());
  }
  const std::pair<const Tensor*, const char*> stats[] = {{&mean, "mean"}, {&rstd, "rstd"}};
  for (const auto& [t, name] : stats) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == s.N * s.G, op, ": ", name,
                " must be float32 with N*G=", s.N * s.G, " elements, got ", t->scalar_type(), " of shape ",
                t->sizes());
    TORCH_CHECK(t->device() == input.device(), op, ": ", name, " is on ", t->device(), " but input is on ",
                input.device());
  }
}

namespace {

constexpr const char* kOp = "gnext.group_norm_act_logsumexp";
constexpr const char* kBwdOp = "gnext.group_norm_act_logsumexp_backward";

// v = input + input_bias[c] in float32.
Tensor biased_float(const Tensor& input, const OptTensor& input_bias) {
  Tensor v = input.to(at::kFloat);
  if (!defined(input_bias)) return v;
  std::vector<int64_t> shape(input.dim(), 1);
  shape[1] = input.size(1);
  return v + input_bias->to(at::kFloat).view(shape);
}

OptTensor to_float(const OptTensor& t) { return defined(t) ? OptTensor(t->to(at::kFloat)) : std::nullopt; }

// r = [residual] v + act(GroupNorm(v)) in float32 from mean/rstd; also returns n = GroupNorm(v).
std::pair<Tensor, Tensor> residual_act(const Tensor& v, const GNShape& s, const Tensor& mean, const Tensor& rstd,
                                       const OptTensor& weight, const OptTensor& bias, int act, bool residual) {
  Tensor n = (v.reshape({s.N, s.G, s.D, s.HxW}) - mean.view({s.N, s.G, 1, 1})) * rstd.view({s.N, s.G, 1, 1});
  if (defined(weight)) n = n * weight->to(at::kFloat).view({1, s.G, s.D, 1});
  if (defined(bias)) n = n + bias->to(at::kFloat).view({1, s.G, s.D, 1});
  n = n.view(v.sizes());
  Tensor r = apply_act(n, act);
  if (residual) r = r + v;
  return {r, n};
}

std::tuple<Tensor, Tensor, Tensor> lse_cpu(const Tensor& input, const OptTensor& input_bias, int64_t num_groups,
                                           const OptTensor& weight, const OptTensor& bias, double eps,
                                           c10::string_view activation, bool residual) {
  const GNShape s = check_lse_args(kOp, input, input_bias, num_groups, weight, bias);
  const int act = parse_activation(kOp, activation);
  const Tensor v = biased_float(input, input_bias);
  auto [gn_out, mean, rstd] = group_norm_cpu(v, num_groups, to_float(weight), to_float(bias), eps);
  (void)gn_out;
  const Tensor r = residual_act(v, s, mean, rstd, weight, bias, act, residual).first;
  return {at::logsumexp(r, {1}, true).to(input.scalar_type()).contiguous(), mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor> lse_backward_cpu(
    const Tensor& grad_out, const Tensor& out, const Tensor& input, const OptTensor& input_bias, const Tensor& mean,
    const Tensor& rstd, const OptTensor& weight, const OptTensor& bias, int64_t num_groups,
    c10::string_view activation, bool residual, std::array<bool, 4> mask) {
  const GNShape s = check_lse_args(kBwdOp, input, input_bias, num_groups, weight, bias);
  check_lse_backward_args(kBwdOp, s, input, grad_out, out, mean, rstd);
  const int act = parse_activation(kBwdOp, activation);
  const Tensor v = biased_float(input, input_bias);
  auto [r, n] = residual_act(v, s, mean, rstd, weight, bias, act, residual);
  const Tensor dr = grad_out.to(at::kFloat) * at::exp(r - out.to(at::kFloat));
  const Tensor dn = act_backward(dr, n, act);
  auto [dv, dw, db] =
      group_norm_backward_cpu(dn, v, mean, rstd, to_float(weight), num_groups, {mask[0] || mask[1], mask[2], mask[3]});
  OptTensor dx, dib;
  if (mask[0] || mask[1]) {
    Tensor d = residual ? *dv + dr : *dv;
    if (mask[1]) {
      std::vector<int64_t> dims;
      for (int64_t i = 0; i < input.dim(); ++i)
        if (i != 1) dims.push_back(i);
      dib = d.sum(dims).to(input_bias->scalar_type());
    }
    if (mask[0]) dx = d.to(input.scalar_type()).contiguous(group_norm_memory_format(input));
  }
  auto to_param = [&](const OptTensor& t) -> OptTensor {
    return t ? OptTensor(t->to(param_grad_dtype(input, weight))) : std::nullopt;
  };
  return {dx, dib, to_param(dw), to_param(db)};
}

// ---------------------------------------------------------------------------------------------
// Autograd: edges input, input_bias, weight, bias (None ones are skipped).
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using FwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, int64_t, const OptTensor&,
                                                  const OptTensor&, double, c10::string_view, bool);
using BwdSig = std::tuple<OptTensor, OptTensor, OptTensor, OptTensor>(
    const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&,
    const OptTensor&, int64_t, c10::string_view, bool, std::array<bool, 4>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gnext::group_norm_act_logsumexp", "").typed<FwdSig>();
  return op;
}
const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gnext::group_norm_act_logsumexp_backward", "")
                             .typed<BwdSig>();
  return op;
}


class LseFunction : public torch::autograd::Function<LseFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const OptTensor& input_bias,
                               int64_t num_groups, const OptTensor& weight, const OptTensor& bias, double eps,
                               c10::string_view activation, bool residual) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = fwd_op().call(input, input_bias, num_groups, weight, bias, eps, activation, residual);
    ctx->save_for_backward({input, or_undef(input_bias), or_undef(weight), or_undef(bias), out, mean, rstd});
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["residual"] = residual;
    if (defined(bias)) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {out, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sv = ctx->get_saved_variables();
    const Tensor &input = sv[0], &input_bias = sv[1], &weight = sv[2], &bias = sv[3], &out = sv[4];
    variable_list res(8);
    if (!grads[0].defined()) return res;
    const auto slot = grad_slots<4>({true, input_bias.defined(), weight.defined(), bias.defined()});
    auto needs = [&](int i) { return slot[i] >= 0 && ctx->needs_input_grad(slot[i]); };
    const std::array<bool, 4> mask = {needs(0), needs(1), needs(2), needs(3)};
    if (!(mask[0] || mask[1] || mask[2] || mask[3])) return res;
    auto [dx, dib, dw, db] = bwd_op().call(grads[0], out, input, as_opt(input_bias), sv[5], sv[6], as_opt(weight),
                                           as_opt(bias), ctx->saved_data["num_groups"].toInt(),
                                           ctx->saved_data["activation"].toStringRef(),
                                           ctx->saved_data["residual"].toBool(), mask);
    res[0] = or_undef(dx), res[1] = or_undef(dib), res[3] = or_undef(dw);
    res[4] = db ? db->to(ctx->saved_data["bias_dtype"].toScalarType()) : Tensor();
    return res;
  }
};

std::tuple<Tensor, Tensor, Tensor> lse_autograd(const Tensor& input, const OptTensor& input_bias, int64_t num_groups,
                                                const OptTensor& weight, const OptTensor& bias, double eps,
                                                c10::string_view activation, bool residual) {
  const auto r = LseFunction::apply(input, input_bias, num_groups, weight, bias, eps, activation, residual);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gnext, CPU, m) {
  m.impl("group_norm_act_logsumexp", &lse_cpu);
  m.impl("group_norm_act_logsumexp_backward", &lse_backward_cpu);
}

TORCH_LIBRARY_IMPL(gnext, Autograd, m) {
  m.impl("group_norm_act_logsumexp", &lse_autograd);
  m.impl("group_norm_act_logsumexp_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace gnext
