"""Loads the compiled library (registers torch.ops.gnext.*) and adds, from Python, what every
op needs for torch.compile: fake (meta) kernels and autograd formulas."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loading the library runs TORCH_LIBRARY(gnext, ...))

ops = torch.ops.gnext


def _memory_format(input: torch.Tensor) -> torch.memory_format:
    """Same rule as group_norm_memory_format in csrc/group_norm/group_norm.h."""
    if input.is_contiguous():
        return torch.contiguous_format
    if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


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


def _group_norm_setup_context(ctx, inputs, output):
    input, num_groups, weight, bias, _eps = inputs
    _out, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(input, weight, mean, rstd)
    ctx.num_groups = num_groups
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _group_norm_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    input, weight, mean, rstd = ctx.saved_tensors
    mask = [
        ctx.needs_input_grad[0],
        weight is not None and ctx.needs_input_grad[2],
        ctx.bias_dtype is not None and ctx.needs_input_grad[3],
    ]
    if grad_out is None or not any(mask):
        return None, None, None, None, None
    dx, dw, db = ops.group_norm_backward(grad_out, input, mean, rstd, weight, ctx.num_groups, mask)
    if db is not None and db.dtype != ctx.bias_dtype:
        db = db.to(ctx.bias_dtype)
    return dx, None, dw, db, None


torch.library.register_autograd(
    "gnext::group_norm", _group_norm_backward, setup_context=_group_norm_setup_context
)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("gnext.group_norm_backward: double backward (gradient of the gradient) is not implemented")


torch.library.register_autograd(
    "gnext::group_norm_backward", _no_double_backward, setup_context=lambda ctx, inputs, output: None
)
