// SPDX-License-Identifier: BSD-3-Clause
// Pointwise extensions of the GroupNorm kernels (host and device code), chosen at compile time:
//  * an input prologue: normalize a = act(x + bias[c]) instead of x (the fused ConvTranspose2d +
//    GELU + GroupNorm op feeds the conv output);
//  * an output epilogue: out = act(GroupNorm(x)) [+ residual] (group_norm_act).
// At most one of the two per kernel: the kernels take one template "mode" (pw_mode), which keeps the
// number of instantiations at kPwModes per kernel. Device formulas: device_utils.cuh.
#pragma once

namespace gnext {

enum PreKind : int {
  kPreNone = 0,
  kPreBiasGelu = 1,      // GELU, erf form (F.gelu approximate='none')
  kPreBiasGeluTanh = 2,  // GELU, tanh approximation (approximate='tanh')
};

enum ActKind : int {
  kActIdentity = 0,
  kActSilu = 1,
  kActGelu = 2,
  kActGeluTanh = 3,
  kActRelu = 4,
  kActTanh = 5,
  kActHardswish = 6,
  kActTanhHardswish = 7,  // hardswish(tanh(x)), KernelBench L2#92
  kActCount = 8,
};

// Kernel mode: prologue kinds 0..2, then 2 + act for activations 1..7.
constexpr int kPwModes = 3 + kActCount - 1;
constexpr int pw_mode(int pre, int act) { return act == kActIdentity ? pre : 2 + act; }
constexpr int pw_pre(int mode) { return mode <= kPreBiasGeluTanh ? mode : kPreNone; }
constexpr int pw_act(int mode) { return mode <= kPreBiasGeluTanh ? kActIdentity : mode - 2; }

}  // namespace gnext
