// SPDX-License-Identifier: BSD-3-Clause
// CUDA registration of group_norm_act: gnext's GroupNorm kernels with the activation (+ residual)
// as their compile-time epilogue (csrc/group_norm, common/pointwise.h).
#include "group_norm_act.h"

namespace gnext {
namespace {

std::tuple<Tensor, Tensor, Tensor> group_norm_act_cuda(const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps,
                                                       const std::string& activation, const OptTensor& residual) {
  Pointwise pw;
  pw.act = parse_activation("gnext.group_norm_act", activation);
  pw.residual = residual;
  return group_norm_cuda_pre("gnext.group_norm_act", input, num_groups, weight, bias, eps, pw);
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_act_backward_cuda(
    const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
    const OptTensor& bias, int64_t num_groups, const std::string& activation, const std::vector<bool>& output_mask) {
  constexpr const char* op = "gnext.group_norm_act_backward";
  Pointwise pw;
  pw.act = parse_activation(op, activation);
  pw.gn_bias = bias;
  return group_norm_backward_cuda_pre(op, grad_out, input, mean, rstd, weight, num_groups,
                                      mask_array<3>(op, output_mask), pw);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("group_norm_act", TORCH_BOX(&group_norm_act_cuda));
  m.impl("group_norm_act_backward", TORCH_BOX(&group_norm_act_backward_cuda));
}

}  // namespace gnext
