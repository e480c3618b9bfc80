// GroupNorm with a fused activation and residual epilogue:
//   out = act(GroupNorm(input; num_groups, weight, bias, eps)) + residual
// act in {identity, silu, gelu, gelu_tanh, relu, tanh, hardswish, tanh_hardswish}. On CUDA the
// activation is a compile-time epilogue of gnext's GroupNorm kernels (common/pointwise.h): the
// normalized tensor is never written. The backward recomputes GroupNorm(x) from mean/rstd inside the
// kernels and applies act' to grad_out on the fly.
#pragma once
#include <string>

#include "../group_norm/group_norm.h"

namespace gnext {

// ActKind of an activation name; raises (naming `op`) on an unknown one.
int parse_activation(const char* op, c10::string_view activation);

}  // namespace gnext
