# SPDX-License-Identifier: BSD-3-Clause
"""Moments of the shards of one tensor split over ranks, and their merge (groupnorm_ext.distributed):
  * group_norm_moments(input, num_groups): (3, N, G) float64 (count, mean, M2) per (n, g) of this shard, M2 the sum
    of squared deviations from the shard's mean; the input is read once and nothing else is written;
  * group_norm_moments_merge(moments, eps): the ranks' moments gathered into (world, 3, N, G) merged by Chan's
    formula (Chan, Golub & LeVeque 1979): count = sum c_i, mean = sum c_i m_i / count,
    M2 = sum M2_i + c_i (m_i - mean)^2; returns mean and rstd = 1/sqrt(M2/count + eps) (N, G) float32 (Wu & He
    2018's statistics of the whole tensor) and count (N, G) float64.
Their fake and CPU kernels; the schemas are in csrc/gnext.cpp and the CUDA kernels in csrc/group_norm/. No autograd:
their outputs' backward raises."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._cpu import check_group_norm_args


@torch.library.register_fake("gnext::group_norm_moments")
def _moments_fake(input, num_groups):
    torch._check(input.dim() >= 2, lambda: f"gnext.group_norm_moments: input must have at least 2 dims, got "
                                           f"{input.dim()}")
    torch._check(num_groups > 0 and input.shape[1] % num_groups == 0,
                 lambda: f"gnext.group_norm_moments: num_channels C={input.shape[1]} must be divisible by "
                         f"num_groups={num_groups}")
    return input.new_empty((3, input.shape[0], num_groups), dtype=torch.float64)


@torch.library.register_fake("gnext::group_norm_moments_merge")
def _merge_fake(moments, eps):
    torch._check(moments.dim() == 4 and moments.shape[1] == 3 and moments.dtype == torch.float64,
                 lambda: "gnext.group_norm_moments_merge: moments must be (world, 3, N, G) float64")
    stats = moments.new_empty(moments.shape[2:], dtype=torch.float32)
    return stats, torch.empty_like(stats), moments.new_empty(moments.shape[2:])


def group_norm_moments(input, num_groups):
    N, C, G, D, HxW = check_group_norm_args("gnext.group_norm_moments", input, num_groups, None, None)
    if input.numel() == 0:
        return torch.zeros(3, N, G, dtype=torch.float64)
    var, mean = torch.var_mean(input.double().reshape(N, G, -1), dim=-1, correction=0)
    count = float(D * HxW)
    return torch.stack([torch.full_like(mean, count), mean, var * count])


def group_norm_moments_merge(moments, eps):
    _cpu._check(moments.dim() == 4 and moments.shape[1] == 3 and moments.dtype == torch.float64,
                lambda: f"gnext.group_norm_moments_merge: moments must be (world, 3, N, G) float64, got shape "
                        f"{list(moments.shape)} {moments.dtype}")
    c_i, m_i, q_i = moments.unbind(1)
    c = c_i.sum(0)
    mean = (c_i * m_i).sum(0) / c
    m2 = (q_i + c_i * (m_i - mean) ** 2).sum(0)
    return mean.float(), torch.rsqrt(m2 / c + eps).float(), c


_cpu.register(group_norm_moments, group_norm_moments_merge)
for _name in ("group_norm_moments", "group_norm_moments_merge"):
    _autograd.register_not_differentiable(_name)
