# SPDX-License-Identifier: BSD-3-Clause
"""group_norm_act_modulate: act(GroupNorm(x) * scale + shift) with tensor scale and shift, against a float64
reference (conftest.reference's GroupNorm, PyTorch's activations), forward and the gradients of input, weight, bias,
scale and shift, on odd sizes and every layout; its argument errors; and the converter on diffusers' CogVideoX
decoder (CogVideoXSpatialNorm3D), with and without a traced activation."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_ext as ge

from conftest import (BWD_TOL, DEVICES, FWD_TOL, LAYOUTS, act_ref, assert_close_to_ref, gn_decomposed, layout_input,
                      poison, reference)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def _up(t, like):
    """t upsampled to like's size by nearest neighbour (float64 on the CPU: PyTorch's own source indices)."""
    return t if t.shape == like.shape else F.interpolate(t, size=like.shape[2:], mode="nearest")


def _check(device, dtype, shape, G, act, layout="contiguous", affine=True, seed=0, offset=2.0, backward=True,
           fwd_tol=FWD_TOL, bwd_tol=BWD_TOL, small=None, input_bias=None):
    """small: the shape of scale and shift where smaller than x's (nearest-upsampled by the op). input_bias: the
    dtype of a per-channel bias that the op adds to x before the norm (None: none)."""
    gen = torch.Generator().manual_seed(seed)
    x = layout_input(shape, dtype, device, layout, 3.0, offset, gen)
    s = layout_input(small or shape, dtype, device, layout, 0.5, 1.0, gen)  # scale around 1, shift around -0.5
    t = layout_input(small or shape, dtype, device, layout, 1.0, -0.5, gen)
    C = shape[1]
    w = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device) if affine else None
    b = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).to(device) if affine else None
    ib = (torch.randn(C, generator=gen, dtype=torch.float64) * 3).to(device) if input_bias else None
    view = (1, C) + (1,) * (len(shape) - 2)
    n_ref, _, _ = reference(x if ib is None else x.double() + ib.view(view), G, w, b, 1e-5)
    ref = act_ref(n_ref * _up(s.double(), x) + _up(t.double(), x), act)
    poison(device, ref.numel() * 4)
    xr, sr, tr = (v.detach().requires_grad_(backward) for v in (x, s, t))
    wr = w.to(dtype).requires_grad_(backward) if affine else None
    br = b.to(dtype).requires_grad_(backward) if affine else None
    ibr = ib.to(input_bias).requires_grad_(backward) if input_bias else None
    out = ge.group_norm_act_modulate(xr, G, sr, tr, wr, br, 1e-5, act, input_bias=ibr)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert_close_to_ref(out.detach(), ref, dtype, fwd_tol)
    if not backward:
        return
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    out.backward(dy.to(dtype))
    xd, sd, td = (v.detach().double().requires_grad_() for v in (x, s, t))
    wd = w.detach().clone().requires_grad_() if affine else None
    bd = b.detach().clone().requires_grad_() if affine else None
    ibd = ib.detach().clone().requires_grad_() if input_bias else None
    xin = xd if ibd is None else xd + ibd.view(view)
    act_ref(gn_decomposed(xin, G, wd, bd) * _up(sd, xd) + _up(td, xd), act).backward(dy)
    pairs = ((xr, xd), (sr, sd), (tr, td)) + (((wr, wd), (br, bd)) if affine else ())
    for got, want in pairs + (((ibr, ibd),) if input_bias else ()):
        assert_close_to_ref(got.grad, want.grad, dtype, bwd_tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape,G", [
    ((2, 12, 5, 9, 8), 4),   # 5-D, rows of 360 (whole vectors)
    ((1, 8, 3, 6, 10), 8),   # G = C
    ((3, 6, 7, 5), 1),       # 4-D, G = 1, rows of 35 elements (no whole vectors: the scalar kernel)
    ((2, 4, 11), 2),         # 3-D
    ((1, 16, 1, 1), 4),      # HxW = 1
    ((1, 4, 4, 3000), 2),    # rows of several CTAs
])
def test_matches_float64_reference(device, dtype, shape, G):
    _check(device, dtype, shape, G, "silu", seed=len(shape) + shape[-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape,small,G", [
    ((1, 8, 3, 32, 48), (1, 8, 3, 4, 6), 4),     # 8x in h and w (whole vectors along W)
    ((2, 6, 5, 13, 21), (2, 6, 5, 5, 4), 3),     # ratios 5/13 and 4/21: the float source index, scalar kernel
    ((2, 12, 17, 24), (2, 12, 17, 3), 4),        # 4-D, h = H, w smaller
    ((1, 4, 2, 40, 64), (1, 4, 2, 40, 1), 4),    # one column
    ((1, 16, 6, 1000), (1, 16, 3, 7), 8),        # 4-D, rows of several CTAs
])
def test_smaller_scale_and_shift(device, dtype, shape, small, G):
    """scale and shift of smaller (h, w): x's source element per F.interpolate(mode="nearest"), gradients of scale
    and shift summed over the elements that read them."""
    _check(device, dtype, shape, G, "silu", seed=shape[-1] + small[-1], small=small)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("small", [None, (2, 8, 3, 3, 5)], ids=["full", "small"])
@pytest.mark.parametrize("bias_dtype", ["input", "float32"])
def test_input_bias(device, dtype, small, bias_dtype):
    """GroupNorm of x + input_bias[c] (a convolution's bias not yet added): forward and every gradient, the bias's
    included, against float64; the bias in the input's dtype or float32."""
    _check(device, dtype, (2, 8, 3, 12, 20), 4, "silu", seed=13, small=small,
           input_bias=dtype if bias_dtype == "input" else torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_smaller_scale_and_shift_layouts(device, layout):
    _check(device, torch.float16, (2, 8, 3, 24, 16), 4, "gelu", layout=layout, seed=9, small=(2, 8, 3, 6, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["identity", "relu", "gelu", "tanh_hardswish"])
def test_activations(device, act):
    _check(device, torch.float32, (2, 12, 3, 10, 8), 3, act, seed=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(device, layout):
    """Channels_last, permuted and sliced (unaligned) x, scale and shift: copied to contiguous, same values."""
    _check(device, torch.float16, (2, 8, 3, 12, 10), 4, "silu", layout=layout, seed=5)


@pytest.mark.parametrize("device", DEVICES)
def test_no_affine_large_mean(device):
    """Mean 300, std 3 (as test_group_norm_act_pad's: ulp(300) / 2 bounds a float32 GroupNorm's error)."""
    _check(device, torch.float32, (1, 6, 4, 9, 11), 3, "silu", affine=False, offset=300.0, seed=7,
           fwd_tol={torch.float32: 4e-5}, bwd_tol={torch.float32: 4e-4})


@pytest.mark.gpu
def test_cuda_graph_and_compile():
    x = torch.randn(2, 16, 3, 20, 18, device="cuda", dtype=torch.float16) + 1
    s, t = torch.randn_like(x), torch.randn_like(x)
    w, b = torch.randn(16, device="cuda"), torch.randn(16, device="cuda")
    ref = ge.group_norm_act_modulate(x, 4, s, t, w, b, 1e-5, "silu")
    f = torch.compile(lambda a: ge.group_norm_act_modulate(a, 4, s, t, w, b, 1e-5, "silu"), fullgraph=True)
    torch.testing.assert_close(f(x), ref, rtol=0, atol=0)
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ge.group_norm_act_modulate(static, 4, s, t, w, b, 1e-5, "silu")
    static.copy_(x * 2)
    g.replay()
    torch.testing.assert_close(out, ge.group_norm_act_modulate(x * 2, 4, s, t, w, b, 1e-5, "silu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("small", [False, True], ids=["full", "small"])
def test_into_a_slice_of_a_larger_buffer(device, dtype, small):
    """out=: the result written into buf[:, :, k:] (planes 2 + T frames apart), equal to the op's own output; the
    k frames before it, the second sample's padding and nothing else touched."""
    gen = torch.Generator().manual_seed(21)
    N, C, T, H, W, k = 2, 8, 5, 12, 16, 2
    x = (torch.randn(N, C, T, H, W, generator=gen) * 2 + 3).to(device, dtype)
    sshape = (N, C, T, 3, 4) if small else x.shape
    sc = (torch.randn(sshape, generator=gen) * 0.5 + 1).to(device, dtype)
    sh = torch.randn(sshape, generator=gen).to(device, dtype)
    w, b = torch.randn(C, generator=gen).to(device, dtype), torch.randn(C, generator=gen).to(device, dtype)
    want = ge.group_norm_act_modulate(x, 4, sc, sh, w, b, 1e-5, "silu")
    buf = torch.full((N, C, T + k, H, W), 7.0, device=device, dtype=dtype)
    got = ge.group_norm_act_modulate(x, 4, sc, sh, w, b, 1e-5, "silu", out=buf[:, :, k:])
    assert got.data_ptr() == buf[:, :, k:].data_ptr()
    torch.testing.assert_close(buf[:, :, k:], want, rtol=0, atol=0)
    assert bool((buf[:, :, :k] == 7).all())
    ib = torch.randn(C, generator=gen).to(device)  # with an input bias (float32)
    ge.group_norm_act_modulate(x, 4, sc, sh, w, b, 1e-5, "silu", out=buf[:, :, k:], input_bias=ib)
    torch.testing.assert_close(buf[:, :, k:], ge.group_norm_act_modulate(x, 4, sc, sh, w, b, 1e-5, "silu",
                                                                         input_bias=ib), rtol=0, atol=0)
    # a 4-D out whose channels are rows of a wider buffer (row stride W + 3 elements: unaligned rows, scalar path)
    x4 = x[:, :, 0]
    wide = torch.full((N, C, H * W + 3), 5.0, device=device, dtype=dtype)
    out4 = wide[:, :, 3:].view(N, C, H, W)
    ge.group_norm_act_modulate(x4, 4, sc[:, :, 0], sh[:, :, 0], w, b, 1e-5, "relu", out=out4)
    torch.testing.assert_close(out4, ge.group_norm_act_modulate(x4, 4, sc[:, :, 0], sh[:, :, 0], w, b, 1e-5, "relu"),
                               rtol=0, atol=0)
    assert bool((wide[:, :, :3] == 5).all())


@pytest.mark.parametrize("device", DEVICES)
def test_into_errors(device):
    x = torch.randn(1, 8, 3, 4, device=device)
    op = "gnext.group_norm_act_modulate_into"
    with pytest.raises(RuntimeError, match=rf"{op}: out.shape=\[1, 8, 3, 5\] must equal input.shape=\[1, 8, 3, 4\]"):
        ge.group_norm_act_modulate(x, 4, x, x, out=torch.empty(1, 8, 3, 5, device=device))
    with pytest.raises(RuntimeError, match=rf"{op}: out dtype \(Half\) must equal input dtype \(Float\)"):
        ge.group_norm_act_modulate(x, 4, x, x, out=torch.empty_like(x, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"out must have each \(n, c\) plane contiguous and the planes apart.*"
                                           r"strides \[96, 1, 32, 8\]"):
        ge.group_norm_act_modulate(x, 4, x, x, out=torch.empty(1, 3, 4, 8, device=device).permute(0, 3, 1, 2))
    with pytest.raises(RuntimeError, match=r"planes apart.*strides \[0, 0, 4, 1\]"):
        ge.group_norm_act_modulate(x, 4, x, x, out=torch.empty(3, 4, device=device).expand(1, 8, 3, 4))
    w = torch.ones(8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"{op} is not differentiable: it writes into out"):
        ge.group_norm_act_modulate(x, 4, x, x, w, out=torch.empty_like(x))
    with torch.no_grad():
        ge.group_norm_act_modulate(x, 4, x, x, w, out=torch.empty_like(x))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """Schema, fake kernel, autograd registration and AOT dispatch (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 8, 3, 5, generator=gen) + 1).to(device)
    s, t = torch.randn(x.shape, generator=gen).to(device), torch.randn(x.shape, generator=gen).to(device)
    w, b = torch.randn(8, generator=gen).to(device), torch.randn(8, generator=gen).to(device)
    op = torch.ops.gnext.group_norm_act_modulate.default
    torch.library.opcheck(op, (x, 4, w, b, 1e-5, s, t, "silu"))
    torch.library.opcheck(op, (x.clone().requires_grad_(), 4, w.clone().requires_grad_(), None, 1e-5,
                               s.clone().requires_grad_(), t, "identity"))
    small = (s[..., :2].contiguous(), t[..., :2].contiguous())
    torch.library.opcheck(op, (x.clone().requires_grad_(), 4, w, b, 1e-5, small[0].requires_grad_(), small[1], "gelu"))
    torch.library.opcheck(op, (x.clone().requires_grad_(), 4, w, b, 1e-5, s, t, "silu", b.clone().requires_grad_()))
    # 5-D, smaller scale and shift with gradients: their adjoint under symbolic sizes (aot_dispatch_dynamic)
    x5 = (torch.randn(2, 8, 3, 4, 8, generator=gen) + 1).to(device)
    s5, t5 = (torch.randn(2, 8, 3, 2, 2, generator=gen).to(device) for _ in range(2))
    torch.library.opcheck(op, (x5.clone().requires_grad_(), 4, w, b, 1e-5, s5.clone().requires_grad_(),
                               t5.clone().requires_grad_(), "silu"))
    into = torch.ops.gnext.group_norm_act_modulate_into.default
    torch.library.opcheck(into, (x, 4, w, b, 1e-5, small[0].detach(), small[1], "silu",
                                 torch.empty(2, 8, 4, 5, device=device)[:, :, 1:], b),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def _cat_ref(y, k, cache):
    front = cache if cache is not None else y[:, :, :1].expand(-1, -1, k, -1, -1)
    return torch.cat([front, y], dim=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("cached", [False, True], ids=["first", "cache"])
@pytest.mark.parametrize("small", [False, True], ids=["full", "small"])
def test_cat_matches_float64_reference(device, dtype, cached, small):
    """group_norm_act_modulate_cat = torch.cat([cache or k copies of the first frame, y], 2) of the modulated norm y
    (a causal convolution's input), forward and gradients (input, scale, shift, weight, bias, input_bias, cache)
    against float64; its frames after the front ones bitwise group_norm_act_modulate's output."""
    gen = torch.Generator().manual_seed(31)
    N, C, T, H, W, k, G = 2, 8, 5, 6, 10, 2, 4
    x = (torch.randn(N, C, T, H, W, generator=gen, dtype=torch.float64) * 3 + 2).to(device, dtype)
    sshape = (N, C, T, 3, 4) if small else x.shape
    sc = (torch.randn(sshape, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device, dtype)
    sh = (torch.randn(sshape, generator=gen, dtype=torch.float64) - 0.5).to(device, dtype)
    w = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device, dtype)
    b = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).to(device, dtype)
    ib = (torch.randn(C, generator=gen, dtype=torch.float64) * 3).to(device, torch.float32)
    cache = torch.randn(N, C, k, H, W, generator=gen, dtype=torch.float64).to(device, dtype) if cached else None
    view = (1, C, 1, 1, 1)
    n_ref, _, _ = reference(x.double() + ib.double().view(view), G, w, b, 1e-5)
    ref = _cat_ref(act_ref(n_ref * _up(sc.double(), x) + _up(sh.double(), x), "silu"), k,
                   None if cache is None else cache.double())
    poison(device, ref.numel() * 4)
    leaves = [v.detach().clone().requires_grad_() for v in (x, sc, sh, w, b, ib)]
    cr = cache.detach().clone().requires_grad_() if cached else None
    out, mean, rstd = torch.ops.gnext.group_norm_act_modulate_cat(*leaves[:1], G, *leaves[3:5], 1e-5, *leaves[1:3],
                                                                  "silu", k, cr, leaves[5])
    assert out.shape == (N, C, k + T, H, W) and out.dtype == dtype and out.is_contiguous() and mean.shape == (N, G)
    assert_close_to_ref(out.detach(), ref, dtype, FWD_TOL)
    y = ge.group_norm_act_modulate(x, G, sc, sh, w, b, 1e-5, "silu", input_bias=ib)
    torch.testing.assert_close(out.detach()[:, :, k:], y, rtol=0, atol=0)
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    out.backward(dy.to(dtype))
    xd, sd, td, wd, bd, ibd = (v.detach().double().requires_grad_() for v in (x, sc, sh, w, b, ib))
    cd = cache.detach().double().requires_grad_() if cached else None
    y_d = act_ref(gn_decomposed(xd + ibd.view(view), G, wd, bd) * _up(sd, xd) + _up(td, xd), "silu")
    _cat_ref(y_d, k, cd).backward(dy)
    for got, want in zip(leaves + ([cr] if cached else []), [xd, sd, td, wd, bd, ibd] + ([cd] if cached else [])):
        assert_close_to_ref(got.grad, want.grad, dtype, BWD_TOL)  # input_bias: from the input dtype's dx


@pytest.mark.parametrize("device", DEVICES)
def test_cat_edges_and_errors(device):
    """frames = 0 (the modulated output itself), an empty time axis behind a cache, and the errors, which name the
    argument and its value."""
    gen = torch.Generator().manual_seed(32)
    x = (torch.randn(1, 8, 3, 4, 5, generator=gen) + 2).to(device)
    w = torch.randn(8, generator=gen).to(device)
    cat = torch.ops.gnext.group_norm_act_modulate_cat
    torch.testing.assert_close(cat(x, 4, w, None, 1e-5, x, x, "relu", 0, None)[0],
                               ge.group_norm_act_modulate(x, 4, x, x, w, None, 1e-5, "relu"), rtol=0, atol=0)
    cache = torch.randn(1, 8, 2, 4, 5, generator=gen).to(device)
    empty = x[:, :, :0]
    torch.testing.assert_close(cat(empty, 4, w, None, 1e-5, empty, empty, "silu", 2, cache)[0], cache, rtol=0, atol=0)
    op = "gnext.group_norm_act_modulate_cat"
    with pytest.raises(RuntimeError, match=rf"{op}: input must be 5-D \(N, C, T, H, W\), got input.shape=\[1, 8, 4, 5\]"):
        cat(x[:, :, 0], 4, None, None, 1e-5, x[:, :, 0], x[:, :, 0], "silu", 2, None)
    with pytest.raises(RuntimeError, match=rf"{op}: frames must be >= 0, got frames=-1"):
        cat(x, 4, None, None, 1e-5, x, x, "silu", -1, None)
    with pytest.raises(RuntimeError, match=rf"{op}: cache.shape=\[1, 8, 2, 4, 4\] must be \(N, C, frames, H, W\) = "
                                           r"\[1, 8, 2, 4, 5\]"):
        cat(x, 4, None, None, 1e-5, x, x, "silu", 2, cache[..., :4])
    with pytest.raises(RuntimeError, match=rf"{op}: cache.shape=\[1, 8, 2, 4, 5\] must be .* = \[1, 8, 3, 4, 5\]"):
        cat(x, 4, None, None, 1e-5, x, x, "silu", 3, cache)
    with pytest.raises(RuntimeError, match=rf"{op}: cache dtype \(Half\) must equal input dtype \(Float\)"):
        cat(x, 4, None, None, 1e-5, x, x, "silu", 2, cache.half())
    with pytest.raises(RuntimeError, match=rf"{op}: without a cache, frames=2 copies of the first frame need input "
                                           r"frames, got input.shape=\[1, 8, 0, 4, 5\]"):
        cat(empty, 4, None, None, 1e-5, empty, empty, "silu", 2, None)


@pytest.mark.parametrize("device", DEVICES)
def test_cat_opcheck(device):
    """Schema, fake kernel, autograd registration and AOT dispatch of group_norm_act_modulate_cat, with and without
    a cache (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(33)
    x = (torch.randn(2, 8, 3, 4, 5, generator=gen) + 1).to(device)
    s, t = torch.randn(x.shape, generator=gen).to(device), torch.randn(x.shape, generator=gen).to(device)
    w, b = torch.randn(8, generator=gen).to(device), torch.randn(8, generator=gen).to(device)
    cache = torch.randn(2, 8, 2, 4, 5, generator=gen).to(device)
    op = torch.ops.gnext.group_norm_act_modulate_cat.default
    torch.library.opcheck(op, (x, 4, w, b, 1e-5, s, t, "silu", 2, None))
    torch.library.opcheck(op, (x.clone().requires_grad_(), 4, w.clone().requires_grad_(), b, 1e-5,
                               s.clone().requires_grad_(), t, "gelu", 2, cache.clone().requires_grad_(),
                               b.clone().requires_grad_()))
    # smaller scale and shift (2x: their gradients by block sums) with gradients
    x4, c4 = x[..., :4].contiguous(), cache[..., :4].contiguous()
    torch.library.opcheck(op, (x4.requires_grad_(), 4, w, b, 1e-5, s[..., :2, :2].contiguous().requires_grad_(),
                               t[..., :2, :2].contiguous().requires_grad_(), "silu", 2, c4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_scale_gradient_sums_match_aten(device, dtype):
    """The adjoint of the upsampling: power-of-two factors summed by blocks of a reshape equal ATen's
    upsample_nearest backward (sums of 1 to 64 elements); other factors take ATen's."""
    from groupnorm_ext.ops.group_norm_act_modulate import downsample_grad

    gen = torch.Generator().manual_seed(41)
    for big, small in (((2, 3, 5, 32, 64), (2, 3, 5, 4, 8)), ((2, 3, 5, 16, 6), (2, 3, 5, 2, 6)),
                       ((1, 2, 24, 40), (1, 2, 3, 1)), ((1, 2, 3, 12, 20), (1, 2, 3, 5, 4))):
        g = torch.randn(big, generator=gen).to(device, dtype)
        t = torch.empty(small, device=device, dtype=dtype)
        fn = torch.ops.aten.upsample_nearest3d_backward if len(big) == 5 else torch.ops.aten.upsample_nearest2d_backward
        want = fn(g.float(), list(big[2:]), list(small))
        torch.testing.assert_close(downsample_grad(g, t).float(), want, **({} if dtype == torch.float32 else
                                                                         dict(rtol=1e-2, atol=1e-2)))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, 8, 3, 4, 5, device=device)
    assert ge.group_norm_act_modulate(x, 4, x, x).shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    x = torch.randn(1, 8, 3, 4, device=device)
    with pytest.raises(RuntimeError, match=r"scale.shape=\[1, 8, 3, 5\] must equal input.shape=\[1, 8, 3, 4\]"):
        ge.group_norm_act_modulate(x, 4, torch.randn(1, 8, 3, 5, device=device), x)
    small = torch.randn(1, 8, 3, 2, device=device)
    x5 = torch.randn(1, 8, 3, 4, 4, device=device)
    with pytest.raises(RuntimeError, match=r"scale.shape=\[1, 8, 2, 4, 4\] must equal input.shape=\[1, 8, 3, 4, 4\] "
                                           r"or, for a 4-D or 5-D input, differ only in smaller last two sizes"):
        ge.group_norm_act_modulate(x5, 4, x5[:, :, :2], x5[:, :, :2])  # D smaller
    with pytest.raises(RuntimeError, match=r"scale.shape=\[1, 8, 2\] must equal input.shape=\[1, 8, 3\]"):
        ge.group_norm_act_modulate(x[..., 0], 4, x[:, :, :2, 0], x[:, :, :2, 0])  # 3-D: no upsampling
    with pytest.raises(RuntimeError, match=r"shift.shape=\[1, 8, 3, 4\] must equal scale.shape=\[1, 8, 3, 2\]"):
        ge.group_norm_act_modulate(x, 4, small, x)
    with pytest.raises(RuntimeError, match=r"input_bias must have shape \(C,\) = \(8\), got input_bias.shape=\[4\]"):
        ge.group_norm_act_modulate(x, 4, x, x, input_bias=torch.zeros(4, device=device))
    with pytest.raises(RuntimeError, match=r"input_bias dtype must match input \(Float\) or be float32, got Half"):
        ge.group_norm_act_modulate(x, 4, x, x, input_bias=torch.zeros(8, device=device, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"shift dtype \(Half\) must equal input dtype \(Float\)"):
        ge.group_norm_act_modulate(x, 4, x, x.half())
    with pytest.raises(RuntimeError, match="must be divisible by num_groups"):
        ge.group_norm_act_modulate(x, 3, x, x)
    with pytest.raises(RuntimeError, match="activation"):
        ge.group_norm_act_modulate(x, 4, x, x, activation="swish")
    with pytest.raises(RuntimeError, match="input dtype must be float32, float16 or bfloat16"):
        xi = torch.ones(1, 8, 3, 4, dtype=torch.int32, device=device)
        ge.group_norm_act_modulate(xi, 4, xi, xi)


@pytest.mark.gpu
def test_errors_mixed_devices():
    x = torch.randn(1, 8, 3, 4, device="cuda")
    with pytest.raises(RuntimeError, match="scale is on cpu but input is on cuda"):
        ge.group_norm_act_modulate(x, 4, x.cpu(), x)


def _cogvideox_decoder(device):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLCogVideoX(
        block_out_channels=(32, 32, 32, 32), norm_num_groups=8, latent_channels=4, layers_per_block=1).to(device).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return vae


def _spatial_norms(model):
    return [m for m in model.modules() if type(m).__name__ == "CogVideoXSpatialNorm3D"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("traced", [False, True], ids=["blocks", "traced"])
def test_diffusers_cogvideox_decoder(device, traced, monkeypatch, no_tf32):
    """Every CogVideoXSpatialNorm3D of the decoder becomes one group_norm_act_modulate call (traced: with the SiLU
    its block applies next, which then passes the norm's output through); the decode equals the original's."""
    vae = _cogvideox_decoder(device)
    z = torch.randn(1, 4, 5, 8, 8, device=device)  # two batches of latent frames: the second reads the conv caches
    with torch.no_grad():
        ref = vae.decode(z).sample
    n_spatial = len(_spatial_norms(vae))
    if traced:
        dec, counts = ge.convert_group_norm_act(vae.decoder, return_counts=True, example_inputs=(z[:, :, :3],))
    else:
        dec, counts = ge.convert_group_norm_act(vae.decoder, return_counts=True)
    assert counts["spatial_norm"] == n_spatial > 0, counts
    calls = []
    real = ge.convert.group_norm_act_modulate

    def spy(*args, **kwargs):
        calls.append((args[7], tuple(args[2].shape[-2:]) < tuple(args[0].shape[-2:])))
        return real(*args, **kwargs)

    monkeypatch.setattr(ge.convert, "group_norm_act_modulate", spy)
    with torch.no_grad():
        out = vae.decode(z).sample
    assert len(calls) >= n_spatial
    # the resnet blocks' norms write into their convolution's input (SiLU in the op, traced or not); the last norm
    # (norm_out) is paired with its SiLU by the trace only
    n_blocks = sum(type(m).__name__ == "CogVideoXResnetBlock3D" for m in vae.decoder.modules())
    assert counts["pad_into_conv"] == 2 * n_blocks > 0, counts
    assert {a for a, _ in calls} == ({"silu"} if traced else {"silu", "identity"}), calls
    # above the latents' resolution, conv_y and conv_b stay at it and the op upsamples them; at it, full size
    assert {small for _, small in calls} == {True, False}, calls
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_cogvideox_blocks_with_gradients(device, no_tf32):
    """Where a gradient is needed the converted blocks run their own forward (with the modulated norms): the same
    decode and gradients of the weights as the original's; pad_into_conv=False leaves the blocks' forward alone."""
    vae = _cogvideox_decoder(device)
    ref_vae = copy.deepcopy(vae)
    z = torch.randn(1, 4, 3, 8, 8, device=device)
    with pytest.warns(UserWarning, match="none fused with an activation"):  # no trace, no blocks: SiLUs apart
        plain, counts = ge.convert_group_norm_act(copy.deepcopy(vae.decoder), return_counts=True,
                                                  pad_into_conv=False)
    assert counts["pad_into_conv"] == 0 and not any(
        "forward" in m.__dict__ for m in plain.modules() if type(m).__name__ == "CogVideoXResnetBlock3D")
    _, counts = ge.convert_group_norm_act(vae.decoder, return_counts=True)
    assert counts["pad_into_conv"] > 0, counts
    out, ref = vae.decode(z).sample, ref_vae.decode(z).sample
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(vae.decoder.named_parameters(), ref_vae.decoder.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=2e-4, msg=name)


def test_converted_cogvideox_decoder_compiles_without_breaks():
    """The converted decoder (modulated norms at the latents' resolution, blocks writing into their convolutions'
    inputs with out=, conv1's bias in norm2) under torch.compile(fullgraph=True) at inference: one graph, the
    converted eager decoder's values (aot_eager, CPU)."""
    vae = _cogvideox_decoder("cpu")
    z = torch.randn(1, 4, 3, 8, 8)
    _, counts = ge.convert_group_norm_act(vae.decoder, return_counts=True)
    assert counts["pad_into_conv"] > 0, counts
    torch._dynamo.reset()
    with torch.no_grad():
        want, _ = vae.decoder(z)
        got, _ = torch.compile(vae.decoder, fullgraph=True, backend="aot_eager")(z)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_spatial_norm_of_another_source_is_left_alone():
    """A CogVideoXSpatialNorm3D whose class forward differs from the source gnext checked keeps its forward and
    warns (here: a subclass in diffusers' module namespace with its own forward)."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.autoencoders import autoencoder_kl_cogvideox as cog

    class CogVideoXSpatialNorm3D(cog.CogVideoXSpatialNorm3D):
        def forward(self, f, zq, conv_cache=None):
            return self.norm_layer(f), {}

    CogVideoXSpatialNorm3D.__module__ = cog.__name__
    m = nn.Sequential(CogVideoXSpatialNorm3D(8, 4, groups=4))
    with pytest.warns(UserWarning, match="differs from the diffusers source"):
        _, counts = ge.convert_group_norm_act(m, return_counts=True)
    assert counts["spatial_norm"] == 0 and "forward" not in m[0].__dict__
    assert diffusers is not None


def test_converted_spatial_norm_compiles_without_breaks():
    """A traced CogVideoXSpatialNorm3D -> SiLU pair under torch.compile(fullgraph=True): the modulated norm, its gate
    and the activation trace in one graph, and the result equals the original's."""
    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSpatialNorm3D

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.act = CogVideoXSpatialNorm3D(8, 4, groups=4), nn.SiLU()

        def forward(self, f, zq):
            return self.act(self.norm(f, zq)[0])

    torch.manual_seed(5)
    model = Block().eval()
    f, zq = torch.randn(1, 8, 3, 6, 6) + 1, torch.randn(1, 4, 2, 3, 3)
    with torch.no_grad():
        ref = model(f, zq)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(model), example_inputs=(f, zq), return_counts=True)
    assert counts["spatial_norm"] == 1, counts
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(conv, fullgraph=True, backend="aot_eager")(f, zq)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
