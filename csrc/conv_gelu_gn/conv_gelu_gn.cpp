// ConvTranspose2d + GELU + GroupNorm: argument checks, the conv through ATen, the CPU GroupNorm
// composite, C++ autograd, and the CPU registration (CUDA: conv_gelu_gn_cuda.cpp).
#include "conv_gelu_gn.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

namespace gnext {
namespace {

// Layout the op computes in, and so of out, z and grad_input: channels_last on CUDA, where cuDNN's
// channels_last transposed-conv kernels beat NCHW by more than the layout change costs (H100, L2#19:
// conv 2.87 vs 6.18 ms, docs/kernels.md); the input's own layout on the CPU.
at::MemoryFormat compute_format(const Tensor& input) {
  return input.is_cuda() ? at::MemoryFormat::ChannelsLast : input.suggest_memory_format();
}

constexpr const char* kOp = "gnext.conv_transpose2d_gelu_group_norm";
constexpr const char* kBwdOp = "gnext.conv_transpose2d_gelu_group_norm_backward";

int prologue_kind(const char* op, c10::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh", op,
              ": approximate must be 'none' or 'tanh' (as in F.gelu), got '", std::string(approximate), "'");
  return approximate == "tanh" ? kPreBiasGeluTanh : kPreBiasGelu;
}

void check_conv_args(const char* op, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                     IntArrayRef stride, IntArrayRef padding, IntArrayRef output_padding, IntArrayRef dilation,
                     int64_t groups) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be (N, C_in, H, W), got input.dim()=", input.dim(), " (shape ",
              input.sizes(), ")");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  TORCH_CHECK(weight.dim() == 4, op, ": weight must be (C_in, C_out / groups, kH, kW), got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), op, ": weight dtype (", weight.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  TORCH_CHECK(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but input is on ",
              input.device());
  TORCH_CHECK(groups > 0 && input.size(1) % groups == 0 && weight.size(0) == input.size(1), op,
              ": weight.shape[0]=", weight.size(0), " must equal C_in=", input.size(1),
              " and C_in must be divisible by groups=", groups);
  const std::pair<IntArrayRef, const char*> lists[] = {
      {stride, "stride"}, {padding, "padding"}, {output_padding, "output_padding"}, {dilation, "dilation"}};
  for (const auto& [l, name] : lists)
    TORCH_CHECK(l.size() == 2, op, ": ", name, " must have 2 elements, got ", l);
  const int64_t c_out = weight.size(1) * groups;
  if (defined(conv_bias)) {
    TORCH_CHECK(conv_bias->dim() == 1 && conv_bias->size(0) == c_out, op, ": conv_bias must have shape (C_out,) = (",
                c_out, "), got ", conv_bias->sizes());
    TORCH_CHECK(conv_bias->device() == input.device(), op, ": conv_bias is on ", conv_bias->device(),
                " but input is on ", input.device());
    TORCH_CHECK(conv_bias->scalar_type() == input.scalar_type(), op, ": conv_bias dtype (",
                conv_bias->scalar_type(), ") must equal input dtype (", input.scalar_type(), ")");
  }
}

Pointwise make_prologue(const char* op, const OptTensor& conv_bias, c10::string_view approximate) {
  Pointwise pro;
  pro.kind = prologue_kind(op, approximate);
  if (defined(conv_bias)) pro.bias = conv_bias->contiguous();
  return pro;
}

// CPU: a = gelu(z + bias) materialized, then gnext's CPU GroupNorm (float32 accumulation).
Tensor bias_gelu(const Tensor& z, const Pointwise& pro, Tensor* u_out = nullptr) {
  Tensor u = defined(pro.bias) ? z + pro.bias->view({1, -1, 1, 1}) : z;
  if (u_out != nullptr) *u_out = u;
  return at::gelu(u, pro.kind == kPreBiasGeluTanh ? "tanh" : "none");
}

std::tuple<Tensor, Tensor, Tensor> pre_group_norm_cpu(const char* op, const Tensor& z, int64_t num_groups,
                                                      const OptTensor& weight, const OptTensor& bias, double eps,
                                                      const Pointwise& pro) {
  check_pointwise(op, z, pro);
  return group_norm_cpu(bias_gelu(z, pro), num_groups, weight, bias, eps);
}

std::tuple<OptTensor, OptTensor, OptTensor> pre_group_norm_backward_cpu(
    const char* op, const Tensor& grad_out, const Tensor& z, const Tensor& mean, const Tensor& rstd,
    const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask, const Pointwise& pro) {
  check_pointwise(op, z, pro);
  Tensor u;
  const Tensor a = bias_gelu(z, pro, &u);
  auto [da, dw, db] = group_norm_backward_cpu(grad_out, a, mean, rstd, weight, num_groups, output_mask);
  OptTensor dz;
  if (da) dz = at::gelu_backward(*da, u, pro.kind == kPreBiasGeluTanh ? "tanh" : "none");
  return {dz, dw, db};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> conv_transpose2d_gelu_group_norm_impl(
    const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, IntArrayRef stride, IntArrayRef padding,
    IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups, const OptTensor& gn_weight,
    const OptTensor& gn_bias, double eps, c10::string_view approximate, PreGroupNormFwd gn) {
  check_conv_args(kOp, input, weight, conv_bias, stride, padding, output_padding, dilation, groups);
  const Pointwise pro = make_prologue(kOp, conv_bias, approximate);
  // The conv through ATen (cuDNN picks its algorithm; TF32 per torch.backends.cudnn.allow_tf32), in
  // compute_format(input); z is made dense in it so the fake kernel (groupnorm_ext/_ops.py) knows its strides.
  const auto fmt = compute_format(input);
  Tensor z = at::conv_transpose2d(input.contiguous(fmt), weight, {}, stride, padding, output_padding, groups,
                                  dilation)
                 .contiguous(fmt);
  auto [out, mean, rstd] = gn(kOp, z, num_groups, gn_weight, gn_bias, eps, pro);
  return {out, z, mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> conv_transpose2d_gelu_group_norm_backward_impl(
    const Tensor& grad_out, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, const Tensor& z,
    const Tensor& mean, const Tensor& rstd, const OptTensor& gn_weight, IntArrayRef stride, IntArrayRef padding,
    IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups,
    c10::string_view approximate, std::array<bool, 5> output_mask, PreGroupNormBwd gnb) {
  check_conv_args(kBwdOp, input, weight, conv_bias, stride, padding, output_padding, dilation, groups);
  const Pointwise pro = make_prologue(kBwdOp, conv_bias, approximate);
  const bool need_dz = output_mask[0] || output_mask[1] || (output_mask[2] && defined(conv_bias));
  auto [dz, dgw, dgb] = gnb(kBwdOp, grad_out, z, mean, rstd, gn_weight, num_groups,
                            {need_dz, output_mask[3], output_mask[4]}, pro);
  OptTensor dinput, dweight, dbias;
  if (output_mask[2] && defined(conv_bias)) dbias = dz->sum({0, 2, 3}, false, at::kFloat).to(conv_bias->scalar_type());
  if (output_mask[0] || output_mask[1]) {
    const auto fmt = compute_format(input);
    auto [gi, gw, gb] = at::convolution_backward(dz->contiguous(fmt), input.contiguous(fmt), weight, std::nullopt,
                                                 stride, padding, dilation, /*transposed=*/true, output_padding,
                                                 groups, {output_mask[0], output_mask[1], false});
    if (output_mask[0]) dinput = gi.contiguous(fmt);
    if (output_mask[1]) dweight = gw.contiguous(weight.suggest_memory_format());
  }
  return {dinput, dweight, dbias, dgw, dgb};
}

namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_cpu(const Tensor& input, const Tensor& weight,
                                                     const OptTensor& conv_bias, IntArrayRef stride,
                                                     IntArrayRef padding, IntArrayRef output_padding,
                                                     IntArrayRef dilation, int64_t groups, int64_t num_groups,
                                                     const OptTensor& gn_weight, const OptTensor& gn_bias, double eps,
                                                     c10::string_view approximate) {
  return conv_transpose2d_gelu_group_norm_impl(input, weight, conv_bias, stride, padding, output_padding, dilation,
                                               groups, num_groups, gn_weight, gn_bias, eps, approximate,
                                               &pre_group_norm_cpu);
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> fused_backward_cpu(
    const Tensor& grad_out, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, const Tensor& z,
    const Tensor& mean, const Tensor& rstd, const OptTensor& gn_weight, IntArrayRef stride, IntArrayRef padding,
    IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups,
    c10::string_view approximate, std::array<bool, 5> output_mask) {
  return conv_transpose2d_gelu_group_norm_backward_impl(grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight,
                                                        stride, padding, output_padding, dilation, groups, num_groups,
                                                        approximate, output_mask, &pre_group_norm_backward_cpu);
}

// ---------------------------------------------------------------------------------------------
// Autograd (C++, as for group_norm): gradient edges are the Tensor arguments that are not None, in
// order: input, weight, conv_bias, gn_weight, gn_bias (grad_slots).
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using FwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, IntArrayRef,
                                                          IntArrayRef, IntArrayRef, IntArrayRef, int64_t, int64_t,
                                                          const OptTensor&, const OptTensor&, double,
                                                          c10::string_view);
using BwdSig = std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor>(
    const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptTensor&, IntArrayRef, IntArrayRef, IntArrayRef, IntArrayRef, int64_t, int64_t, c10::string_view,
    std::array<bool, 5>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gnext::conv_transpose2d_gelu_group_norm", "")
                             .typed<FwdSig>();
  return op;
}
const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gnext::conv_transpose2d_gelu_group_norm_backward", "")
                             .typed<BwdSig>();
  return op;
}


class FusedFunction : public torch::autograd::Function<FusedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                               const OptTensor& conv_bias, IntArrayRef stride, IntArrayRef padding,
                               IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups,
                               const OptTensor& gn_weight, const OptTensor& gn_bias, double eps,
                               c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, z, mean, rstd] = fwd_op().call(input, weight, conv_bias, stride, padding, output_padding, dilation,
                                              groups, num_groups, gn_weight, gn_bias, eps, approximate);
    ctx->save_for_backward({input, weight, or_undef(conv_bias), z, mean, rstd, or_undef(gn_weight)});
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["output_padding"] = output_padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->saved_data["has_gn_bias"] = defined(gn_bias);
    if (defined(gn_bias)) ctx->saved_data["gn_bias_dtype"] = gn_bias->scalar_type();
    ctx->mark_non_differentiable({z, mean, rstd});
    ctx->set_materialize_grads(false);
    return {out, z, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sv = ctx->get_saved_variables();
    const Tensor &input = sv[0], &weight = sv[1], &conv_bias = sv[2], &z = sv[3], &mean = sv[4], &rstd = sv[5],
                 &gn_weight = sv[6];
    const auto slot = grad_slots<5>(
        {true, true, conv_bias.defined(), gn_weight.defined(), ctx->saved_data["has_gn_bias"].toBool()});
    auto needs = [&](int i) { return slot[i] >= 0 && ctx->needs_input_grad(slot[i]); };
    const std::array<bool, 5> mask = {needs(0), needs(1), needs(2), needs(3), needs(4)};
    variable_list res(13);
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2] || mask[3] || mask[4])) return res;
    const auto iv = [&](const char* k) { return ctx->saved_data[k].toIntVector(); };
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    auto [di, dw, db, dgw, dgb] =
        bwd_op().call(grads[0], input, weight, as_opt(conv_bias), z, mean, rstd, as_opt(gn_weight), iv("stride"),
                      iv("padding"), iv("output_padding"), iv("dilation"), ctx->saved_data["groups"].toInt(),
                      ctx->saved_data["num_groups"].toInt(), approximate, mask);
    res[0] = or_undef(di), res[1] = or_undef(dw), res[2] = or_undef(db), res[9] = or_undef(dgw);
    res[10] = dgb ? dgb->to(ctx->saved_data["gn_bias_dtype"].toScalarType()) : Tensor();
    return res;
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_autograd(const Tensor& input, const Tensor& weight,
                                                          const OptTensor& conv_bias, IntArrayRef stride,
                                                          IntArrayRef padding, IntArrayRef output_padding,
                                                          IntArrayRef dilation, int64_t groups, int64_t num_groups,
                                                          const OptTensor& gn_weight, const OptTensor& gn_bias,
                                                          double eps, c10::string_view approximate) {
  const auto r = FusedFunction::apply(input, weight, conv_bias, stride, padding, output_padding, dilation, groups,
                                      num_groups, gn_weight, gn_bias, eps, approximate);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gnext, CPU, m) {
  m.impl("conv_transpose2d_gelu_group_norm", &fused_cpu);
  m.impl("conv_transpose2d_gelu_group_norm_backward", &fused_backward_cpu);
}

TORCH_LIBRARY_IMPL(gnext, Autograd, m) {
  m.impl("conv_transpose2d_gelu_group_norm", &fused_autograd);
  m.impl("conv_transpose2d_gelu_group_norm_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace gnext
