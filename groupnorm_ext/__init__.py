# SPDX-License-Identifier: BSD-3-Clause
"""gnext: fast GroupNorm for PyTorch on NVIDIA GPUs.

Importing this package loads the compiled library, which registers

* ``torch.ops.gnext.group_norm(input, num_groups, weight, bias, eps) -> (out, mean, rstd)``
* ``torch.ops.gnext.group_norm_backward(grad_out, input, mean, rstd, weight, num_groups, output_mask)``
* ``torch.ops.gnext.conv_transpose2d_gelu_group_norm(...)`` and its ``..._backward`` (KernelBench L2#19)
* ``torch.ops.gnext.group_norm_act(input, num_groups, weight, bias, eps, activation, residual)`` and its backward
* ``torch.ops.gnext.group_norm_act_pad(input, num_groups, weight, bias, eps, activation, pad, mode, value,
  input_bias=None)``: ``F.pad(act(GroupNorm(input + input_bias[c])), pad, mode, value)`` written in one pass after
  the statistics
* ``torch.ops.gnext.group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation,
  input_bias=None)``: ``act(GroupNorm(input + input_bias[c]) * scale + shift)`` with tensor scale and shift, full
  size or of smaller (h, w) read by nearest upsampling (a spatially conditioned norm);
  ``group_norm_act_modulate_into(..., out)`` writes it into ``out``; ``group_norm_act_modulate_cat(..., frames,
  cache)`` returns it behind ``frames`` frames along dim 2 (the cache, or copies of its first frame)
* ``torch.ops.gnext.group_norm_act_logsumexp(input, input_bias, num_groups, weight, bias, eps, activation,
  residual)`` and its backward (KernelBench L2#92 after the conv)

``enable_aten_kernels()`` also gives PyTorch's own ``aten::native_group_norm`` (and its backward) gnext's
CUDA kernels, so ``F.group_norm`` / ``nn.GroupNorm`` models use them unedited (``aten_kernels.py``).

Each op has CUDA kernels (C++ on PyTorch's stable ABI: one build loads on every torch >= 2.11), CPU kernels
fake kernels and autograd (one module per op: ``ops/<op>.py``).
"""
from ._registry import ops
from ._library import set_tuning, tuning
from .functional import (conv_transpose2d_gelu_group_norm, group_norm, group_norm_act, group_norm_act_logsumexp,
                         group_norm_act_modulate, group_norm_act_pad)
from .compile_fusion import disable_compile_fusion, enable_compile_fusion
from .aten_kernels import aten_kernels, aten_kernels_enabled, disable_aten_kernels, enable_aten_kernels
from .modules import ConvTranspose2dGELUGroupNorm, GroupNorm, GroupNormAct
from .convert import convert_conv_transpose_gelu_group_norm, convert_group_norm, convert_group_norm_act

__all__ = ["ops", "group_norm", "GroupNorm", "convert_group_norm", "conv_transpose2d_gelu_group_norm",
           "ConvTranspose2dGELUGroupNorm", "convert_conv_transpose_gelu_group_norm", "group_norm_act", "GroupNormAct",
           "convert_group_norm_act", "group_norm_act_logsumexp", "group_norm_act_pad", "group_norm_act_modulate",
           "enable_compile_fusion", "disable_compile_fusion",
           "enable_aten_kernels", "disable_aten_kernels", "aten_kernels_enabled", "aten_kernels", "tuning", "set_tuning"]
__version__ = "0.2.0"
