# SPDX-License-Identifier: BSD-3-Clause
"""The normalize pass of GroupNorm (+activation, +residual) from given statistics, and its backward in two
passes: out = act((x - mean[n, g]) * rstd[n, g] * weight[c] + bias[c]) + residual (Wu & He 2018), mean/rstd
(N, G) float32 supplied by the caller: the statistics of a whole tensor of which x is a shard
(groupnorm_ext.distributed merges them across ranks). Backward, dy' = dL/dout * act'(.):
  * group_norm_act_apply_backward_sums: (N, C, 2) float32 (sum dy' * (x - mean), sum dy') over this shard;
    summed over the shards they give dweight (times rstd, summed over n), dbias (summed over n) and the group sums;
  * group_norm_act_apply_backward: dx = rstd * weight * dy' - rstd^3 * (x - mean) * gs[0] - rstd * gs[1], from
    group_sums (N, G, 2) float32, the means over the whole group of weight * dy' * (x - mean) and weight * dy'.
Their fake and CPU kernels; the schemas are in csrc/gnext.cpp and the CUDA kernels (the two-pass kernels) in
csrc/group_norm/. No autograd: the caller's autograd.Function owns the gradient; their outputs' backward raises."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._cpu import (_normalized, act_backward, apply_act, check_group_norm_args, check_group_norm_backward_args,
                    check_residual, check_stats_args, parse_activation)
from .._library import memory_format as _memory_format


def _empty_like_input(input):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=_memory_format(input))


@torch.library.register_fake("gnext::group_norm_act_apply")
def _apply_fake(input, mean, rstd, num_groups, weight, bias, activation, residual):
    return _empty_like_input(input)


@torch.library.register_fake("gnext::group_norm_act_apply_backward_sums")
def _sums_fake(grad_out, input, mean, rstd, weight, bias, num_groups, activation):
    return input.new_empty((input.shape[0], input.shape[1], 2), dtype=torch.float32)


@torch.library.register_fake("gnext::group_norm_act_apply_backward")
def _apply_backward_fake(grad_out, input, mean, rstd, weight, bias, group_sums, num_groups, activation):
    return _empty_like_input(input)


# CPU kernels (float32 math)

def _centred(input, s, mean):
    """x - mean[n, g], float32, (N, G, D, HxW)."""
    N, C, G, D, HxW = s
    return input.float().reshape(N, G, D, HxW) - mean.float().view(N, G, 1, 1)


def _dy_act(op, grad_out, input, s, mean, rstd, weight, bias, activation):
    """dy' = grad_out * act'(GroupNorm(x)), float32, (N, G, D, HxW)."""
    N, C, G, D, HxW = s
    act = parse_activation(op, activation)
    if bias is not None:
        check_group_norm_args(op, input, num_groups=G, weight=weight, bias=bias)
    g = grad_out.float().reshape(N, G, D, HxW)
    if act != "identity":
        n = _normalized(input.float().contiguous(), s, mean, rstd, weight, bias).reshape(N, G, D, HxW)
        g = act_backward(g.contiguous(), n, act, out=n)
    return g


def group_norm_act_apply(input, mean, rstd, num_groups, weight, bias, activation, residual):
    op = "gnext.group_norm_act_apply"
    act = parse_activation(op, activation)
    s = check_group_norm_args(op, input, num_groups, weight, bias)
    check_stats_args(op, s, input, mean, rstd)
    check_residual(op, input, residual)
    out = apply_act(_normalized(input.float().contiguous(), s, mean, rstd, weight, bias), act, inplace=True)
    if residual is not None:
        out = out.add_(residual)
    return out.to(input.dtype).contiguous(memory_format=_memory_format(input))


def group_norm_act_apply_backward_sums(grad_out, input, mean, rstd, weight, bias, num_groups, activation):
    op = "gnext.group_norm_act_apply_backward_sums"
    s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups)
    N, C = s[0], s[1]
    g = _dy_act(op, grad_out, input, s, mean, rstd, weight, bias, activation)
    sums = torch.stack([(g * _centred(input, s, mean)).sum(-1), g.sum(-1)], -1)  # (N, G, D, 2)
    return sums.reshape(N, C, 2)


def group_norm_act_apply_backward(grad_out, input, mean, rstd, weight, bias, group_sums, num_groups, activation):
    op = "gnext.group_norm_act_apply_backward"
    s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups)
    N, C, G, D, HxW = s
    _cpu._check(group_sums.dtype == torch.float32 and group_sums.numel() == N * G * 2,
                lambda: f"{op}: group_sums must be float32 with N*G*2={N * G * 2} elements, got {group_sums.dtype} "
                        f"of shape {list(group_sums.shape)}")
    _cpu._check(group_sums.device == input.device,
                lambda: f"{op}: group_sums is on {group_sums.device} but input is on {input.device}")
    g = _dy_act(op, grad_out, input, s, mean, rstd, weight, bias, activation)
    r = rstd.float().view(N, G, 1, 1)
    gs = group_sums.float().view(N, G, 1, 1, 2)
    w = weight.float().view(1, G, D, 1) if weight is not None else 1.0
    dx = r * w * g - r ** 3 * _centred(input, s, mean) * gs[..., 0] - r * gs[..., 1]
    return dx.reshape(input.shape).to(input.dtype).contiguous(memory_format=_memory_format(input))


_cpu.register(group_norm_act_apply, group_norm_act_apply_backward_sums, group_norm_act_apply_backward)
for _name in ("group_norm_act_apply", "group_norm_act_apply_backward_sums", "group_norm_act_apply_backward"):
    _autograd.register_not_differentiable(_name)
