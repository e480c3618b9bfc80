# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm with a spatial modulation, then an activation: out = act(GroupNorm(x) * scale + shift), scale and shift
tensors of x's shape (a spatially conditioned norm: CogVideoX's decoder convolves both from the latents, Zhu et al.
2022, "MoVQ"). The op's fake kernel, CPU kernel and autograd; its schema is in csrc/gnext.cpp and its CUDA kernels
(the statistics pass, then one pass that reads x, scale and shift and writes out) in
csrc/group_norm/group_norm_modulate.cu. The backward recomputes n = GroupNorm(x) from mean/rstd, takes
dy' = dy * act'(n * scale + shift), returns dscale = dy' * n and dshift = dy', and runs GroupNorm's backward on
dy' * scale."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import _group_norm, act_backward, apply_act, check_group_norm_args, check_same_as_input, \
    parse_activation


def check_modulation(op, input, scale, shift):
    """scale and shift: input's shape, dtype and device (as the CUDA op checks them)."""
    check_same_as_input(op, "scale", scale, input)
    check_same_as_input(op, "shift", shift, input)


@torch.library.register_fake("gnext::group_norm_act_modulate")
def _modulate_fake(input, num_groups, weight, bias, eps, scale, shift, activation):
    op = "gnext.group_norm_act_modulate"
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_modulation(op, input, scale, shift)
    N, G = input.shape[0], num_groups
    return (input.new_empty(input.shape), input.new_empty((N, G), dtype=torch.float32),
            input.new_empty((N, G), dtype=torch.float32))


def group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation):
    op = "gnext.group_norm_act_modulate"
    act = parse_activation(op, activation)
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_modulation(op, input, scale, shift)
    n, mean, rstd = _group_norm(op, input, num_groups, weight, bias, eps)
    out = apply_act(torch.addcmul(shift.float(), n.float(), scale.float()), act)
    return out.to(input.dtype).contiguous(), mean, rstd


# group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation) -> (out, mean, rstd)
def _modulate_save(ctx, inputs, output):
    input, num_groups, weight, bias, _, scale, shift, activation = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, scale, shift, mean, rstd)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _modulate_grads(ctx, need, grad_out):
    """In the input's dtype, as eager autograd computes the same chain: float32 copies of these full-size tensors
    were 3x slower (docs/decisions/modulated-output.md)."""
    input, weight, bias, scale, shift, mean, rstd = ctx.saved_tensors
    none = (None,) * 8
    if grad_out is None or not any(need):
        return none
    # n = GroupNorm(x) (with its affine), recomputed from mean/rstd.
    n = _call_backward(torch.ops.gnext.group_norm_act_apply.default, input, mean, rstd, ctx.num_groups, weight, bias,
                       "identity", None)
    g = grad_out
    if ctx.activation != "identity":
        g = act_backward(g.contiguous(), torch.addcmul(shift, n, scale), ctx.activation)
    dscale = g * n if need[5] else None
    dshift = g if need[6] else None
    mask = [need[0], need[2], need[3]]
    dx = dw = db = None
    if any(mask):
        dx, dw, db = _call_backward(torch.ops.gnext.group_norm_backward.default, g * scale, input, mean, rstd, weight,
                                    ctx.num_groups, mask)
    return dx, None, dw, _cast(db, ctx.bias_dtype), None, dscale, dshift, None


_cpu.register(group_norm_act_modulate)
_autograd.register("group_norm_act_modulate", _modulate_save, _modulate_grads, backward_op=False)
