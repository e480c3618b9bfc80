# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm + activation (+ residual): out = act(GroupNorm(x + input_bias[c])) + residual; and its backward.
The op's fake (meta) kernels, CPU kernels and autograd formulas; its schema is in csrc/gnext.cpp and its CUDA
kernels in csrc/. groupnorm_ext/_registry.py imports this module, which registers them. input_bias is the bias of
the convolution that wrote x, run without it (the compile pass moves it here): the backward runs on x + input_bias
and input_bias's gradient is the input's, summed per channel."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import (_group_norm_backward, _normalized, act_backward, apply_act, biased_input, check_group_norm_args,
                     check_group_norm_backward_args, check_input_bias, check_residual, group_norm_of_biased,
                     input_bias_grad, parse_activation)
from .._library import memory_format as _memory_format
from .group_norm import _group_norm_backward_fake, _group_norm_fake


# Fake kernels

@torch.library.register_fake("gnext::group_norm_act")
def _group_norm_act_fake(input, num_groups, weight, bias, eps, activation, residual, input_bias=None):
    torch._check(residual is None or residual.shape == input.shape,
                 lambda: f"gnext.group_norm_act: residual.shape={tuple(residual.shape)} must equal input.shape")
    check_input_bias("gnext.group_norm_act", input, input_bias)
    return _group_norm_fake(input, num_groups, weight, bias, eps)


@torch.library.register_fake("gnext::group_norm_act_backward")
def _group_norm_act_backward_fake(grad_out, input, mean, rstd, weight, bias, num_groups, activation, output_mask):
    return _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask)


# CPU kernels

def group_norm_act(input, num_groups, weight, bias, eps, activation, residual, input_bias=None):
    op = "gnext.group_norm_act"
    act = parse_activation(op, activation)
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_residual(op, input, residual)
    check_input_bias(op, input, input_bias)
    n, mean, rstd = group_norm_of_biased(op, input, num_groups, weight, bias, eps, input_bias)
    out = apply_act(n, act, inplace=True)
    if residual is not None:
        out = out.add_(residual)
    return out.to(input.dtype).contiguous(memory_format=_memory_format(input)), mean, rstd


def group_norm_act_backward(grad_out, input, mean, rstd, weight, bias, num_groups, activation, output_mask):
    op = "gnext.group_norm_act_backward"
    act = parse_activation(op, activation)
    s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups)
    if bias is not None:
        check_group_norm_args(op, input, num_groups, weight, bias)
    dn = grad_out
    if act != "identity" and input.numel() > 0:
        n = _normalized(input.float(), s, mean, rstd, weight, bias)  # in input's layout
        dn = act_backward(grad_out.float(), n, act, out=n).to(input.dtype)
    return _group_norm_backward(op, dn, input, mean, rstd, weight, num_groups, output_mask)


# Autograd

# group_norm_act(input, num_groups, weight, bias, eps, activation, residual, input_bias) -> (out, mean, rstd)
def _act_save(ctx, inputs, output):
    input, num_groups, weight, bias, _, activation = inputs[:6]
    input_bias = inputs[7] if len(inputs) > 7 else None
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd, input_bias)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _act_grads(ctx, need, grad_out):
    input, weight, bias, mean, rstd, input_bias = ctx.saved_tensors
    extra = (None,) * (len(need) - 7)  # input_bias's slot, where the call passed it
    if grad_out is None:
        return (None,) * len(need)
    dres = grad_out if need[6] else None  # the residual's gradient is grad_out itself
    need_b = len(need) > 7 and need[7]
    mask = [need[0] or need_b, need[2], need[3]]
    if not any(mask):
        return (None, None, None, None, None, None, dres) + extra
    input = biased_input(input, input_bias)  # GroupNorm of x + b: its backward in terms of x + b
    dx, dw, db = _call_backward(torch.ops.gnext.group_norm_act_backward.default, grad_out, input, mean, rstd, weight,
                                bias, ctx.num_groups, ctx.activation, mask)
    dib = (input_bias_grad(dx, input_bias),) if need_b else extra
    return (dx if need[0] else None), None, dw, _cast(db, ctx.bias_dtype), None, None, dres, *dib


_cpu.register(group_norm_act, group_norm_act_backward)
_autograd.register("group_norm_act", _act_save, _act_grads)
_autograd.register_no_autograd("group_norm_act", _group_norm_act_fake, group_norm_act)
_autograd.register_no_autograd("group_norm_act_backward", _group_norm_act_backward_fake, group_norm_act_backward)
