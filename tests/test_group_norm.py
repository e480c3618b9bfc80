# SPDX-License-Identifier: BSD-3-Clause
"""gnext.group_norm forward and backward vs a float64 reference (torch.nn.functional.group_norm)."""
from __future__ import annotations

import pytest
import torch

import groupnorm_ext as ge
from conftest import BWD_TOL, DEVICES, DTYPES, FWD_TOL, assert_close_to_ref, poison, rand_input, reference, rel_err

CL = torch.channels_last
CL3 = torch.channels_last_3d

# (shape, num_groups, memory_format): odd sizes, G in {1, C, typical}, N=1, HxW=1, 2D..5D.
CASES = [
    ((2, 6, 7, 9), 3, None),
    ((2, 6, 7, 9), 3, CL),
    ((3, 12, 5, 5), 12, None),  # G = C
    ((3, 12, 5, 5), 12, CL),
    ((2, 8, 16, 16), 1, None),  # G = 1
    ((2, 8, 16, 16), 1, CL),
    ((1, 32, 8, 8), 8, None),  # N = 1
    ((1, 32, 8, 8), 8, CL),
    ((4, 16), 4, None),  # no spatial dims (HxW = 1)
    ((4, 16, 1, 1), 4, None),
    ((2, 12, 33), 4, None),  # 3D
    ((2, 8, 3, 5, 7), 2, None),  # 5D
    ((2, 8, 3, 5, 7), 2, CL3),
    ((3, 64, 32, 32), 8, None),
    ((3, 64, 32, 32), 8, CL),
    ((64, 64, 4, 4), 16, None),  # many short rows
    ((2, 9, 4, 4), 3, None),  # C = 3 * G
]


def _ids(case):
    shape, g, fmt = case
    return f"{'x'.join(map(str, shape))}-G{g}-{'cl' if fmt is not None else 'nchw'}"


def _params(C, dtype, device, affine, gen):
    if affine == "none":
        return None, None
    pdtype = torch.float32 if affine == "fp32" else dtype
    w = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device, pdtype)
    b = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).to(device, pdtype)
    if affine == "weight":
        return w, None
    return w, b


def run_case(shape, G, fmt, dtype, device, affine="same", eps=1e-5, seed=0, backward=True, x=None, dy_fmt=None):
    gen = torch.Generator().manual_seed(seed)
    if x is None:
        x = rand_input(shape, dtype, device, memory_format=fmt, gen=gen)
    w, b = _params(x.shape[1], dtype, device, affine, gen)
    dy = rand_input(x.shape, dtype, device, scale=1.0, offset=0.5, memory_format=dy_fmt or fmt, gen=gen)
    nbytes = x.numel() * x.element_size()

    poison(device, nbytes)
    out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, b, eps)
    ref, ref_mean, ref_rstd = reference(x, G, w, b, eps)
    assert out.dtype == x.dtype and out.shape == x.shape
    expected_fmt = fmt if fmt is not None and not x.is_contiguous() else torch.contiguous_format
    assert out.is_contiguous(memory_format=expected_fmt)
    assert mean.dtype == torch.float32 and mean.shape == (x.shape[0], G)
    assert_close_to_ref(out, ref, dtype, FWD_TOL)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-4, atol=1e-6)
    if not backward:
        return
    poison(device, nbytes)
    mask = [True, w is not None, b is not None]
    dx, dw, db = torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, mask)
    _, rdx, rdw, rdb = reference(x, G, w, b, eps, dy=dy)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert dx.is_contiguous(memory_format=expected_fmt)
    assert_close_to_ref(dx, rdx, dtype, BWD_TOL)
    if w is not None:
        assert dw.dtype == w.dtype
        assert_close_to_ref(dw, rdw, dtype, BWD_TOL)
    if b is not None:
        assert_close_to_ref(db, rdb, dtype, BWD_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_backward(case, dtype, device):
    run_case(*case, dtype, device, seed=hash(_ids(case)) % 1000)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", ["none", "weight", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_affine_variants(affine, dtype, device):
    if affine == "fp32" and dtype == torch.float32:
        pytest.skip("same as the default")
    run_case((2, 16, 6, 10), 4, None, dtype, device, affine=affine)
    run_case((2, 16, 6, 10), 4, CL, dtype, device, affine=affine, seed=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_unaligned(dtype, device):
    gen = torch.Generator().manual_seed(3)
    big = rand_input((2, 8, 12, 20), dtype, device, gen=gen)
    run_case(None, 4, None, dtype, device, x=big[:, :, :, ::2])  # strided: made contiguous
    run_case(None, 4, None, dtype, device, x=big.permute(0, 1, 3, 2))  # transposed spatial dims
    flat = rand_input((1 + 2 * 8 * 16,), dtype, device, gen=gen)
    run_case(None, 4, None, dtype, device, x=flat[1:].view(2, 8, 16))  # data pointer not 16-byte aligned
    cl = rand_input((2, 8, 6, 6), dtype, device, memory_format=CL, gen=gen)
    run_case(None, 2, None, dtype, device, x=cl[:, :, 1:, :])  # sliced channels_last
    # Dense in a layout with an odd stride on its size-1 batch dim (a reshape of a transpose at N = 1).
    odd = rand_input((64 * 4 * 8,), dtype, device, gen=gen)
    run_case(None, 8, CL, dtype, device, x=odd.as_strided((1, 64, 4, 8), (64, 1, 512, 64)))
    run_case(None, 8, None, dtype, device, x=odd.as_strided((1, 64, 4, 8), (7, 32, 8, 1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,dy_fmt", [
    (((2, 6, 7, 9), 3, CL), torch.contiguous_format),  # NCHW grad_out of a channels_last input: transposed
    (((3, 40, 33, 35), 8, CL), torch.contiguous_format),  # C and HxW not multiples of the 32 x 32 tile
    (((2, 64, 48, 48), 8, CL), torch.contiguous_format),  # the two-pass NHWC backward
    (((2, 8, 3, 5, 7), 2, CL3), torch.contiguous_format),
    (((2, 6, 7, 9), 3, None), CL),  # channels_last grad_out of an NCHW input
], ids=lambda v: _ids(v) if isinstance(v, tuple) else str(v).split(".")[-1])
def test_grad_out_layout_differs(case, dy_fmt, dtype, device):
    """The upstream gradient in another layout than the input (a loss or the next op decides it)."""
    run_case(*case, dtype, device, seed=5, dy_fmt=dy_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["identity", "silu"])
@pytest.mark.parametrize("shape,G", [((2, 64, 48, 48), 8), ((3, 40, 33, 35), 8), ((2, 8, 3, 5, 7), 2),
                                     ((2, 96, 17, 19), 6), ((1, 2048, 9, 9), 32)])
def test_gpu_nchw_grad_out_read_in_place(shape, G, act, dtype, tuning):
    """An NCHW grad_out of a channels_last input, read in place by the NHWC two-pass kernels, gives
    the same bits as the copy into channels_last (GNEXT_DY_NCHW=0): the sums run in the same order.
    Shapes: odd rows per step and ragged last steps (96 and 40 channels), C = 2048 at 81 pixels (a
    thread walks several channel vectors). With an activation (silu) the backward takes the copy
    either way."""
    tuning.set("GNEXT_ONEPASS", "0")
    fmt = CL if len(shape) == 4 else CL3
    gen = torch.Generator().manual_seed(11)
    x = rand_input(shape, dtype, "cuda", memory_format=fmt, gen=gen)
    w = (torch.rand(shape[1], generator=gen) + 0.5).to("cuda", dtype)
    b = torch.randn(shape[1], generator=gen).to("cuda", dtype)
    dy = rand_input(shape, dtype, "cuda", scale=1.0, offset=0.5, gen=gen)  # NCHW-contiguous
    _, mean, rstd = torch.ops.gnext.group_norm_act(x, G, w, b, 1e-5, act, None)
    outs = {}
    for knob in ("1", "0"):
        tuning.set("GNEXT_DY_NCHW", knob)
        poison("cuda", 4 * x.numel() * x.element_size())
        outs[knob] = torch.ops.gnext.group_norm_act_backward(dy, x, mean, rstd, w, b, G, act, [True, True, True])
    for a, c in zip(outs["1"], outs["0"]):
        assert torch.equal(a, c)
    assert outs["1"][0].is_contiguous(memory_format=fmt)


def _check_large_mean(shape, G, device, offset, scale, memory_format=None):
    """float32 input of std `scale` around `offset`: rstd within 1e-3 and the output within 2e-3 (relative
    norm) of the float64 reference."""
    x = rand_input(shape, torch.float32, device, scale=scale, offset=offset, gen=torch.Generator().manual_seed(5),
                   memory_format=memory_format)
    out, mean, rstd = torch.ops.gnext.group_norm(x, G, None, None, 1e-5)
    ref, ref_mean, ref_rstd = reference(x, G, None, None, 1e-5)
    torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-3, atol=0)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset,scale", [(1e4, 1.0), (1e3, 0.1)])
def test_large_mean_small_variance(device, offset, scale):
    """Welford, not E[x^2] - E[x]^2: at mean 1e4, std 1 a naive float32 variance is off by ~ulp(1e8) = 8.
    The output error left is the float32 rounding of the mean itself, ulp(mean) / std."""
    _check_large_mean((2, 8, 32, 32), 4, device, offset, scale)
    # channels_last: the NHWC reduction (shifted sums per thread) on CUDA
    _check_large_mean((2, 64, 32, 32), 8, device, offset, scale, memory_format=CL)


@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
@pytest.mark.parametrize("offset", [5.0, 40.0, 1e3])
def test_cpu_gradients_at_large_means_as_accurate_as_eager(fmt, offset):
    """The CPU kernels' float32 gradients against the float64 reference at means of 5-1000 standard deviations,
    NCHW and channels_last, around the limits below which ATen's kernels run as they are (8 channels_last, 64 NCHW):
    at least as accurate as eager's on the same input, and within fixed bounds (~5x the worst measured), which
    eager's channels_last kernels miss from a mean of 40 (grad_input 1.3e-4; 7e-2 at 1000). (CUDA's gradients at
    large means: test_large_mean_away_from_kinks, test_gpu_small_groups_large_mean.)"""
    gen = torch.Generator().manual_seed(int(offset))
    x = rand_input((2, 64, 9, 7), torch.float32, "cpu", scale=1.0, offset=offset, memory_format=fmt, gen=gen)
    w, b = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    dy = torch.randn(x.shape, generator=gen)
    _, *ref = reference(x, 8, w, b, 1e-5, dy=dy)
    errs = {}
    for fn, name in ((ge.group_norm, "gnext"), (torch.nn.functional.group_norm, "eager")):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        grads = torch.autograd.grad(fn(leaves[0], 8, leaves[1], leaves[2], 1e-5), leaves, dy)
        errs[name] = [rel_err(g, r) for g, r in zip(grads, ref)]
        if name == "gnext":
            assert grads[0].is_contiguous(memory_format=fmt or torch.contiguous_format)
    for what, o, e, bound in zip(("input", "weight", "bias"), errs["gnext"], errs["eager"], (2e-5, 2e-4, 2e-6)):
        assert o <= max(1.5 * e, 1e-6) and o <= bound, f"grad {what}: gnext {o:.2e}, eager {e:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_constant_group_gives_bias(device):
    x = torch.full((2, 4, 5, 5), 7.0, device=device)
    b = torch.arange(4, dtype=torch.float32, device=device)
    out = ge.group_norm(x, 2, torch.ones(4, device=device), b)
    torch.testing.assert_close(out, b.view(1, 4, 1, 1).expand_as(out).contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    x = torch.randn(0, 4, 3, device=device)
    out, mean, rstd = torch.ops.gnext.group_norm(x, 2, None, None, 1e-5)
    assert out.shape == x.shape and mean.shape == (0, 2)
    x = torch.randn(2, 4, 0, device=device)
    out, mean, rstd = torch.ops.gnext.group_norm(x, 2, None, None, 1e-5)
    assert out.shape == x.shape and mean.shape == (2, 2) and torch.isnan(mean).all()
    w = torch.ones(4, device=device)
    dx, dw, db = torch.ops.gnext.group_norm_backward(out, x, mean, rstd, w, 2, [True, True, True])
    assert dx.shape == x.shape and (dw == 0).all() and (db == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_matches_reference(device):
    gen = torch.Generator().manual_seed(7)
    x = rand_input((2, 6, 5, 4), torch.float32, device, gen=gen).requires_grad_()
    w = torch.randn(6, generator=gen).to(device).requires_grad_()
    b = torch.randn(6, generator=gen).to(device).requires_grad_()
    dy = torch.randn(x.shape, generator=gen).to(device)
    y = ge.group_norm(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    _, rdx, rdw, rdb = reference(x, 3, w, b, 1e-5, dy=dy)
    for g, r in zip(grads, (rdx, rdw, rdb)):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)
    # Only some inputs require grad.
    (gx,) = torch.autograd.grad(ge.group_norm(x, 3, w.detach(), b.detach()), (x,), dy)
    torch.testing.assert_close(gx.double(), rdx, rtol=1e-4, atol=1e-5)


def test_double_backward_raises():
    x = torch.randn(2, 4, 3, requires_grad=True)
    y = ge.group_norm(x, 2)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for gnext::group_norm_backward is not implemented"):
        g.sum().backward()


# ---------------------------------------------------------------------------------------------
# GPU only: sizes that take the split-reduction paths, wide channels_last, determinism.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    [
        ((1, 8, 256, 256), 2, None),  # few rows: HxW split over many CTAs
        ((1, 8, 256, 256), 2, CL),
        ((1, 4096, 3, 3), 32, CL),  # wide C: channel loop in the NHWC kernels
        ((2, 1024, 9, 7), 32, CL),
        ((1, 64, 16, 128, 128), 8, CL3),
        ((2, 320, 64, 64), 32, None),
    ],
    ids=_ids,
)
def test_gpu_large(case, dtype):
    # float32 weight/bias: dbeta = sum of dy over N*HxW positions exceeds float16's range here.
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=11)


# One-pass kernel geometries (group_norm_onepass.cuh); each also runs the two-pass kernels
# (GNEXT_ONEPASS=0) so that both paths stay tested on shapes that take the one-pass kernel.
# (Geometry noted for the H100 defaults: 132 SMs x 2 CTAs of 256 threads, 2 stages.)
ONEPASS_CASES = [
    ((2, 16, 256, 256), 4, None),  # few groups: channel pieces, one tile per CTA, CTAs wait on each other
    ((8, 64, 40, 40), 4, None),  # few groups: 2-channel tiles, one per CTA (backward: 4 warps per channel)
    ((16, 64, 96, 96), 8, None),  # one channel per tile, streamed through the stages, waits across waves
    ((40, 64, 48, 48), 8, None),  # multi-channel tiles streamed (backward: 3 channels, 2 warps each)
    ((4, 32, 512, 512), 8, None),  # channel pieces streamed
    ((64, 512, 4, 4), 1, None),  # HxW = 16: 128 channels per tile (a warp per channel)
    ((4, 256, 8, 8), 2, None),  # HxW = 64: a group per CTA
    ((2, 320, 64, 64), 32, None),  # a group per CTA, no waits
    ((3, 24, 1000), 6, None),  # 3D
    # ragged forward: HxW not a multiple of the vector, D*HxW is, at least a group per SM (N*G >= 132 on
    # the H100); whole-group tiles (backward: two-pass)
    ((32, 256, 7, 7), 32, None),  # ResNet-GN 7x7: D*HxW = 392
    ((12, 192, 33, 33), 12, None),  # odd HxW, D = 16
    ((48, 24, 5, 3), 3, None),  # HxW = 15 < 8: a vector spans two channels
    ((72, 16, 3), 2, None),  # HxW = 3: a vector spans three or four channels
    ((4, 96, 33, 33), 6, None),  # 24 groups: too few for the ragged plan, two-pass
    # many small groups (N*G >= 2 per SM, <= 16 KB each): 4 CTAs per SM of 128 threads
    ((32, 512, 8, 8), 32, None),  # 1024 groups of 16 channels (backward too, fp16/bf16)
    ((48, 96, 6, 6), 6, None),  # 288 groups; HxW = 36: ragged for fp16/bf16
    # NHWC (one wave only; by default only where it pays: <= 16 tiles per unit, >= 4 MB; the small
    # ones below run it with GNEXT_ONEPASS=2): units of cb channels (whole groups) x pixel-row tiles
    ((2, 1280, 32, 32), 32, CL),  # 16 units of 160 channels x 16 tiles each (taken by default)
    ((2, 320, 64, 64), 32, CL),  # D = 10: few units split over CTAs that wait on each other
    ((16, 512, 64, 64), 32, CL),  # too large for one wave: two-pass kernels on both settings
    ((1, 128, 256, 256), 32, CL),  # D = 4: two units over all CTAs
    ((3, 96, 7, 9), 3, CL),  # odd HxW, D = 32
    ((2, 64, 8, 16, 16), 8, CL3),  # 5D
    ((6, 64, 1, 1), 8, None),  # HxW = 1 (NHWC kernels)
    ((64, 512, 1, 1), 32, CL),  # HxW = 1, many groups (NHWC kernels; the NCHW ragged plan measured slower)
    ((300, 40, 1, 1), 5, None),  # HxW = 1, D = 8
]


def _onepass_settings(case):
    """GNEXT_ONEPASS values: 2 (one-pass wherever it fits: the NHWC kernels where the heuristic skips
    them, and the NCHW backward streamed over groups of 3+ tiles that the heuristic leaves to the two-pass
    kernels), 1 (the heuristic), 0 (two-pass)."""
    return ["2", "1", "0"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,onepass", [(c, o) for c in ONEPASS_CASES for o in _onepass_settings(c)],
                         ids=lambda v: _ids(v) if isinstance(v, tuple) else f"onepass{v}")
def test_gpu_onepass_geometries(case, dtype, onepass, tuning):
    tuning.set("GNEXT_ONEPASS", onepass)
    tuning.set("GNEXT_SMALL", "0")  # small groups would take the small-group kernel (tested below)
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=13)


# Streamed one-pass plans (more tiles than co-resident CTAs) under both publish orders (GNEXT_ONEPASS_EARLY:
# 1 publishes a tile before finishing the one before, 0 after; default: 1 for groups of several tiles, 0 for
# whole-group tiles) and with and without the re-plan at more CTAs per SM (GNEXT_ONEPASS_PACK).
STREAMED_CASES = [
    ((8, 64, 16000), 4, ""),  # one 16000-element channel per tile, T = 16, 512 tiles: packed to 3 CTAs per SM
    ((8, 64, 8000), 4, ""),  # fp32 tiles of one channel leave room for a third CTA too
    ((16, 64, 4000), 8, "4"),  # 4 CTAs per SM (GNEXT_ONEPASS_CTAS): T = 8, 1024 tiles over 528 CTAs
    ((64, 64, 24, 24), 8, ""),  # whole-group tiles (T = 1) streamed, no waits
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("early", ["", "0", "1"])
@pytest.mark.parametrize("pack", ["", "0"])
@pytest.mark.parametrize("case", STREAMED_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"_G{c[1]}")
def test_gpu_onepass_streamed_orders(case, pack, early, dtype, tuning):
    shape, G, ctas = case
    tuning.set("GNEXT_ONEPASS", "2")  # the backward streamed too
    tuning.set("GNEXT_ONEPASS_CTAS", ctas)
    tuning.set("GNEXT_ONEPASS_EARLY", early)
    tuning.set("GNEXT_ONEPASS_PACK", pack)
    run_case(shape, G, None, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=17)


# The wide kernels (group_norm_wide.cuh: one CTA per SM, a grid-wide wait per group, each CTA a 1 KB-aligned
# slice of every group, its start kept in shared memory and the rest re-read from L2). By default only
# for large groups (wide_geometry); GNEXT_WIDE=2 takes it for these small shapes, GNEXT_ONEPASS=0 keeps the
# one-pass plan from taking them first, GNEXT_WIDE_HELD caps the shared-memory part of a slice (of each of
# the forward's two stage buffers with its look-ahead; GNEXT_WIDE_AHEAD=0: one buffer, no look-ahead).
WIDE_CASES = [
    ((2, 16, 64, 64), 4, None),  # 4 groups of 16384 elements: 1 KB slices, 64 CTAs (fp32)
    ((1, 8, 1000, 24), 2, None),  # slices of one group cross channel boundaries; the last slice is short
    ((3, 6, 40, 40), 3, None),  # D = 2, few CTAs
    ((2, 12, 4000), 4, None),  # 3D
    ((8, 32, 16, 16), 8, None),  # 64 groups walked in turn
]


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", ["", "0"])
@pytest.mark.parametrize("held", ["", "0", "1040"])  # all of a slice in shared memory; none; 1040 bytes
# (the backward, where a slice fits within one channel's HxW, holds that much of x and of dy each)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WIDE_CASES, ids=_ids)
def test_gpu_wide_kernels(case, dtype, held, ahead, tuning):
    """The wide kernels forward and backward (run_case checks both against the float64 reference)."""
    tuning.set("GNEXT_ONEPASS", "0")
    tuning.set("GNEXT_WIDE", "2")
    tuning.set("GNEXT_WIDE_HELD", held)
    tuning.set("GNEXT_WIDE_AHEAD", ahead)
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=19)
    run_case(*case, dtype, "cuda", affine="none", seed=29)
    if dtype == torch.float32:  # mean 1e4, std 1: Welford merges; the error left is ulp(mean) / std
        _check_large_mean(case[0], case[1], "cuda", 1e4, 1.0)


# The channels_last wide forward (wide_nhwc_forward_kernel: images as units, each CTA whole rows of every
# image, per-group statistics of up to two groups per channel vector). GNEXT_WIDE_NHWC=2 takes it for these
# small shapes; GNEXT_ONEPASS=0 keeps the NHWC one-pass plan from taking them first.
WIDE_NHWC_CASES = [
    ((2, 64, 32, 32), 8, CL),  # D = 8: 16-bit vectors within one group; 8 rows per CTA
    ((2, 80, 24, 20), 8, CL),  # D = 10: vectors spanning two groups; C / V = 10 (16-bit): 480 threads
    ((3, 32, 50, 7), 8, CL),  # D = 4: 16-bit vectors over two groups; 350 rows, the last CTA short
    ((1, 512, 16, 16), 32, CL),  # C / V = 64 (16-bit): a step of 8 rows; 256 rows, 2 per CTA
    ((4, 48, 9, 11), 3, CL),  # 99 rows: a row per CTA, fewer CTAs than SMs
    ((2, 24, 4, 6, 8), 4, CL3),  # 5-D channels_last_3d, D = 6
]


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", ["", "0"])
@pytest.mark.parametrize("held", ["", "0", "1040"])  # all of a CTA's rows in shared memory; none; 1040 bytes
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WIDE_NHWC_CASES, ids=_ids)
def test_gpu_wide_nhwc_forward(case, dtype, held, ahead, tuning):
    """Forward (and, through run_case, the backward after it) against float64; GroupNorm+SiLU with a
    residual; float32 near a large mean."""
    tuning.set("GNEXT_ONEPASS", "0")
    tuning.set("GNEXT_WIDE_NHWC", "2")
    tuning.set("GNEXT_WIDE_HELD", held)
    tuning.set("GNEXT_WIDE_AHEAD", ahead)
    shape, G, fmt = case
    assert any("wide_nhwc_forward" in n for n in _cuda_kernels(
        lambda: torch.ops.gnext.group_norm(rand_input(shape, dtype, "cuda", memory_format=fmt), G, None, None, 1e-5)))
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=19)
    run_case(*case, dtype, "cuda", affine="none", seed=29)
    gen = torch.Generator().manual_seed(31)
    x = rand_input(shape, dtype, "cuda", memory_format=fmt, gen=gen)
    res = rand_input(shape, dtype, "cuda", memory_format=fmt, gen=gen)
    w = (torch.rand(shape[1], generator=gen) + 0.5).to("cuda")
    b = torch.randn(shape[1], generator=gen).to("cuda")
    poison("cuda", 4 * x.numel() * x.element_size())
    out, _, _ = torch.ops.gnext.group_norm_act(x, G, w, b, 1e-5, "silu", res)
    ref = torch.nn.functional.silu(reference(x, G, w, b, 1e-5)[0]) + res.double()
    assert out.is_contiguous(memory_format=fmt)
    assert_close_to_ref(out, ref, dtype, FWD_TOL)
    if dtype == torch.float32:
        _check_large_mean(shape, G, "cuda", 1e4, 1.0, memory_format=fmt)


@pytest.mark.gpu
def test_gpu_wide_nhwc_forward_is_taken_and_deterministic(tuning):
    """The default rule takes the channels_last wide forward for a single 16.8 MB image (1x512x128x128 bf16, a
    VAE decoder map), GroupNorm and GroupNorm+SiLU, not for two of them; bitwise the same from run to run;
    matches the two-pass kernels."""
    two_images = rand_input((2, 512, 128, 128), torch.bfloat16, "cuda", memory_format=CL)
    assert not any("wide_nhwc_forward" in n
                   for n in _cuda_kernels(lambda: torch.ops.gnext.group_norm(two_images, 32, None, None, 1e-5)))
    x = rand_input((1, 512, 128, 128), torch.bfloat16, "cuda", memory_format=CL)
    w = torch.rand(512, device="cuda") + 0.5
    b = torch.randn(512, device="cuda")
    assert any("wide_nhwc_forward" in n for n in _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, 32, w, b, 1e-5)))
    assert any("wide_nhwc_forward" in n
               for n in _cuda_kernels(lambda: torch.ops.gnext.group_norm_act(x, 32, w, b, 1e-5, "silu", None)))
    outs = [torch.ops.gnext.group_norm(x, 32, w, b, 1e-5) for _ in range(3)]
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
    tuning.set("GNEXT_WIDE_NHWC", "0")
    two = torch.ops.gnext.group_norm(x, 32, w, b, 1e-5)
    torch.testing.assert_close(outs[0][1], two[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][2], two[2], rtol=1e-4, atol=0)
    torch.testing.assert_close(outs[0][0].float(), two[0].float(), rtol=1.6e-2, atol=1.6e-2)


def _persistent_kernels_pay():
    """The planner's bandwidth rule for this GPU (group_norm_plan.h: persistent_kernels_pay, < 3.8 TB/s peak):
    where it says no (H200), the NCHW wide kernels are not taken by default."""
    from groupnorm_ext._library import _C
    return _C._device()[6] < 3800


@pytest.mark.gpu
def test_gpu_wide_forward_is_taken_and_deterministic(tuning):
    """The default rule takes the wide kernel for 33.6 MB groups (a 1x128x2048x2048 bf16 map) where persistent
    kernels pay (H100; not on the H200, where GNEXT_WIDE=2 forces it for the rest); its result is bitwise the
    same from run to run and matches the two-pass kernels."""
    x = (torch.randn((1, 128, 2048, 2048), device="cuda") * 3 + 2).to(torch.bfloat16)  # rand_input's, made on the GPU
    w = torch.rand(128, device="cuda") + 0.5
    b = torch.randn(128, device="cuda")
    names = _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, 32, w, b, 1e-5))
    assert any("wide_forward" in n for n in names) == _persistent_kernels_pay(), names
    if not _persistent_kernels_pay():
        tuning.set("GNEXT_WIDE", "2")
        assert any("wide_forward" in n for n in _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, 32, w, b, 1e-5)))
    outs = [torch.ops.gnext.group_norm(x, 32, w, b, 1e-5) for _ in range(3)]
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
    tuning.set("GNEXT_WIDE", "0")
    two = torch.ops.gnext.group_norm(x, 32, w, b, 1e-5)
    torch.testing.assert_close(outs[0][1], two[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][0].float(), two[0].float(), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.gpu
def test_gpu_wide_forward_rule_for_epilogues(tuning):
    """16.8 MB groups (1x256x1024x1024 bf16), with the bulk forward off (it takes them by default on sm_90, streamed):
    GroupNorm and GroupNorm+SiLU take the wide forward (with its look-ahead, the activation no longer tips the
    balance to the two-pass kernels); 4.2 MB groups do not. Where persistent kernels do not pay (H200) none of them
    takes it."""
    tuning.set("GNEXT_BULK", "0")
    x = (torch.randn((1, 256, 1024, 1024), device="cuda") * 3 + 2).to(torch.bfloat16)
    plain = _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, 32, None, None, 1e-5))
    act = _cuda_kernels(lambda: torch.ops.gnext.group_norm_act(x, 32, None, None, 1e-5, "silu", None))
    if not _persistent_kernels_pay():
        assert not any("wide_" in n for n in plain + act), plain + act
        return
    assert any("wide_forward" in n for n in plain), plain
    assert any("wide_forward" in n for n in act), act
    small = x[:, :128, :512].contiguous()  # 4.2 MB groups
    act_small = _cuda_kernels(lambda: torch.ops.gnext.group_norm_act(small, 32, None, None, 1e-5, "silu", None))
    assert not any("wide_forward" in n for n in act_small), act_small
    # backward: x + dy are 33.6 MB per group, the wide backward's rule starts at 24 MiB
    y, mean, rstd = torch.ops.gnext.group_norm(x, 32, None, None, 1e-5)
    bwd = _cuda_kernels(lambda: torch.ops.gnext.group_norm_backward(y, x, mean, rstd, None, 32, [True, False, False]))
    assert any("wide_backward" in n for n in bwd), bwd


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["", "0", "5", "32", "10000"])  # the default rule (HxW >= 1024: chunks of
# min(64, HxW/32) rows), the plain split, a non-divisor of HxW, a few chunks, one chunk per image
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [((2, 1280, 16, 16), 32, CL), ((3, 96, 7, 9), 3, CL), ((2, 64, 4, 8, 8), 8, CL3),
                                  ((2, 96, 33, 37), 12, CL), ((1, 40, 2, 24, 40), 5, CL3)], ids=_ids)
def test_gpu_nhwc_min_rows(case, dtype, rows, tuning):
    """The two-pass NHWC kernels with the GNEXT_NHWC_MIN_ROWS chunking (fewer, longer chunks); the last
    two cases have HxW >= 1024 (1221: 38-row chunks, the last one short; 1920: 60-row chunks)."""
    tuning.set("GNEXT_ONEPASS", "0")
    tuning.set("GNEXT_NHWC_MIN_ROWS", rows)
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=17)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["0", "1"])  # CTAs looping over chunks; a CTA per 2048-vector tile
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [((2, 64, 96, 96), 8, None), ((1, 32, 129, 131), 4, None),
                                  ((1, 16, 300, 301), 4, None), ((2, 8, 6, 64, 65), 2, None)], ids=_ids)
def test_gpu_nchw_elementwise_tiles(case, dtype, tile, tuning):
    """The two-pass NCHW elementwise pass both ways (GNEXT_AFFINE_TILE): rows of one or two tiles, odd rows read
    one element at a time (16899: 9 tiles, the last short), rows whose vector is not 16 bytes (90300) and 5-D maps."""
    tuning.set("GNEXT_ONEPASS", "0")
    tuning.set("GNEXT_BULK", "0")
    tuning.set("GNEXT_BULK_BWD", "0")
    tuning.set("GNEXT_WIDE", "0")
    tuning.set("GNEXT_AFFINE_TILE", tile)
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=23)


def _cuda_kernels(fn):
    """Names of the CUDA kernels (not memsets/copies) that fn() launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "memset" not in e.name.lower()
            and "memcpy" not in e.name.lower()]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,G,dtype,fmt,fwd_kernels,bwd_kernels", [
    ((2, 320, 64, 64), 32, torch.float16, None, 1, 2),  # small: one launch forward, two backward
    ((2, 1280, 32, 32), 32, torch.float16, CL, 1, 2),  # (+ a memset of the counters)
    ((4, 32, 512, 512), 8, torch.float32, None, 1, 2),
    ((2, 1280, 32, 32), 32, torch.float32, CL, 1, 2),
])
def test_gpu_onepass_launches(shape, G, dtype, fmt, fwd_kernels, bwd_kernels, tuning):
    tuning.set("GNEXT_BULK_BWD", "0")  # 4x32x512x512 fp32's 4 MiB groups take the bulk kernels by the rule
    tuning.set("GNEXT_BULK", "0")
    x = rand_input(shape, dtype, "cuda", memory_format=fmt)
    w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
    dy = torch.randn_like(x)
    out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
    fwd = _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, G, w, w, 1e-5))
    bwd = _cuda_kernels(lambda: torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True]))
    assert len(fwd) == fwd_kernels and "onepass_n" in fwd[0], fwd
    assert len(bwd) == bwd_kernels and any("onepass_n" in k for k in bwd), bwd


@pytest.mark.gpu
def test_gpu_bulk_forward_is_one_launch():
    """A UNet/VAE map of 8 MiB groups (1x512x512x512 fp16, G = 32: 16 chunks of 4 KiB per SM) takes the bulk
    forward by the rule on sm_90+: one launch (+ the counters' memset)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk asynchronous copies need sm_90")
    x = rand_input((1, 512, 512, 512), torch.float16, "cuda")
    w = torch.rand(512, device="cuda", dtype=torch.float16) + 0.5
    fwd = _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, 32, w, w, 1e-5))
    assert len(fwd) == 1 and "bulk_forward" in fwd[0], fwd


@pytest.mark.gpu
@pytest.mark.parametrize("shape,G,dtype", [((4, 32, 512, 512), 8, torch.float32),   # 4 MiB groups: held
                                           ((1, 128, 1024, 1024), 32, torch.float16)], ids=str)  # 8 MiB: streamed
def test_gpu_bulk_backward_launches(shape, G, dtype):
    """Groups whose slices of x and dy are 8 or more chunks per SM take the bulk backward by the rule on sm_90+:
    the bulk kernel and the dgamma/dbeta reduction (+ the counters' memset)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk asynchronous copies need sm_90")
    x = rand_input(shape, dtype, "cuda")
    w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
    dy = torch.randn_like(x)
    _, mean, rstd = torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
    bwd = _cuda_kernels(lambda: torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True]))
    assert len(bwd) == 2 and "bulk_backward" in bwd[0] and "gamma_beta" in bwd[1], bwd


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_ragged_forward_is_one_launch(dtype, tuning):
    """ResNet-GN 7x7 (HxW = 49, not a multiple of the vector): the forward runs the vectorized one-pass
    kernel (whole-group tiles) in one launch, not the scalar two-pass kernels; GroupNorm+SiLU with a
    residual too. (Its 392-element groups take the small-group kernel by default: GNEXT_SMALL=0 here.)"""
    tuning.set("GNEXT_SMALL", "0")
    x = rand_input((32, 256, 7, 7), dtype, "cuda")
    w = torch.rand(256, device="cuda", dtype=dtype) + 0.5
    fwd = _cuda_kernels(lambda: torch.ops.gnext.group_norm(x, 32, w, w, 1e-5))
    assert len(fwd) == 1 and "onepass_nchw" in fwd[0], fwd
    act = _cuda_kernels(lambda: torch.ops.gnext.group_norm_act(x, 32, w, w, 1e-5, "silu", x))
    assert len(act) == 1 and "onepass_nchw" in act[0], act


@pytest.mark.gpu
@pytest.mark.parametrize("shape,G,fmt", [((4, 32, 512, 512), 8, None), ((16, 64, 96, 96), 8, None),
                                         ((2, 320, 64, 64), 32, None), ((2, 64, 96, 96), 8, None),
                                         ((16, 512, 32, 32), 32, CL), ((1, 128, 256, 256), 32, CL)], ids=str)
@pytest.mark.parametrize("knobs", ["GNEXT_ONEPASS=2", "GNEXT_ONEPASS=0", "GNEXT_ONEPASS=0,GNEXT_WIDE_NHWC=2",
                                   "GNEXT_BULK=2,GNEXT_BULK_BWD=2"])
def test_gpu_cuda_graph_replay(shape, G, fmt, knobs, tuning):
    """Forward + backward captured in a CUDA graph (memset of the counters and cooperative
    launches included) give the same bits on replay as eagerly, for fresh inputs copied in.
    GNEXT_ONEPASS=2: the channels_last shapes take the NHWC one-pass kernel too; GNEXT_ONEPASS=0: the
    two-pass kernels (programmatic dependent launches captured as graph edges); GNEXT_WIDE_NHWC=2: the
    channels_last shapes take the channels_last wide forward; GNEXT_BULK=2, GNEXT_BULK_BWD=2: the NCHW forwards,
    and the backwards whose slices fit in two channels, take the bulk kernels (sm_90+)."""
    for knob in knobs.split(","):
        tuning.set(*knob.split("="))
    x = rand_input(shape, torch.float32, "cuda", memory_format=fmt)
    w = torch.rand(shape[1], device="cuda") + 0.5
    b = torch.randn(shape[1], device="cuda")
    dy = torch.randn_like(x)
    sx, sdy = x.clone(), dy.clone()

    def step():
        out, mean, rstd = torch.ops.gnext.group_norm(sx, G, w, b, 1e-5)
        return (out, mean, rstd) + tuple(torch.ops.gnext.group_norm_backward(sdy, sx, mean, rstd, w, G,
                                                                             [True, True, True]))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 + seed)
        sx.copy_(rand_input(shape, torch.float32, "cuda", gen=gen))
        sdy.copy_(torch.randn(shape, generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, r in zip(static_out, eager):
            assert torch.equal(a, r)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
def test_gpu_deterministic(fmt):
    x = rand_input((2, 64, 96, 96), torch.float16, "cuda", memory_format=fmt)
    w = torch.rand(64, device="cuda") + 0.5
    b = torch.randn(64, device="cuda")
    dy = torch.randn_like(x)
    first = None
    for _ in range(10):
        out, mean, rstd = torch.ops.gnext.group_norm(x, 8, w, b, 1e-5)
        grads = torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, 8, [True, True, True])
        res = (out, mean, rstd, *grads)
        if first is None:
            first = res
        else:
            for a, r in zip(first, res):
                assert torch.equal(a, r)


@pytest.mark.gpu
def test_gpu_matches_cpu_op():
    x = rand_input((3, 24, 10, 10), torch.float32, "cpu")
    cpu = torch.ops.gnext.group_norm(x, 6, None, None, 1e-5)
    gpu = torch.ops.gnext.group_norm(x.cuda(), 6, None, None, 1e-5)
    for c, g in zip(cpu, gpu):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,fmt", [((2, 32, 32768, 1056), None), ((1, 64, 2048, 16896), CL),
                                       ((520, 32, 512, 256), None)], ids=["nchw", "cl", "nchw-onepass"])
def test_gpu_beyond_2_31_elements(shape, fmt):
    """~2.2e9 float16 elements: offsets past 2^31 must use 64-bit indexing. Checks the first and
    last group against float64 statistics and the normalized values."""
    G = 8
    free, _ = torch.cuda.mem_get_info()
    numel = 1
    for s in shape:
        numel *= s
    if free < numel * 2 * 4 + (8 << 30):
        pytest.skip("not enough GPU memory")
    assert numel > 2**31
    x = torch.empty(shape, dtype=torch.float16, device="cuda", memory_format=fmt or torch.contiguous_format)
    x.normal_(2.0, 3.0)
    out, mean, rstd = torch.ops.gnext.group_norm(x, G, None, None, 1e-5)
    N, C, D = shape[0], shape[1], shape[1] // G
    for n, g in [(0, 0), (N - 1, G - 1)]:
        xs = x[n, g * D:(g + 1) * D].double()
        var, mu = torch.var_mean(xs, correction=0)
        r = (var + 1e-5).rsqrt()
        assert abs(mean[n, g].item() - mu.item()) < 1e-4 * (1 + abs(mu.item()))
        assert abs(rstd[n, g].item() - r.item()) < 1e-4 * r.item()
        ref = (xs - mu) * r
        err = ((out[n, g * D:(g + 1) * D].double() - ref).norm() / ref.norm()).item()
        assert err < 1e-3, err
        del xs, ref
    del out
    # backward on the same tensor with dy = 1: dbeta = sum dy over N and HxW (float32), dx = 0
    dy = torch.ones_like(x)
    dx, _, db = torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, torch.ones(C, device="cuda"), G,
                                                    [True, False, True])
    expected = float(numel // C)
    torch.testing.assert_close(db, torch.full_like(db, expected), rtol=1e-5, atol=0)
    for n, g in [(0, 0), (N - 1, G - 1)]:
        assert dx[n, g * D:(g + 1) * D].abs().max().item() < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("onepass", ["1", "0"])
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_propagates_like_torch(device, onepass, fmt, bad, tuning):
    """A NaN/Inf in a group makes that group's output non-finite exactly where F.group_norm's is
    (NaN vs NaN, the other groups finite and equal); other groups are untouched."""
    tuning.set("GNEXT_ONEPASS", onepass)
    x = rand_input((2, 8, 6, 6), torch.float32, device, memory_format=fmt, gen=torch.Generator().manual_seed(9))
    x[1, 2, 3, 4] = bad  # group 1 of sample 1
    w = torch.rand(8, device=device) + 0.5
    b = torch.randn(8, device=device)
    out, mean, rstd = torch.ops.gnext.group_norm(x, 4, w, b, 1e-5)
    ref = torch.nn.functional.group_norm(x, 4, w, b, 1e-5)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert not fin[1, 2:4].any() and fin[0].all() and fin[1, :2].all() and fin[1, 4:].all()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


# The small-group kernels (group_norm_small.cu): groups of at most 256 16-byte vectors held in registers by
# 1-32 lanes of a warp, or by a CTA (forward up to 4096 vectors, backward 2048); HxW == 1 channels_last included
# ((N, C) memory is the same in both layouts). Each case forward and backward against float64, and with
# GNEXT_SMALL=0 (the one-pass / two-pass kernels) as well.
SMALL_CASES = [  # at least 64 groups (N*G), where the small-group kernel is taken
    ((64, 512, 1, 1), 32, CL),  # HxW = 1 channels_last: D = 16 elements per group, a lane per group
    ((64, 512, 1, 1), 32, None),
    ((24, 96, 1, 1), 3, None),  # G = 3, 32 elements per group
    ((64, 64, 4, 4), 1, None),  # G = 1: 1024 elements (fp32: 256 vectors, 32 lanes x 8)
    ((24, 48, 7, 7), 3, None),  # HxW = 49: vectors cross channels; fp32 196 vectors (the last lanes short)
    ((5, 60, 4, 3), 15, None),  # 48 elements: 2-4 lanes per group
    ((7, 33, 2, 4), 11, None),  # N*G = 77 groups: a partial warp
    ((8, 100, 10, 10), 10, None),  # 1000 elements
    ((9, 40, 8), 8, None),  # 3-D
    ((4, 64, 2, 4), 64, None),  # G = C
    ((64, 64, 3), 8, None),  # HxW = 3 < V: backward pieces per element
    ((32, 64, 2, 3), 16, None),  # HxW = 6: per element (fp16/bf16), vectors straddling channels (fp32)
    ((2, 48, 7, 7), 3, None),  # 6 groups: below the rule, the one-pass kernel
    # A CTA per group (more than 256 vectors, at least a group per SM on GPUs of up to 264 SMs):
    ((40, 640, 7, 7), 10, None),  # HxW = 49, vectors cross channels: bf16 392 vectors (2 per thread), fp32 784
    ((48, 512, 8, 8), 8, None),  # 4096 elements: 512 / 1024 vectors
    ((68, 256, 16, 16), 4, None),  # 16384 elements: bf16 2048 vectors (8 per thread); fp32 4096 (forward 16 per
    # thread; the backward, over 8: other kernels)
    ((9, 64, 57, 63), 16, None),  # 144 groups of 14364 elements: fp32 3591 vectors crossing channels (14 per thread)
    ((44, 192, 9, 9), 6, None),  # 264 groups, 2592 elements, fp32 ragged
    ((8, 256, 32, 32), 32, None),  # 256 groups (UNet2DModel at batch 8): 1024 / 2048 vectors
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("knob", ["", "GNEXT_SMALL=0", "GNEXT_SMALL_FILL=0", "GNEXT_SMALL_FILL=64", "GNEXT_SMALL_KREG=8",
                                  "GNEXT_SMALL_CTA=0", "GNEXT_SMALL_CTA=1"])
@pytest.mark.parametrize("case", SMALL_CASES, ids=_ids)
def test_gpu_small_groups(case, knob, dtype, tuning):
    """Default plan; the other kernels (GNEXT_SMALL=0); the fewest lanes per group (grid fill off) and the
    most (up to one vector per lane, GNEXT_SMALL_FILL=64); registers for 8 vectors per lane in every plan;
    no CTA-per-group plan, or one for the backward only."""
    if knob:
        tuning.set(*knob.split("="))
    run_case(*case, dtype, "cuda", affine="same" if dtype == torch.float32 else "fp32", seed=19)


@pytest.mark.gpu
@pytest.mark.parametrize("offset,scale", [(1e4, 1.0), (1e3, 0.1)])
def test_gpu_small_groups_large_mean(offset, scale):
    """The small-group kernel's statistics near a large mean (as test_large_mean_small_variance): the error
    left is the float32 rounding of the mean, ulp(mean) / std; a naive E[x^2] - mean^2 would be off by ~8."""
    _check_large_mean((8, 64, 4, 4), 8, "cuda", offset, scale)  # 64 groups of 128 elements
    _check_large_mean((64, 512, 1, 1), 32, "cuda", offset, scale)  # HxW = 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", [((64, 512, 1, 1), 32, CL), ((64, 64, 4, 4), 1, None), ((32, 256, 7, 7), 32, None),
                                  ((40, 640, 7, 7), 10, None)], ids=_ids)
def test_gpu_small_groups_one_launch(case):
    """The small-group forward is one kernel (GroupNorm, GroupNorm+SiLU with a residual, GroupNorm+GELU), no
    memset."""
    shape, G, fmt = case
    x = rand_input(shape, torch.bfloat16, "cuda", memory_format=fmt)
    w = torch.rand(shape[1], device="cuda", dtype=torch.bfloat16) + 0.5
    for fn in (lambda: torch.ops.gnext.group_norm(x, G, w, w, 1e-5),
               lambda: torch.ops.gnext.group_norm_act(x, G, w, w, 1e-5, "silu", x),
               lambda: torch.ops.gnext.group_norm_act(x, G, w, w, 1e-5, "gelu", None)):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(names) == 1 and "small_forward" in names[0], names


@pytest.mark.gpu
@pytest.mark.parametrize("case", [((64, 512, 1, 1), 32, CL), ((64, 64, 4, 4), 1, None), ((32, 256, 7, 7), 32, None),
                                  ((48, 60, 5, 4), 15, None), ((256, 1024, 1, 1), 32, None),
                                  ((40, 640, 7, 7), 10, None), ((48, 512, 8, 8), 8, None)], ids=_ids)
def test_gpu_small_groups_backward(case):
    """The small-group backward: two kernels (dx and the per-channel sums, then dgamma/dbeta), no memset, for
    GroupNorm, GroupNorm+SiLU and GroupNorm+GELU; bitwise the same from run to run; every output mask against
    float64."""
    shape, G, fmt = case
    gen = torch.Generator().manual_seed(23)
    x = rand_input(shape, torch.bfloat16, "cuda", memory_format=fmt, gen=gen)
    w = (torch.rand(shape[1], generator=gen) + 0.5).to("cuda", torch.bfloat16)
    dy = rand_input(shape, torch.bfloat16, "cuda", scale=1.0, offset=0.5, memory_format=fmt, gen=gen)
    _, mean, rstd = torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
    calls = (lambda: torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True]),
             lambda: torch.ops.gnext.group_norm_act_backward(dy, x, mean, rstd, w, w, G, "silu", [True, True, True]),
             lambda: torch.ops.gnext.group_norm_act_backward(dy, x, mean, rstd, w, w, G, "gelu", [True, True, True]))
    for fn in calls:
        first = fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            again = fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(names) == 2 and "small_backward" in names[0] and "gamma_beta" in names[1], names
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    _, rdx, rdw, rdb = reference(x, G, w, w, 1e-5, dy=dy)
    for mask in ([True, False, False], [False, True, True], [False, True, False], [True, True, True]):
        poison("cuda", 4 * x.numel() * x.element_size())
        dx, dw, db = torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, mask)
        for want, got, ref in zip(mask, (dx, dw, db), (rdx, rdw, rdb)):
            assert (got is not None) == want
            if want:
                assert_close_to_ref(got, ref, torch.bfloat16, BWD_TOL)
    if fmt is not None:
        assert dx.is_contiguous(memory_format=fmt)
