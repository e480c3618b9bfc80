// Autograd for the GroupNorm ops, registered at the Autograd key (C++: no Python on the
// training hot path). Works under torch.compile: AOTAutograd traces through these kernels,
// whose forward/backward call the ops again below autograd (real or fake kernels).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "group_norm.h"

namespace gnext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, int64_t, const OptTensor&, const OptTensor&,
                                                      double);
using BackwardSig = std::tuple<OptTensor, OptTensor, OptTensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                const Tensor&, const OptTensor&, int64_t,
                                                                std::array<bool, 3>);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gnext::group_norm", "").typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("gnext::group_norm_backward", "").typed<BackwardSig>();
  return op;
}


class GroupNormFunction : public torch::autograd::Function<GroupNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& input, int64_t num_groups,
                               const OptTensor& weight, const OptTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = forward_op().call(input, num_groups, weight, bias, eps);
    ctx->save_for_backward({input, or_undef(weight), mean, rstd});
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["has_bias"] = defined(bias);
    if (defined(bias)) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    ctx->mark_non_differentiable({mean, rstd});
    // Only grad_out is used: no zero-filled gradients for mean/rstd (two extra kernels per step).
    ctx->set_materialize_grads(false);
    return {out, mean, rstd};
  }

  // Gradient edges: input, weight, bias (the Tensor arguments that are not None, in order).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &input = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto slot = grad_slots<3>({true, weight.defined(), has_bias});
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0), slot[1] >= 0 && ctx->needs_input_grad(slot[1]),
                                      slot[2] >= 0 && ctx->needs_input_grad(slot[2])};
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2])) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto [dx, dw, db] = backward_op().call(grads[0], input, mean, rstd, as_opt(weight),
                                           ctx->saved_data["num_groups"].toInt(), mask);
    Tensor dbias = or_undef(db);
    if (dbias.defined()) dbias = dbias.to(ctx->saved_data["bias_dtype"].toScalarType());
    return {or_undef(dx), Tensor(), or_undef(dw), dbias, Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> group_norm_autograd(const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps) {
  const auto r = GroupNormFunction::apply(input, num_groups, weight, bias, eps);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gnext, Autograd, m) {
  m.impl("group_norm", &group_norm_autograd);
  // Not differentiable itself: runs as usual, and differentiating through it (double backward)
  // raises "derivative for gnext::group_norm_backward is not implemented".
  m.impl("group_norm_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace gnext
