// CUDA registration of the fused ConvTranspose2d + GELU + GroupNorm op: the conv through ATen
// (cuDNN), bias + GELU + GroupNorm (and their backward) in gnext's GroupNorm kernels with the
// bias+GELU prologue (csrc/group_norm).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "conv_gelu_gn.h"

namespace gnext {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_cuda(const Tensor& input, const Tensor& weight,
                                                      const OptTensor& conv_bias, IntArrayRef stride,
                                                      IntArrayRef padding, IntArrayRef output_padding,
                                                      IntArrayRef dilation, int64_t groups, int64_t num_groups,
                                                      const OptTensor& gn_weight, const OptTensor& gn_bias,
                                                      double eps, c10::string_view approximate) {
  c10::cuda::CUDAGuard guard(input.device());
  return conv_transpose2d_gelu_group_norm_impl(input, weight, conv_bias, stride, padding, output_padding, dilation,
                                               groups, num_groups, gn_weight, gn_bias, eps, approximate,
                                               &group_norm_cuda_pre);
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> fused_backward_cuda(
    const Tensor& grad_out, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, const Tensor& z,
    const Tensor& mean, const Tensor& rstd, const OptTensor& gn_weight, IntArrayRef stride, IntArrayRef padding,
    IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups,
    c10::string_view approximate, std::array<bool, 5> output_mask) {
  c10::cuda::CUDAGuard guard(input.device());
  return conv_transpose2d_gelu_group_norm_backward_impl(grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight,
                                                        stride, padding, output_padding, dilation, groups, num_groups,
                                                        approximate, output_mask, &group_norm_backward_cuda_pre);
}

}  // namespace

TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("conv_transpose2d_gelu_group_norm", &fused_cuda);
  m.impl("conv_transpose2d_gelu_group_norm_backward", &fused_backward_cuda);
}

}  // namespace gnext
