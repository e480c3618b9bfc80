# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm + activation (+ residual): out = act(GroupNorm(x)) + residual; and its backward.
The op's fake (meta) kernels, CPU kernels and autograd formulas; its schema is in csrc/gnext.cpp and its CUDA
kernels in csrc/. groupnorm_ext/_registry.py imports this module, which registers them."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import (_group_norm, _group_norm_backward, _normalized, act_backward, apply_act, check_group_norm_args,
                     check_group_norm_backward_args, check_residual, parse_activation)
from .._library import memory_format as _memory_format
from .group_norm import _group_norm_backward_fake, _group_norm_fake


# Fake kernels

@torch.library.register_fake("gnext::group_norm_act")
def _group_norm_act_fake(input, num_groups, weight, bias, eps, activation, residual):
    torch._check(residual is None or residual.shape == input.shape,
                 lambda: f"gnext.group_norm_act: residual.shape={tuple(residual.shape)} must equal input.shape")
    return _group_norm_fake(input, num_groups, weight, bias, eps)


@torch.library.register_fake("gnext::group_norm_act_backward")
def _group_norm_act_backward_fake(grad_out, input, mean, rstd, weight, bias, num_groups, activation, output_mask):
    return _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask)


# CPU kernels

def group_norm_act(input, num_groups, weight, bias, eps, activation, residual):
    op = "gnext.group_norm_act"
    act = parse_activation(op, activation)
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_residual(op, input, residual)
    n, mean, rstd = _group_norm(op, input, num_groups, weight, bias, eps)
    out = apply_act(n, act)
    if residual is not None:
        out = out + residual
    return out.contiguous(memory_format=_memory_format(input)), mean, rstd


def group_norm_act_backward(grad_out, input, mean, rstd, weight, bias, num_groups, activation, output_mask):
    op = "gnext.group_norm_act_backward"
    act = parse_activation(op, activation)
    s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups)
    if bias is not None:
        check_group_norm_args(op, input, num_groups, weight, bias)
    dn = grad_out
    if act != "identity" and input.numel() > 0:
        n = _normalized(input.float().contiguous(), s, mean, rstd, weight, bias)
        dn = act_backward(grad_out.float().contiguous(), n, act).to(input.dtype)
    return _group_norm_backward(op, dn, input, mean, rstd, weight, num_groups, output_mask)


# Autograd

# group_norm_act(input, num_groups, weight, bias, eps, activation, residual) -> (out, mean, rstd)
def _act_save(ctx, inputs, output):
    input, num_groups, weight, bias, _, activation, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _act_grads(ctx, need, grad_out):
    input, weight, bias, mean, rstd = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 7
    dres = grad_out if need[6] else None  # the residual's gradient is grad_out itself
    mask = [need[0], need[2], need[3]]
    if not any(mask):
        return None, None, None, None, None, None, dres
    dx, dw, db = _call_backward(torch.ops.gnext.group_norm_act_backward.default, grad_out, input, mean, rstd, weight,
                                bias, ctx.num_groups, ctx.activation, mask)
    return dx, None, dw, _cast(db, ctx.bias_dtype), None, None, dres


_cpu.register(group_norm_act, group_norm_act_backward)
_autograd.register("group_norm_act", _act_save, _act_grads)
