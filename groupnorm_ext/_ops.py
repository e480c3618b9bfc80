"""Loads the compiled library, which registers torch.ops.gnext.* with CPU, CUDA and autograd
(C++, csrc/group_norm/group_norm_autograd.cpp) kernels, and adds the fake (meta) kernels that
torch.compile and torch.library.opcheck trace with."""
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
