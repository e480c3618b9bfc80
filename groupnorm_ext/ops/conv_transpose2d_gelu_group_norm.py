# SPDX-License-Identifier: BSD-3-Clause
"""ConvTranspose2d + GELU + GroupNorm (KernelBench L2#19); and its backward.
The op's fake (meta) kernels, CPU kernels and autograd formulas; its schema is in csrc/gnext.cpp and its CUDA
kernels in csrc/. groupnorm_ext/_registry.py imports this module, which registers them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import _gelu_approximate, _group_norm, _group_norm_backward, check_conv_args


# Fake kernels

def _suggest_format(t: torch.Tensor) -> torch.memory_format:
    """at::Tensor::suggest_memory_format for 4-D tensors (the C++ op makes its outputs dense in it)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _fused_compute_format(input: torch.Tensor) -> torch.memory_format:
    """kFormat in csrc/conv_gelu_gn/conv_gelu_gn_cuda.cpp (channels_last) on CUDA; the input's on the CPU."""
    return torch.channels_last if input.device.type == "cuda" else _suggest_format(input)


def _fused_out_format(input: torch.Tensor) -> torch.memory_format:
    """The layout of the fused op's output: the input's (on CUDA, channels_last where the input is dense in
    channels_last, else NCHW: out_is_nchw in csrc/conv_gelu_gn/conv_gelu_gn_cuda.cpp)."""
    if input.device.type == "cuda":
        return torch.channels_last if input.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    return _suggest_format(input)


@torch.library.register_fake("gnext::conv_transpose2d_gelu_group_norm")
def _conv_transpose2d_gelu_group_norm_fake(input, weight, conv_bias, stride, padding, output_padding, dilation,
                                           groups, num_groups, gn_weight, gn_bias, eps, approximate):
    torch._check(input.dim() == 4, lambda: f"gnext.conv_transpose2d_gelu_group_norm: input must be 4-D, got {input.dim()}")
    torch._check(approximate in ("none", "tanh"), lambda: f"approximate must be 'none' or 'tanh', got {approximate!r}")
    N, H, W = input.shape[0], input.shape[2], input.shape[3]
    c_out = weight.shape[1] * groups
    torch._check(num_groups > 0 and c_out % num_groups == 0,
                 lambda: f"C_out={c_out} must be divisible by num_groups={num_groups}")
    kh, kw = weight.shape[2], weight.shape[3]
    ho = (H - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + output_padding[0] + 1
    wo = (W - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + output_padding[1] + 1
    z = torch.empty((N, c_out, ho, wo), dtype=input.dtype, device=input.device,
                    memory_format=_fused_compute_format(input))
    stats = input.new_empty((N, num_groups), dtype=torch.float32)
    # input_cl: the CUDA op's channels_last copy of an input not dense in channels_last; else (0,)
    if input.device.type == "cuda" and not input.is_contiguous(memory_format=torch.channels_last):
        input_cl = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=torch.channels_last)
    else:
        input_cl = input.new_empty((0,))
    out = torch.empty(z.shape, dtype=z.dtype, device=z.device, memory_format=_fused_out_format(input))
    return out, z, stats, torch.empty_like(stats), input_cl


@torch.library.register_fake("gnext::conv_transpose2d_gelu_group_norm_backward")
def _conv_transpose2d_gelu_group_norm_backward_fake(grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight,
                                                    stride, padding, output_padding, dilation, groups, num_groups,
                                                    approximate, output_mask):
    def like(t, fmt=None):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt or torch.contiguous_format)

    c_out = z.shape[1]
    pdtype = gn_weight.dtype if gn_weight is not None else z.dtype
    return (
        like(input, _fused_compute_format(input)) if output_mask[0] else None,
        like(weight, _suggest_format(weight)) if output_mask[1] else None,
        like(conv_bias) if output_mask[2] and conv_bias is not None else None,
        z.new_empty((c_out,), dtype=pdtype) if output_mask[3] else None,
        z.new_empty((c_out,), dtype=pdtype) if output_mask[4] else None,
    )


# CPU kernels

def _conv_format(input):
    """The input's own layout (channels_last stays channels_last) on the CPU."""
    if input.dim() == 4 and not input.is_contiguous() and input.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _bias_gelu(z, conv_bias, approximate):
    u = z + conv_bias.view(1, -1, 1, 1) if conv_bias is not None else z
    return F.gelu(u, approximate=approximate), u


def conv_transpose2d_gelu_group_norm(input, weight, conv_bias, stride, padding, output_padding, dilation, groups,
                                     num_groups, gn_weight, gn_bias, eps, approximate):
    op = "gnext.conv_transpose2d_gelu_group_norm"
    check_conv_args(op, input, weight, conv_bias, stride, padding, output_padding, dilation, groups)
    approximate = _gelu_approximate(op, approximate)
    fmt = _conv_format(input)
    z = F.conv_transpose2d(input.contiguous(memory_format=fmt), weight, None, stride, padding, output_padding,
                           groups, dilation).contiguous(memory_format=fmt)
    a, _ = _bias_gelu(z, conv_bias, approximate)
    out, mean, rstd = _group_norm(op, a, num_groups, gn_weight, gn_bias, eps)
    return out, z, mean, rstd, input.new_empty((0,))  # input_cl: the CPU keeps the input's layout


def conv_transpose2d_gelu_group_norm_backward(grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight, stride,
                                              padding, output_padding, dilation, groups, num_groups, approximate,
                                              output_mask):
    op = "gnext.conv_transpose2d_gelu_group_norm_backward"
    check_conv_args(op, input, weight, conv_bias, stride, padding, output_padding, dilation, groups)
    approximate = _gelu_approximate(op, approximate)
    need_dz = output_mask[0] or output_mask[1] or (output_mask[2] and conv_bias is not None)
    a, u = _bias_gelu(z, conv_bias, approximate)
    da, dgw, dgb = _group_norm_backward(op, grad_out, a, mean, rstd, gn_weight, num_groups,
                                        [need_dz, output_mask[3], output_mask[4]])
    dz = torch.ops.aten.gelu_backward(da, u, approximate=approximate) if da is not None else None
    dinput = dweight = dbias = None
    if output_mask[2] and conv_bias is not None:
        dbias = dz.sum((0, 2, 3), dtype=torch.float32).to(conv_bias.dtype)
    if output_mask[0] or output_mask[1]:
        fmt = _conv_format(input)
        gi, gw, _ = torch.ops.aten.convolution_backward(
            dz.contiguous(memory_format=fmt), input.contiguous(memory_format=fmt), weight, None, stride, padding,
            dilation, True, output_padding, groups, [output_mask[0], output_mask[1], False])
        if output_mask[0]:
            dinput = gi.contiguous(memory_format=fmt)
        if output_mask[1]:
            dweight = gw.contiguous(memory_format=_conv_format(weight))
    return dinput, dweight, dbias, dgw, dgb


# Autograd

# conv_transpose2d_gelu_group_norm(input, weight, conv_bias, stride, padding, output_padding, dilation, groups,
#   num_groups, gn_weight, gn_bias, eps, approximate) -> (out, z, mean, rstd, input_cl)
def _conv_save(ctx, inputs, output):
    (input, weight, conv_bias, stride, padding, output_padding, dilation, groups, num_groups, gn_weight, gn_bias, _,
     approximate) = inputs
    _, z, mean, rstd, input_cl = output
    # The backward gets the forward's channels_last copy of the input where it made one (the weight
    # gradient reads it; the input itself is not needed), so the input is not transposed twice.
    if input_cl.dim() == input.dim():
        input = input_cl
    ctx.save_for_backward(input, weight, conv_bias, z, mean, rstd, gn_weight)
    ctx.args = (stride, padding, output_padding, dilation, groups, num_groups, approximate)
    ctx.gn_bias_dtype = gn_bias.dtype if gn_bias is not None else None


def _conv_grads(ctx, need, grad_out):
    input, weight, conv_bias, z, mean, rstd, gn_weight = ctx.saved_tensors
    mask = [need[0], need[1], need[2], need[9], need[10]]
    if grad_out is None or not any(mask):
        return (None,) * 13
    stride, padding, output_padding, dilation, groups, num_groups, approximate = ctx.args
    di, dw, db, dgw, dgb = _call_backward(
        torch.ops.gnext.conv_transpose2d_gelu_group_norm_backward.default,
        grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight, stride, padding, output_padding, dilation,
        groups, num_groups, approximate, mask)
    return di, dw, db, None, None, None, None, None, None, dgw, _cast(dgb, ctx.gn_bias_dtype), None, None


_cpu.register(conv_transpose2d_gelu_group_norm, conv_transpose2d_gelu_group_norm_backward)
_autograd.register("conv_transpose2d_gelu_group_norm", _conv_save, _conv_grads)
