# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm + activation + logsumexp over channels (KernelBench L2#92); and its backward.
The op's fake (meta) kernels, CPU kernels and autograd formulas; its schema is in csrc/gnext.cpp and its CUDA
kernels in csrc/. groupnorm_ext/_registry.py imports this module, which registers them."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import (_check, _group_norm, _group_norm_backward, _normalized, _param_grad_dtype, act_backward,
                     apply_act, check_lse_args, check_lse_backward_args, parse_activation)
from .._library import memory_format as _memory_format
from .group_norm import _group_norm_backward_fake, _group_norm_fake


# Fake kernels

@torch.library.register_fake("gnext::group_norm_act_logsumexp")
def _group_norm_act_logsumexp_fake(input, input_bias, num_groups, weight, bias, eps, activation, residual):
    torch._check(input_bias is None or tuple(input_bias.shape) == (input.shape[1],),
                 lambda: f"gnext.group_norm_act_logsumexp: input_bias must have shape (C,), got "
                         f"{tuple(input_bias.shape)}")
    _, mean, rstd = _group_norm_fake(input, num_groups, weight, bias, eps)
    out = input.new_empty((input.shape[0], 1, *input.shape[2:]))
    return out, mean, rstd


@torch.library.register_fake("gnext::group_norm_act_logsumexp_backward")
def _group_norm_act_logsumexp_backward_fake(grad_out, out, input, input_bias, mean, rstd, weight, bias, num_groups,
                                            activation, residual, output_mask):
    dx, dw, db = _group_norm_backward_fake(input, input, mean, rstd, weight, num_groups,
                                           [output_mask[0], output_mask[2], output_mask[3]])
    dib = input_bias.new_empty((input.shape[1],)) if output_mask[1] and input_bias is not None else None
    return dx, dib, dw, db


# CPU kernels

def _biased_float(input, input_bias):
    v = input.float()
    if input_bias is None:
        return v
    shape = [1] * input.dim()
    shape[1] = input.shape[1]
    return v + input_bias.float().view(shape)


def _float_or_none(t):
    return None if t is None else t.float()


def _residual_act(v, s, mean, rstd, weight, bias, act, residual):
    n = _normalized(v.contiguous(), s, mean, rstd, weight, bias)
    r = apply_act(n, act)
    return (r + v if residual else r), n


def group_norm_act_logsumexp(input, input_bias, num_groups, weight, bias, eps, activation, residual):
    op = "gnext.group_norm_act_logsumexp"
    s = check_lse_args(op, input, input_bias, num_groups, weight, bias)
    act = parse_activation(op, activation)
    v = _biased_float(input, input_bias)
    _, mean, rstd = _group_norm(op, v, num_groups, _float_or_none(weight), _float_or_none(bias), eps)
    r, _ = _residual_act(v, s, mean, rstd, weight, bias, act, residual)
    return torch.logsumexp(r, 1, keepdim=True).to(input.dtype).contiguous(), mean, rstd


def group_norm_act_logsumexp_backward(grad_out, out, input, input_bias, mean, rstd, weight, bias, num_groups,
                                      activation, residual, output_mask):
    op = "gnext.group_norm_act_logsumexp_backward"
    s = check_lse_args(op, input, input_bias, num_groups, weight, bias)
    check_lse_backward_args(op, s, input, grad_out, out, mean, rstd)
    act = parse_activation(op, activation)
    _check(not output_mask[1] or input_bias is not None,
           f"{op}: grad of input_bias requested without input_bias")
    v = _biased_float(input, input_bias)
    r, n = _residual_act(v, s, mean, rstd, weight, bias, act, residual)
    dr = grad_out.float() * torch.exp(r - out.float())
    dn = act_backward(dr, n, act, out=n)
    dv, dw, db = _group_norm_backward(op, dn, v, mean, rstd, _float_or_none(weight), num_groups,
                                      [output_mask[0] or output_mask[1], output_mask[2], output_mask[3]])
    dx = dib = None
    if output_mask[0] or output_mask[1]:
        d = dv + dr if residual else dv
        if output_mask[1]:
            dims = [i for i in range(input.dim()) if i != 1]
            dib = d.sum(dims).to(input_bias.dtype)
        if output_mask[0]:
            dx = d.to(input.dtype).contiguous(memory_format=_memory_format(input))
    pdtype = _param_grad_dtype(input, weight)
    return dx, dib, None if dw is None else dw.to(pdtype), None if db is None else db.to(pdtype)


# Autograd

# group_norm_act_logsumexp(input, input_bias, num_groups, weight, bias, eps, activation, residual)
#   -> (out, mean, rstd)
def _lse_save(ctx, inputs, output):
    input, input_bias, num_groups, weight, bias, _, activation, residual = inputs
    out, mean, rstd = output
    ctx.save_for_backward(input, input_bias, weight, bias, out, mean, rstd)
    ctx.num_groups, ctx.activation, ctx.residual = num_groups, activation, residual
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _lse_grads(ctx, need, grad_out):
    input, input_bias, weight, bias, out, mean, rstd = ctx.saved_tensors
    mask = [need[0], need[1], need[3], need[4]]
    if grad_out is None or not any(mask):
        return (None,) * 8
    dx, dib, dw, db = _call_backward(
        torch.ops.gnext.group_norm_act_logsumexp_backward.default,
        grad_out, out, input, input_bias, mean, rstd, weight, bias, ctx.num_groups, ctx.activation, ctx.residual,
        mask)
    return dx, dib, None, dw, _cast(db, ctx.bias_dtype), None, None, None


_cpu.register(group_norm_act_logsumexp, group_norm_act_logsumexp_backward)
_autograd.register("group_norm_act_logsumexp", _lse_save, _lse_grads)
