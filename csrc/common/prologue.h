// Kinds of input prologue of the GroupNorm kernels (host and device code): the kernels normalize
// a = act(x + bias[c]) instead of x. Device formulas: pre_apply / pre_apply_grad in device_utils.cuh.
#pragma once

namespace gnext {

enum PreKind : int {
  kPreNone = 0,
  kPreBiasGelu = 1,      // GELU, erf form (F.gelu approximate='none')
  kPreBiasGeluTanh = 2,  // GELU, tanh approximation (approximate='tanh')
};

}  // namespace gnext
