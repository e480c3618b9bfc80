# SPDX-License-Identifier: BSD-3-Clause
"""Property-based tests (hypothesis): random N, C, G, spatial rank 0-3 and sizes, dtype, memory
format (contiguous, channels_last(_3d), permuted/sliced strides), affine on/off, eps, input offset
and scale (means up to 1e3, std down to 1e-2) -- forward and backward vs a float64 reference.

Error bounds follow from the arithmetic rather than a fixed guess: float32 statistics carry an
error of about ulp32(|mean|) * rstd in the normalized value, plus the output dtype's rounding.
Examples: GNEXT_FUZZ_EXAMPLES (default 40 on the CPU, 500 on CUDA); derandomized, so CI is
reproducible."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICES, layout_input, reference

EPS32 = 2.0**-23
OUT_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _examples(device):
    default = 500 if device == "cuda" else 40
    return int(os.environ.get("GNEXT_FUZZ_EXAMPLES", default))


@st.composite
def problems(draw):
    G = draw(st.integers(1, 4))
    D = draw(st.integers(1, 5))
    N = draw(st.integers(1, 3))
    rank = draw(st.integers(0, 3))
    spatial = [draw(st.sampled_from([1, 2, 3, 5, 7, 8, 13, 16])) for _ in range(rank)]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "channels_last", "permuted", "sliced"]))
    affine = draw(st.sampled_from(["none", "same", "fp32", "weight"]))
    eps = draw(st.sampled_from([1e-5, 1e-3]))
    if dtype == torch.float32:
        offset = draw(st.sampled_from([0.0, 2.0, -30.0, 1e3]))
        scale = draw(st.sampled_from([1e-2, 1.0, 3.0]))
    else:  # keep the input distinguishable after rounding to 8-11 bits
        offset = draw(st.sampled_from([0.0, 2.0, -5.0]))
        scale = draw(st.sampled_from([0.5, 3.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(shape=(N, G * D, *spatial), G=G, dtype=dtype, layout=layout, affine=affine, eps=eps,
                offset=offset, scale=scale, seed=seed)


def check(pb, device):
    gen = torch.Generator().manual_seed(pb["seed"])
    x = layout_input(pb["shape"], pb["dtype"], device, pb["layout"], pb["scale"], pb["offset"], gen)
    C, G, dtype = pb["shape"][1], pb["G"], pb["dtype"]
    w = b = None
    if pb["affine"] != "none":
        pdtype = torch.float32 if pb["affine"] == "fp32" else dtype
        w = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device, pdtype)
        if pb["affine"] != "weight":
            b = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).to(device, pdtype)
    dy = torch.randn(pb["shape"], generator=gen, dtype=torch.float64).to(device, dtype)

    out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, b, pb["eps"])
    ref, ref_mean, ref_rstd = reference(x, G, w, b, pb["eps"])
    wd = w.double() if w is not None else torch.ones(C, dtype=torch.float64, device=device)
    bd = b.double() if b is not None else torch.zeros(C, dtype=torch.float64, device=device)
    N = x.shape[0]
    view = (N, C) + (1,) * (x.dim() - 2)
    # Error of the normalized value from float32 statistics: ~ulp32(|mean|) * rstd (+ a few ulp).
    stat_err = (8 * EPS32 * (ref_mean.abs() + 1) * ref_rstd + 1e-5).repeat_interleave(C // G, dim=1)
    bound = (stat_err.view(view) * wd.abs().view(1, C, *view[2:]) * 4
             + 2 * OUT_EPS[dtype] * ref.abs() + OUT_EPS[dtype] * bd.abs().view(1, C, *view[2:]) + 1e-6)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"forward: worst excess {(err - bound).max().item():.3e} for {pb}"
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5 * (1 + ref_mean.abs().max().item()))
    torch.testing.assert_close(rstd.double(), ref_rstd, rtol=2e-3, atol=0)

    mask = [True, w is not None, b is not None]
    dx, dw, db = torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, mask)
    _, rdx, rdw, rdb = reference(x, G, w, b, pb["eps"], dy=dy)
    # dx = rstd*gamma*dy + c2*(x - mean) + c3: bound by the size of its terms, not of the result.
    r_full = ref_rstd.repeat_interleave(C // G, dim=1).view(view)
    term = (r_full * wd.view(1, C, *view[2:]).abs() * dy.double().abs())
    xhat = (ref - bd.view(1, C, *view[2:])) / wd.view(1, C, *view[2:]).where(wd.view(1, C, *view[2:]) != 0, 1.0)
    term_scale = term.norm().item() * (1 + xhat.abs().max().item())
    rel = (8 * EPS32 * (1 + (ref_mean.abs() * ref_rstd).max().item()) + 4 * OUT_EPS[dtype] + 1e-5)
    assert (dx.double() - rdx).norm().item() <= rel * (term_scale + rdx.norm().item()) + 1e-6, f"dx for {pb}"
    sum_dims = [0] + list(range(2, x.dim()))
    if w is not None:
        # dgamma = sum rstd*dy*(x - mean): the float32 mean's rounding gives an absolute error of
        # rstd*|dy|*ulp32(|mean|) per term on top of the relative one.
        mean_full = ref_mean.repeat_interleave(C // G, dim=1).view(view)
        terms = (dy.double() * torch.nan_to_num(xhat)).abs().sum(sum_dims)
        mean_err = (dy.double().abs() * r_full * 8 * EPS32 * (mean_full.abs() + 1)).sum(sum_dims)
        bound_dw = rel * terms + mean_err + 2 * OUT_EPS[dw.dtype] * rdw.abs() + 1e-5
        assert ((dw.double() - rdw).abs() <= bound_dw).all(), f"dw {pb}"
    if b is not None:
        terms = dy.double().abs().sum(sum_dims)
        assert ((db.double() - rdb).abs() <= rel * terms + 2 * OUT_EPS[db.dtype] * rdb.abs() + 1e-5).all(), f"db {pb}"


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_forward_backward(device):
    @settings(max_examples=_examples(device), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(problems())
    def run(pb):
        check(pb, device)

    run()
