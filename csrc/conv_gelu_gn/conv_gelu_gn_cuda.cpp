// SPDX-License-Identifier: BSD-3-Clause
// Fused ConvTranspose2d + GELU + GroupNorm (KernelBench L2#19), CUDA:
//   z = conv_transpose2d(input, weight)            (no bias)
//   a = GELU(z + conv_bias[c])                     (erf, or the tanh approximation)
//   out = GroupNorm(a; num_groups, gn_weight, gn_bias, eps)   (Wu & He 2018)
// The forward: the conv through ATen/cuDNN, then bias + GELU + GroupNorm in gnext's GroupNorm kernels as
// an input prologue (statistics pass over z, then the elementwise pass); z, mean and rstd are saved and
// `a` is never written. A CUTLASS implicit-GEMM conv with a statistics epilogue measured slower than cuDNN
// plus gnext's statistics pass (docs/decisions/conv-backend.md).
// The backward runs the GroupNorm backward with the GELU backward fused (one kernel family writes dz),
// then the conv's data and weight gradients through ATen. An input that is not channels_last is
// transposed once: the forward returns that copy (input_cl) and autograd hands it to the backward as
// its `input`, whose weight gradient needs it in channels_last. The output has the input's layout: an
// input dense in channels_last gives a channels_last out, any other an NCHW-contiguous one, written by the
// elementwise pass itself (PwArgs::out_nchw: a shared-memory tile per CTA, no extra pass); an NCHW
// upstream gradient is read in place by the backward (PwArgs::dy_nchw). CPU kernels and autograd:
// groupnorm_ext/_cpu.py, _autograd.py.
#include <string>
#include <vector>

#include "../common/cuda_utils.h"
#include "../group_norm/group_norm.h"
#include "layout.h"

namespace gnext {
namespace {

using torch::stable::detail::to;

// The op computes in channels_last on CUDA, where cuDNN's channels_last transposed-conv kernels
// beat NCHW by more than the layout change costs (H100, L2#19: conv 2.87 vs 6.18 ms,
// docs/kernels.md); z and grad_input are channels_last, out has the input's layout (out_is_nchw).
constexpr MemoryFormat kFormat = MemoryFormat::ChannelsLast;

constexpr const char* kOp = "gnext.conv_transpose2d_gelu_group_norm";
constexpr const char* kBwdOp = "gnext.conv_transpose2d_gelu_group_norm_backward";

int prologue_kind(const char* op, const std::string& approximate) {
  GNEXT_CHECK(approximate == "none" || approximate == "tanh", op,
              ": approximate must be 'none' or 'tanh' (as in F.gelu), got '", approximate, "'");
  return approximate == "tanh" ? kPreBiasGeluTanh : kPreBiasGelu;
}

void check_conv_args(const char* op, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                     const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                     const std::vector<int64_t>& output_padding, const std::vector<int64_t>& dilation,
                     int64_t groups) {
  GNEXT_CHECK(input.dim() == 4, op, ": input must be (N, C_in, H, W), got input.dim()=", input.dim(), " (shape ",
              shape(input), ")");
  GNEXT_CHECK(is_supported_dtype(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  GNEXT_CHECK(weight.dim() == 4, op, ": weight must be (C_in, C_out / groups, kH, kW), got shape ", shape(weight));
  GNEXT_CHECK(weight.scalar_type() == input.scalar_type(), op, ": weight dtype (", weight.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  GNEXT_CHECK(same_device(weight, input), op, ": weight is on ", device_name(weight), " but input is on ",
              device_name(input));
  GNEXT_CHECK(groups > 0 && input.size(1) % groups == 0 && weight.size(0) == input.size(1), op,
              ": weight.shape[0]=", weight.size(0), " must equal C_in=", input.size(1),
              " and C_in must be divisible by groups=", groups);
  const std::pair<const std::vector<int64_t>*, const char*> lists[] = {
      {&stride, "stride"}, {&padding, "padding"}, {&output_padding, "output_padding"}, {&dilation, "dilation"}};
  for (const auto& [l, name] : lists)
    GNEXT_CHECK(l->size() == 2, op, ": ", name, " must have 2 elements, got ", Shape{*l});
  const int64_t c_out = weight.size(1) * groups;
  if (defined(conv_bias)) {
    GNEXT_CHECK(conv_bias->dim() == 1 && conv_bias->size(0) == c_out, op, ": conv_bias must have shape (C_out,) = (",
                c_out, "), got ", shape(*conv_bias));
    GNEXT_CHECK(same_device(*conv_bias, input), op, ": conv_bias is on ", device_name(*conv_bias),
                " but input is on ", device_name(input));
    GNEXT_CHECK(conv_bias->scalar_type() == input.scalar_type(), op, ": conv_bias dtype (",
                conv_bias->scalar_type(), ") must equal input dtype (", input.scalar_type(), ")");
  }
}

Pointwise make_prologue(const char* op, const OptTensor& conv_bias, const std::string& approximate) {
  Pointwise pro;
  pro.kind = prologue_kind(op, approximate);
  if (defined(conv_bias)) pro.bias = contig(*conv_bias);
  return pro;
}

using IntList = std::vector<int64_t>;

// input dense in kFormat: NCHW-contiguous 4-D input through gnext's transpose kernel (faster than
// ATen's copy at L2#19's size), other strides through ATen.
Tensor input_in_kformat(const Tensor& input) {
  if (is_dense_in(input, kFormat)) return input;
  if (!input.is_contiguous() || input.dim() != 4 || input.numel() == 0 || input.size(0) > 65535)
    return dense_in(input, kFormat);
  Tensor out = empty_as(input, kFormat);
  GNEXT_CUDA_CHECK(layout::nchw_to_nhwc(input.data_ptr(), out.data_ptr(), input.size(0), input.size(1),
                                        input.size(2) * input.size(3), int(input.element_size()),
                                        current_stream(input)));
  return out;
}

// The op's out is NCHW-contiguous unless the input is dense in kFormat (the rule of the fake kernel in
// groupnorm_ext/_ops.py, _fused_out_format).
bool out_is_nchw(const Tensor& input) { return !is_dense_in(input, kFormat); }

// The op's input_cl output: x (the input in kFormat) where the input was not dense in kFormat, else an
// empty (0,) tensor (the rule of the fake kernel in groupnorm_ext/_ops.py).
Tensor input_cl_output(const Tensor& input, const Tensor& x) {
  return is_dense_in(input, kFormat) ? empty_on(input, {0}, input.scalar_type()) : x;
}

using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;  // out, z, mean, rstd, input_cl

Outputs fused_cuda(const Tensor& input, const Tensor& weight,
                                                      const OptTensor& conv_bias, IntList stride, IntList padding,
                                                      IntList output_padding, IntList dilation, int64_t groups,
                                                      int64_t num_groups, const OptTensor& gn_weight,
                                                      const OptTensor& gn_bias, double eps, std::string approximate) {
  check_conv_args(kOp, input, weight, conv_bias, stride, padding, output_padding, dilation, groups);
  const Pointwise pro = make_prologue(kOp, conv_bias, approximate);
  DeviceGuard guard(input);
  // The conv (cuDNN picks its algorithm; TF32 per torch.backends.cudnn.allow_tf32) in kFormat; z is
  // made dense in it so the fake kernel (groupnorm_ext/_ops.py) knows its strides.
  const OptTensor no_bias;
  const Tensor x_cl = input_in_kformat(input);
  auto st = call_op<8>("aten::conv_transpose2d", "input", x_cl, weight, no_bias,
                       IntArrayRef(stride), IntArrayRef(padding), IntArrayRef(output_padding), groups,
                       IntArrayRef(dilation));
  const Tensor z = dense_in(to<Tensor>(st[0]), kFormat);
  auto [out, mean, rstd] = group_norm_cuda_pre(kOp, z, num_groups, gn_weight, gn_bias, eps, pro, out_is_nchw(input));
  return {out, z, mean, rstd, input_cl_output(input, x_cl)};
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> fused_backward_cuda(
    const Tensor& grad_out, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, const Tensor& z,
    const Tensor& mean, const Tensor& rstd, const OptTensor& gn_weight, IntList stride, IntList padding,
    IntList output_padding, IntList dilation, int64_t groups, int64_t num_groups, std::string approximate,
    std::vector<bool> mask_list) {
  const std::array<bool, 5> output_mask = mask_array<5>(kBwdOp, mask_list);
  check_conv_args(kBwdOp, input, weight, conv_bias, stride, padding, output_padding, dilation, groups);
  const Pointwise pro = make_prologue(kBwdOp, conv_bias, approximate);
  DeviceGuard guard(input);
  const bool need_dz = output_mask[0] || output_mask[1] || (output_mask[2] && defined(conv_bias));
  auto [dz, dgw, dgb] = group_norm_backward_cuda_pre(kBwdOp, grad_out, z, mean, rstd, gn_weight, num_groups,
                                                     {need_dz, output_mask[3], output_mask[4]}, pro);
  OptTensor dinput, dweight, dbias;
  if (output_mask[2] && defined(conv_bias)) {
    const Tensor s = torch::stable::sum(*dz, IntList{0, 2, 3}, false, ScalarType::Float);
    dbias = to_dtype(s, conv_bias->scalar_type());
  }
  if (output_mask[0] || output_mask[1]) {
    const std::optional<IntList> bias_sizes;
    const bool mask[3] = {output_mask[0], output_mask[1], false};
    auto st = call_op<11>("aten::convolution_backward", "", dense_in(*dz, kFormat), input_in_kformat(input), weight,
                          bias_sizes, IntArrayRef(stride), IntArrayRef(padding), IntArrayRef(dilation),
                          /*transposed=*/true, IntArrayRef(output_padding), groups,
                          torch::headeronly::HeaderOnlyArrayRef<bool>(mask, 3));
    Tensor gi = to<Tensor>(st[0]), gw = to<Tensor>(st[1]), gb = to<Tensor>(st[2]);
    if (output_mask[0]) dinput = dense_in(gi, kFormat);
    if (output_mask[1]) dweight = dense_in(gw, suggest_format(weight));
  }
  return {dinput, dweight, dbias, dgw, dgb};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("conv_transpose2d_gelu_group_norm", TORCH_BOX(&fused_cuda));
  m.impl("conv_transpose2d_gelu_group_norm_backward", TORCH_BOX(&fused_backward_cuda));
}

}  // namespace gnext
