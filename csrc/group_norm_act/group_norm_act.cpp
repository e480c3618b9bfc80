// SPDX-License-Identifier: BSD-3-Clause
// group_norm_act: activation names (the CUDA registration is in group_norm_act_cuda.cpp; CPU kernels
// and autograd are in groupnorm_ext/_cpu.py and _autograd.py).
#include "group_norm_act.h"

#include <utility>

namespace gnext {

namespace {
constexpr std::pair<const char*, int> kActivations[] = {
    {"identity", kActIdentity}, {"silu", kActSilu},   {"gelu", kActGelu},           {"gelu_tanh", kActGeluTanh},
    {"relu", kActRelu},         {"tanh", kActTanh},   {"hardswish", kActHardswish}, {"tanh_hardswish", kActTanhHardswish},
};
}  // namespace

int parse_activation(const char* op, std::string_view activation) {
  for (const auto& [name, kind] : kActivations)
    if (activation == name) return kind;
  fail(op, ": activation must be one of identity, silu, gelu, gelu_tanh, relu, tanh, hardswish, tanh_hardswish; got '",
       activation, "'");
}

}  // namespace gnext
