// SPDX-License-Identifier: BSD-3-Clause
// GroupNorm with a fused activation and residual epilogue:
//   out = act(GroupNorm(input; num_groups, weight, bias, eps)) + residual
// act in {identity, silu, gelu, gelu_tanh, relu, tanh, hardswish, tanh_hardswish}. On CUDA the
// activation is a compile-time epilogue of gnext's GroupNorm kernels (common/pointwise.h): the
// normalized tensor is never written. The backward recomputes GroupNorm(x) from mean/rstd inside the
// kernels and applies act' to grad_out on the fly.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "../group_norm/group_norm.h"

namespace gnext {

// ActKind of an activation name; raises (naming `op`) on an unknown one.
int parse_activation(const char* op, std::string_view activation);

// group_norm_act_logsumexp (group_norm_act_lse*.cpp): with v = input + input_bias[c],
//   out = logsumexp over dim 1 (keepdim) of [residual ? v : 0] + act(GroupNorm(v)),
// the tail of KernelBench L2#92 (its conv without bias feeds `input`, the conv bias is input_bias).
// Checks the arguments and returns the problem sizes.
Problem check_lse_args(const char* op, const Tensor& input, const OptTensor& input_bias, int64_t num_groups,
                       const OptTensor& weight, const OptTensor& bias);
// Checks grad_out / out ((N, 1, *spatial)) and mean / rstd of the backward.
void check_lse_backward_args(const char* op, const Problem& s, const Tensor& input, const Tensor& grad_out,
                             const Tensor& out, const Tensor& mean, const Tensor& rstd);
// Shape (N, 1, *spatial) of the output.
std::vector<int64_t> lse_out_shape(const Tensor& input);

}  // namespace gnext
