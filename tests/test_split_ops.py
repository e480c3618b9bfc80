# SPDX-License-Identifier: BSD-3-Clause
"""The GroupNorm split at its statistics (torch.ops.gnext.group_norm_moments(_merge), group_norm_act_apply and its two backward
pieces, the passes of groupnorm_ext.distributed), on one process: a tensor cut into shards along H, each shard's
pieces run on its own and the statistics / sums combined as the distributed op combines them, against float64
GroupNorm (+activation, +residual) of the whole tensor and its autograd gradients."""
from __future__ import annotations

import zlib

import pytest
import torch

from conftest import BWD_TOL, DEVICES, DTYPES, FWD_TOL, LAYOUTS, act_ref, assert_close_to_ref, layout_input, poison
from groupnorm_ext.distributed import _group_sums

ops = torch.ops.gnext
EPS = 1e-5

SHAPES = [  # (N, C, H, W), G
    ((2, 64, 24, 20), 8),
    ((1, 12, 9, 7), 3),  # odd sizes
    ((3, 32, 5, 1), 32),  # G = C
    ((1, 16, 40, 33), 1),  # G = 1
    ((2, 8, 6, 4, 5), 4),  # 5-D
]


def _reference(x, G, w, b, act, res, dy):
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_() if w is not None else None
    bd = b.detach().double().requires_grad_() if b is not None else None
    y = act_ref(torch.nn.functional.group_norm(xd, G, wd, bd, EPS), act)
    if res is not None:
        y = y + res.double()
    y.backward(dy.double())
    return y.detach(), xd.grad, wd.grad if wd is not None else None, bd.grad if bd is not None else None


def _cuts(H):
    """Shard boundaries along H: uneven, one shard empty where H allows."""
    a = H // 3
    return [0, a, a, H] if H >= 3 else [0, H]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,G", SHAPES)
@pytest.mark.parametrize("act", ["identity", "silu", "relu", "gelu"])
def test_split_matches_whole(device, dtype, shape, G, act):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{G}{act}{dtype}".encode()))  # stable across runs
    C = shape[1]
    x = layout_input(shape, dtype, device, "channels_last", 2.0, 3.0, gen)
    w = (torch.rand(C, generator=gen) + 0.5).to(dtype).to(device)
    b = torch.randn(C, generator=gen).to(dtype).to(device)
    res = (torch.randn(shape, generator=gen) if act == "silu" else None)
    res = res.to(dtype).to(device) if res is not None else None
    dy = torch.randn(shape, generator=gen).to(dtype).to(device)
    ref, gx, gw, gb = _reference(x, G, w, b, act, res, dy)
    cuts = _cuts(shape[2])
    shards = [(slice(lo, hi),) for lo, hi in zip(cuts[:-1], cuts[1:])]
    pick = lambda t, s: t[(slice(None), slice(None)) + s]  # noqa: E731

    # Forward: per-shard moments, gathered and merged by Chan's formula, then the apply pass per shard.
    moments = []
    for s in shards:
        poison(device, pick(x, s).numel() * 8)
        moments.append(ops.group_norm_moments(pick(x, s), G))
    mean, rstd, n_tot = ops.group_norm_moments_merge(torch.stack(moments), EPS)
    assert n_tot.dtype == torch.float64 and (n_tot == x[0, 0].numel() * (C // G)).all()
    outs = []
    for s in shards:
        poison(device, pick(x, s).numel() * 8)
        outs.append(ops.group_norm_act_apply(pick(x, s), mean, rstd, G, w, b, act,
                                            pick(res, s) if res is not None else None))
    assert_close_to_ref(torch.cat(outs, 2), ref, dtype, FWD_TOL)

    # Backward: per-shard channel sums, summed; then dx per shard from the group means.
    dsum = sum(ops.group_norm_act_apply_backward_sums(pick(dy, s), pick(x, s), mean, rstd, w, b, G, act)
               for s in shards)
    D = C // G
    gsum = _group_sums(dsum, w, n_tot, G)  # as groupnorm_ext.distributed combines them
    dxs = [ops.group_norm_act_apply_backward(pick(dy, s), pick(x, s), mean, rstd, w, b, gsum, G, act)
           for s in shards]
    assert_close_to_ref(torch.cat(dxs, 2), gx, dtype, BWD_TOL)
    dw = (dsum[..., 0] * rstd.repeat_interleave(D, 1)).sum(0)
    assert_close_to_ref(dw, gw, dtype, BWD_TOL)
    assert_close_to_ref(dsum[..., 1].sum(0), gb, dtype, BWD_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moments_and_apply_layouts(device, layout):
    """group_norm_moments / group_norm_act_apply on any layout equal group_norm_act of the same tensor, output in
    the input's memory format; the moments against float64 at a large mean."""
    gen = torch.Generator().manual_seed(7)
    shape, G, dtype = (2, 32, 12, 10), 8, torch.float16
    x = layout_input(shape, dtype, device, layout, 1.5, -400.0, gen)
    w = torch.rand(32, generator=gen).to(device) + 0.5
    b = torch.randn(32, generator=gen).to(device)
    out_ref, mean_ref, rstd_ref = ops.group_norm_act(x, G, w, b, EPS, "silu", None)
    m = ops.group_norm_moments(x, G)
    xd = x.double().reshape(2, G, -1)
    torch.testing.assert_close(m[0], torch.full((2, G), 4.0 * 120, dtype=torch.float64, device=device))
    torch.testing.assert_close(m[1], xd.mean(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m[2], xd.var(-1, correction=0) * 480, rtol=1e-4, atol=1e-4)
    mean, rstd, count = ops.group_norm_moments_merge(m[None], EPS)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-4, atol=1e-5)
    out = ops.group_norm_act_apply(x, mean, rstd, G, w, b, "silu", None)
    assert out.stride() == out_ref.stride()
    torch.testing.assert_close(out, out_ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    x = torch.randn(2, 8, 4, 4, device=device)
    mean, rstd, _ = ops.group_norm_moments_merge(ops.group_norm_moments(x, 4)[None], EPS)
    with pytest.raises(RuntimeError, match="num_channels C=8 must be divisible by num_groups=3"):
        ops.group_norm_moments(x, 3)
    with pytest.raises(RuntimeError, match="moments must be \\(world, 3, N, G\\) float64"):
        ops.group_norm_moments_merge(torch.zeros(1, 2, 2, 4, dtype=torch.float64, device=device), EPS)
    with pytest.raises(RuntimeError, match="mean must be float32"):
        ops.group_norm_act_apply(x, mean.double(), rstd, 4, None, None, "silu", None)
    with pytest.raises(RuntimeError, match="rstd must have N\\*G=8 elements"):
        ops.group_norm_act_apply(x, mean, rstd[:1], 4, None, None, "identity", None)
    with pytest.raises(RuntimeError, match="activation must be one of"):
        ops.group_norm_act_apply(x, mean, rstd, 4, None, None, "swish", None)
    with pytest.raises(RuntimeError, match="group_sums must be float32 with N\\*G\\*2=16 elements"):
        ops.group_norm_act_apply_backward(x, x, mean, rstd, None, None, torch.zeros(2, 4, device=device), 4,
                                          "identity")
    # Not differentiable: the distributed op's autograd.Function owns the gradient.
    xr = x.clone().requires_grad_()
    out = ops.group_norm_act_apply(xr, mean, rstd, 4, None, None, "identity", None)
    with pytest.raises(RuntimeError, match="not implemented"):
        out.sum().backward()
