// Fused ConvTranspose2d + GELU + GroupNorm (KernelBench L2#19):
//   z = conv_transpose2d(input, weight)            (ATen/cuDNN, no bias)
//   a = GELU(z + conv_bias[c])                     (erf, or the tanh approximation)
//   out = GroupNorm(a; num_groups, gn_weight, gn_bias, eps)   (Wu & He 2018)
// The bias, GELU and GroupNorm run in gnext's GroupNorm kernels as an input prologue, so `a` is never
// written: z is read, out is written. z, mean and rstd are saved for the backward, which runs the
// GroupNorm backward with the GELU backward fused (one kernel family writes dz), then the conv's data
// and weight gradients through ATen.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <string>
#include <tuple>

#include "../group_norm/group_norm.h"

namespace gnext {

using IntArrayRef = at::IntArrayRef;

// GroupNorm with the bias+GELU prologue, per device: CUDA kernels or the CPU composite.
using PreGroupNormFwd = std::tuple<Tensor, Tensor, Tensor> (*)(const char* op, const Tensor& z, int64_t num_groups,
                                                               const OptTensor& weight, const OptTensor& bias,
                                                               double eps, const Pointwise& pro);
using PreGroupNormBwd = std::tuple<OptTensor, OptTensor, OptTensor> (*)(
    const char* op, const Tensor& grad_out, const Tensor& z, const Tensor& mean, const Tensor& rstd,
    const OptTensor& weight, int64_t num_groups, std::array<bool, 3> output_mask, const Pointwise& pro);

std::tuple<Tensor, Tensor, Tensor, Tensor> conv_transpose2d_gelu_group_norm_impl(
    const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, IntArrayRef stride, IntArrayRef padding,
    IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups, const OptTensor& gn_weight,
    const OptTensor& gn_bias, double eps, c10::string_view approximate, PreGroupNormFwd gn);

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> conv_transpose2d_gelu_group_norm_backward_impl(
    const Tensor& grad_out, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, const Tensor& z,
    const Tensor& mean, const Tensor& rstd, const OptTensor& gn_weight, IntArrayRef stride, IntArrayRef padding,
    IntArrayRef output_padding, IntArrayRef dilation, int64_t groups, int64_t num_groups,
    c10::string_view approximate, std::array<bool, 5> output_mask, PreGroupNormBwd gnb);

}  // namespace gnext
