# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm: out = (x - mean[n, g]) * rstd[n, g] * weight[c] + bias[c] (Wu & He 2018), mean/rstd (N, G)
float32; and its backward.
The op's fake (meta) kernels, CPU kernels and autograd formulas; its schema is in csrc/gnext.cpp and its CUDA
kernels in csrc/. groupnorm_ext/_registry.py imports this module, which registers them."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import _group_norm, _group_norm_backward
from .._library import memory_format as _memory_format


# Fake kernels

def _empty_like_input(input: torch.Tensor) -> torch.Tensor:
    return torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=_memory_format(input))


@torch.library.register_fake("gnext::group_norm")
def _group_norm_fake(input, num_groups, weight, bias, eps):
    torch._check(input.dim() >= 2, lambda: f"gnext.group_norm: input must have at least 2 dims, got {input.dim()}")
    torch._check(num_groups > 0, lambda: f"gnext.group_norm: num_groups must be positive, got {num_groups}")
    torch._check(
        input.shape[1] % num_groups == 0,
        lambda: f"gnext.group_norm: num_channels C={input.shape[1]} must be divisible by num_groups={num_groups}",
    )
    stats = input.new_empty((input.shape[0], num_groups), dtype=torch.float32)
    return _empty_like_input(input), stats, torch.empty_like(stats)


@torch.library.register_fake("gnext::group_norm_backward")
def _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask):
    pdtype = weight.dtype if weight is not None else input.dtype
    C = input.shape[1]
    dx = _empty_like_input(input) if output_mask[0] else None
    dw = input.new_empty((C,), dtype=pdtype) if output_mask[1] else None
    db = input.new_empty((C,), dtype=pdtype) if output_mask[2] else None
    return dx, dw, db


# CPU kernels

def group_norm(input, num_groups, weight, bias, eps):
    return _group_norm("gnext.group_norm", input, num_groups, weight, bias, eps)


def group_norm_backward(grad_out, input, mean, rstd, weight, num_groups, output_mask):
    return _group_norm_backward("gnext.group_norm_backward", grad_out, input, mean, rstd, weight, num_groups,
                                output_mask)


# Autograd

# group_norm(input, num_groups, weight, bias, eps) -> (out, mean, rstd)
def _gn_save(ctx, inputs, output):
    input, num_groups, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, mean, rstd)
    ctx.num_groups = num_groups
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _gn_grads(ctx, need, grad_out):
    input, weight, mean, rstd = ctx.saved_tensors
    mask = [need[0], need[2], need[3]]
    if grad_out is None or not any(mask):
        return None, None, None, None, None
    dx, dw, db = _call_backward(torch.ops.gnext.group_norm_backward.default, grad_out, input, mean, rstd, weight,
                                ctx.num_groups, mask)
    return dx, None, dw, _cast(db, ctx.bias_dtype), None


_cpu.register(group_norm, group_norm_backward)
_autograd.register("group_norm", _gn_save, _gn_grads)
_autograd.register_no_autograd("group_norm", _group_norm_fake, group_norm)
_autograd.register_no_autograd("group_norm_backward", _group_norm_backward_fake, group_norm_backward)
