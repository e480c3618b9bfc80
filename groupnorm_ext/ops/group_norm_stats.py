# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm statistics alone: mean[n, g] and rstd[n, g] = 1 / sqrt(var + eps), var the biased variance of the
group (Wu & He 2018), (N, G) float32. The input is read once and nothing is written but the statistics (the
first half of the two-pass forward; groupnorm_ext.distributed merges them across ranks).
Its fake and CPU kernels; the schema is in csrc/gnext.cpp and the CUDA kernel in csrc/group_norm/. No autograd:
its outputs' backward raises."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._cpu import _group_norm, check_group_norm_args


@torch.library.register_fake("gnext::group_norm_stats")
def _group_norm_stats_fake(input, num_groups, eps):
    torch._check(input.dim() >= 2, lambda: f"gnext.group_norm_stats: input must have at least 2 dims, got {input.dim()}")
    torch._check(num_groups > 0 and input.shape[1] % num_groups == 0,
                 lambda: f"gnext.group_norm_stats: num_channels C={input.shape[1]} must be divisible by "
                         f"num_groups={num_groups}")
    stats = input.new_empty((input.shape[0], num_groups), dtype=torch.float32)
    return stats, torch.empty_like(stats)


def group_norm_stats(input, num_groups, eps):
    op = "gnext.group_norm_stats"
    check_group_norm_args(op, input, num_groups, None, None)
    _, mean, rstd = _group_norm(op, input, num_groups, None, None, eps)
    return mean, rstd


_cpu.register(group_norm_stats)
_autograd.register_not_differentiable("group_norm_stats")
