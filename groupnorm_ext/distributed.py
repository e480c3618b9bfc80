# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm of a tensor split by space over the ranks of a process group (torch.distributed: NCCL on GPUs,
gloo on CPUs): each rank holds a shard of one image or video along a spatial dim (rows of H, frames of T), and
every GroupNorm needs the statistics of the whole tensor.

Forward: per-shard moments per (n, g) (count, mean, M2), one all-gather of those N*G*3 float64 (a few KB, not the
activation), Chan's merge in float64 (exact for uneven shards), then the normalize (+activation, +residual) pass on
the shard. Backward: one all-reduce of the per-channel sums (sum dy'*(x - mean), sum dy'), dy' = dL/dout * act',
from which dx, dweight and dbias follow. The result equals nn.GroupNorm (+activation) of the gathered tensor
(Wu & He 2018), forward and backward.

The passes over the shard are gnext's two-pass kernels, split at the statistics into ops of their own
(torch.ops.gnext.group_norm_moments(_merge), group_norm_act_apply and its two backward pieces): the data is read and
written as often as by the single-GPU two-pass plan, and only the statistics cross the ranks."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ._library import ACTIVATIONS, ops

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SIG_LEN = 14  # int64 entries of the shard signature that every rank compares


def _world(group) -> int:
    return dist.get_world_size(group)


# torch 2.14 renamed all_gather_tensor / all_gather_into_tensor to all_gather_single and warns on the old names;
# torch 2.11 has only those.
_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """(world, *t.shape): every rank's t. Eager: torch.distributed's all_gather_into_tensor; under tracing, its
    functional collective (the same NCCL/gloo call, traceable)."""
    world = _world(group)
    if torch.compiler.is_compiling():
        pg: Any = group if group is not None else dist.group.WORLD
        out = funcol.wait_tensor(_gather_single(t.contiguous().view(1, -1), 0, pg))
        return out.view(world, *t.shape)
    out = t.new_empty(world * t.numel())
    _gather_into(out, t.contiguous().view(-1), group=group)
    return out.view(world, *t.shape)


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's t (eager: in place in t when t is contiguous)."""
    if torch.compiler.is_compiling():
        pg: Any = group if group is not None else dist.group.WORLD
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", pg))
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


def _check_args(x, num_groups, weight, bias, activation, residual, dim):
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise ValueError(f"distributed.group_norm: input must be (N, C, *spatial) with a spatial dim to split, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"distributed.group_norm: input dtype must be float32, float16 or bfloat16, got {x.dtype}")
    C = x.shape[1]
    if num_groups <= 0 or C % num_groups != 0:
        raise ValueError(f"distributed.group_norm: num_channels C={C} must be divisible by num_groups={num_groups}")
    if not 2 <= dim < x.dim():
        raise ValueError(f"distributed.group_norm: dim must be a spatial dim in [2, {x.dim()}), got {dim}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.shape != (C,) or p.device != x.device):
            raise ValueError(f"distributed.group_norm: {name} must be ({C},) on {x.device}, got {tuple(p.shape)} on "
                             f"{p.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"distributed.group_norm: activation must be one of {', '.join(ACTIVATIONS)}, got "
                         f"{activation!r}")
    if residual is not None and (residual.shape != x.shape or residual.device != x.device or
                                 residual.dtype != x.dtype):
        raise ValueError(f"distributed.group_norm: residual must have input's shape {tuple(x.shape)}, dtype {x.dtype} "
                         f"and device {x.device}, got {tuple(residual.shape)} {residual.dtype} on {residual.device}")


def _signature(x, num_groups, dim) -> list:
    """What must agree across ranks: ndim, N, C, num_groups, dtype, dim and the sizes of the non-split dims."""
    sig = [x.dim(), x.shape[0], x.shape[1], num_groups, _DTYPES.index(x.dtype), dim]
    sig += [s for i, s in enumerate(x.shape) if i >= 2 and i != dim]
    if len(sig) > _SIG_LEN:
        raise ValueError(f"distributed.group_norm: at most {_SIG_LEN - 4} spatial dims, got {x.dim() - 2}")
    return sig


def _check_shards(sig, device, group):
    """All ranks' signatures agree; else ValueError on every rank (each sees all)."""
    mine = torch.tensor(sig + [-1] * (_SIG_LEN - len(sig)), dtype=torch.int64, device=device)
    rows = _all_gather(mine, group).tolist()
    if any(r != rows[0] for r in rows):
        names = "ndim, N, C, num_groups, dtype, dim, non-split sizes"
        raise ValueError("distributed.group_norm: the shards differ across ranks in (" + names + "): " +
                         "; ".join(f"rank {i}: {[v for v in r if v != -1]}" for i, r in enumerate(rows)))


# Signatures checked with check="once", per process group: (id of the group or None, signature).
_checked: set = set()


def _merged_stats(x, num_groups, eps, group):
    """Global mean and rstd (N, G) float32 and count per group (N, G) float64: every rank's (count, mean, M2) of its
    shard, all-gathered, merged by Chan's formula."""
    moments = _all_gather(ops.group_norm_moments(x, num_groups), group)  # (world, 3, N, G)
    return ops.group_norm_moments_merge(moments, eps)


def _group_sums(dsum, weight, count, num_groups):
    """group_norm_act_apply_backward's group_sums (N, G, 2) float32 from the per-channel sums (N, C, 2) of every
    shard added up: the means over each whole group of weight * dy' * (x - mean) and weight * dy'."""
    N, C = dsum.shape[:2]
    wsum = dsum * weight.float().view(1, C, 1) if weight is not None else dsum
    return (wsum.view(N, num_groups, C // num_groups, 2).sum(2).double() / count[..., None]).float()


class _SpatialGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, residual, num_groups, eps, activation, group):
        mean, rstd, n = _merged_stats(x, num_groups, eps, group)
        out = ops.group_norm_act_apply(x, mean, rstd, num_groups, weight, bias, activation, residual)
        ctx.save_for_backward(x, weight, bias, mean, rstd, n)
        ctx.num_groups, ctx.activation, ctx.group = num_groups, activation, group
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        x, weight, bias, mean, rstd, n = ctx.saved_tensors
        G, act, group = ctx.num_groups, ctx.activation, ctx.group
        C = x.shape[1]
        need_x, need_w, need_b, need_r = ctx.needs_input_grad[:4]
        dres = dout if need_r else None
        # Per channel of this shard: (sum dy' (x - mean), sum dy'), dy' the gradient at the GroupNorm's output;
        # summed over the ranks (one all-reduce of N*C*2 float32) they hold everything the gradients need.
        dsum = ops.group_norm_act_apply_backward_sums(dout, x, mean, rstd, weight, bias, G, act)
        dsum = _all_reduce_sum(dsum, group)
        dx = None
        if need_x:
            dx = ops.group_norm_act_apply_backward(dout, x, mean, rstd, weight, bias, _group_sums(dsum, weight, n, G),
                                                   G, act)
        dweight = dbias = None
        if need_w and weight is not None:
            dweight = (dsum[..., 0] * rstd.repeat_interleave(C // G, 1)).sum(0).to(weight.dtype)
        if need_b and bias is not None:
            dbias = dsum[..., 1].sum(0).to(bias.dtype)
        return dx, dweight, dbias, dres, None, None, None, None


def group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, activation: str | None = None,
               residual: torch.Tensor | None = None, dim: int = 2, group=None, check: bool | str = True) -> torch.Tensor:
    r"""GroupNorm (+activation, +residual) of a tensor split along spatial dim ``dim`` over the ranks of ``group``.

    ``input`` is this rank's shard ``(N, C, *spatial)``, the shards in rank order along ``dim`` (H for 4-D, T or H
    for 5-D); shard sizes along ``dim`` may differ (zero included). The result is this rank's shard of
    ``act(nn.GroupNorm(num_groups, C)(gathered) ) + residual``: out = act((x - mean[n, g]) * rstd[n, g] *
    weight[c] + bias[c]) + residual, mean and the biased variance over the whole group of the gathered tensor,
    rstd = 1 / sqrt(var + eps) (Wu & He 2018). float32, float16, bfloat16; any device the backend serves.

    Gradients: the gradient of the sum of every rank's loss. ``dweight``/``dbias`` are complete (summed over the
    shards) and the same on every rank of ``group``; under DDP/FSDP over a data-parallel group they are then
    averaged across that group as usual (averaging the identical values of one spatial group changes nothing).

    Communication per call: forward, one all-gather of N*G*3 float64 (and, with ``check``, one of 14 int64);
    backward, one all-reduce of N*C*2 float32. ``check=True`` (eager default) compares the shards' N, C,
    num_groups, dtype, ndim and non-split sizes across ranks on the host first: one host synchronization per call.
    ``check="once"`` (the modules' default) does that for the first call with each local signature only (per
    process group): every rank meets a new shape in the same call, as the layers of a model do; a rank whose shapes
    change while the others' stay the same is then not caught. ``check=False`` never checks (CUDA graphs). Under
    torch.compile there is no check.

    Raises:
        ValueError: C % num_groups != 0, a bad ``dim`` or ``check``, weight/bias not ``(C,)`` on the input's
            device, an unknown activation, a residual of another shape, dtype or device, or (``check``) shards that
            differ across ranks: on every rank.
        TypeError: an integer or float64 input.
    """
    activation = activation or "identity"
    _check_args(input, num_groups, weight, bias, activation, residual, dim)
    if check not in (True, False, "once"):
        raise ValueError(f"distributed.group_norm: check must be True, False or 'once', got {check!r}")
    if check and not torch.compiler.is_compiling():
        sig = _signature(input, num_groups, dim)
        key = (None if group is None else id(group), tuple(sig))
        if check is True or key not in _checked:
            _check_shards(sig, input.device, group)
            _checked.add(key)
    return _SpatialGroupNorm.apply(input, weight, bias, residual, num_groups, eps, activation, group)


class SpatialGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (same constructor, parameters and state_dict, plus ``activation``, ``dim``, ``group`` and
    ``check``) whose input is a shard split along ``dim`` over ``group`` (:func:`group_norm`).
    ``forward(x, residual=None)``."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, *, activation="identity", dim=2,
                 group=None, check="once", device=None, dtype=None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"SpatialGroupNorm: activation must be one of {', '.join(ACTIVATIONS)}, got "
                             f"{activation!r}")
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        self.activation, self.dim, self.group, self.check = activation, dim, group, check

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, activation=self.activation,
                          residual=residual, dim=self.dim, group=self.group, check=self.check)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}, dim={self.dim}"


class _GatedSpatialGroupNorm(SpatialGroupNorm):
    """SpatialGroupNorm with the activation of a norm that convert_group_norm_act(example_inputs=...) fused through an
    activation gate, telling the gate which tensor it produced (the gate applies the activation to any other)."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.__dict__["_gate"].announce(super().forward(input, residual))


def convert_group_norm_spatial(module: nn.Module, *, dim: int = 2, group=None,
                               check: bool | str = "once") -> nn.Module:
    """Swaps every ``nn.GroupNorm`` (its subclasses that keep its forward, timm's GroupNorm, and gnext's
    ``GroupNorm`` / ``GroupNormAct``, whose activation it keeps) of ``module`` for :class:`SpatialGroupNorm`
    sharing its parameters; returns the module (or its replacement if it is itself a GroupNorm). ``state_dict``
    keys are unchanged. ``check``: as :func:`group_norm`'s ("once": the first call per shape; False: never)."""
    from .convert import _from_group_norm, _GatedGroupNormAct, _plain_group_norm
    from .modules import GroupNorm, GroupNormAct

    def swap(m):
        if not (_plain_group_norm(m) or isinstance(m, (GroupNorm, GroupNormAct))) or isinstance(m, SpatialGroupNorm):
            return None
        if isinstance(m, _GatedGroupNormAct):  # fused through an activation gate: keep the fusion and the gate
            new = _from_group_norm(_GatedSpatialGroupNorm, m, activation=m.activation, dim=dim, group=group,
                                   check=check)
            new.__dict__["_gate"] = m.__dict__["_gate"]
            return new
        act = m.activation if isinstance(m, GroupNormAct) else "identity"
        return _from_group_norm(SpatialGroupNorm, m, activation=act, dim=dim, group=group, check=check)

    top = swap(module)
    if top is not None:
        return top
    for name, child in module.named_children():
        new = swap(child)
        if new is not None:
            setattr(module, name, new)
        else:
            convert_group_norm_spatial(child, dim=dim, group=group, check=check)
    return module
