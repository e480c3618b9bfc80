# SPDX-License-Identifier: BSD-3-Clause
"""Reliability of the ops built on the GroupNorm kernels' pointwise modes (group_norm_act and the
fused ConvTranspose2d + GELU + GroupNorm): property-based tests vs float64, bitwise determinism
over 10 runs, CUDA-graph replay equal to eager, and bad-input messages. (group_norm itself:
test_fuzz.py, test_group_norm.py, test_errors.py.)"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import groupnorm_ext as ge
from conftest import DEVICES, LAYOUTS, act_ref, gn_decomposed, layout_input, rand_input, rel_err

SMOOTH = ["identity", "silu", "gelu", "gelu_tanh", "tanh"]  # act' continuous: backward fuzzed
KINKED = ["relu", "hardswish", "tanh_hardswish"]  # act' jumps (0, +-3): forward fuzzed only
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.6e-2, 6e-2)}


def _examples(device, cuda_default, cpu_default):
    return int(os.environ.get("GNEXT_FUZZ_EXAMPLES_OPS", cuda_default if device == "cuda" else cpu_default))


EPS32 = 2.0**-24


@st.composite
def act_problems(draw):
    G, D, N = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    spatial = [draw(st.sampled_from([1, 2, 3, 5, 8, 13, 16])) for _ in range(draw(st.integers(0, 3)))]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    if dtype == torch.float32:  # large means and tiny variances too
        offset, scale = draw(st.sampled_from([0.0, 2.0, -5.0, 1e3, 1e4])), draw(st.sampled_from([1e-2, 1.0, 2.0]))
    else:  # keep the input distinguishable after rounding to 8-11 bits
        offset, scale = draw(st.sampled_from([0.0, 2.0, -5.0])), 2.0
    return dict(shape=(N, G * D, *spatial), G=G, act=draw(st.sampled_from(SMOOTH + KINKED)), dtype=dtype,
                layout=draw(st.sampled_from(LAYOUTS)), residual=draw(st.booleans()), affine=draw(st.booleans()),
                offset=offset, scale=scale, seed=draw(st.integers(0, 2**31 - 1)))


def _fuzz_inputs(pb, device):
    """x in the drawn layout, weight/bias (or None), float64 CPU copies, and the relative error that
    float32 statistics alone cause (~ulp32(|mean|) * rstd: large means with small variances)."""
    shape, G, dtype = pb["shape"], pb["G"], pb["dtype"]
    if device == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    gen = torch.Generator().manual_seed(pb["seed"])
    x = layout_input(shape, dtype, device, pb["layout"], pb["scale"], pb["offset"], gen)
    C = shape[1]
    w = (torch.randn(C, generator=gen) * 0.5 + 1).to(device, dtype) if pb["affine"] else None
    b = (torch.randn(C, generator=gen) * 0.5).to(device, dtype) if pb["affine"] else None
    xg = x.detach().cpu().double().reshape(shape[0], G, -1)
    mean, rstd = xg.mean(-1), (xg.var(-1, unbiased=False) + 1e-5).rsqrt()
    stat_rel = 8 * EPS32 * (1 + (mean.abs() * rstd).max().item())
    return gen, dtype, x, w, b, stat_rel


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_group_norm_act(device):
    @settings(max_examples=_examples(device, 500, 30), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(act_problems())
    def run(pb):
        shape, G = pb["shape"], pb["G"]
        gen, dtype, x, w, b, stat_rel = _fuzz_inputs(pb, device)
        res = (layout_input(shape, dtype, device, pb["layout"], 1.0, 0.0, gen) if pb["residual"] else None)
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b, res)]
        y = ge.group_norm_act(leaves[0], G, leaves[1], leaves[2], 1e-5, pb["act"], leaves[3])
        refs = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in (x, w, b, res)]
        ref = act_ref(gn_decomposed(refs[0], G, refs[1], refs[2]), pb["act"])
        if refs[3] is not None:
            ref = ref + refs[3]
        ftol, btol = (t + stat_rel for t in TOL[dtype])
        assert y.shape == x.shape and torch.isfinite(y).all()
        scale = ref.detach().abs().max().item() + 1.0
        assert (y.detach().cpu().double() - ref.detach()).abs().max().item() <= 4 * ftol * scale, pb
        if pb["act"] in KINKED:
            return
        dy = torch.randn(shape, generator=gen).to(device, dtype)
        got = [t for t in leaves if t is not None]
        want = [t for t in refs if t is not None]
        # Absolute floor: rounding amplified by rstd (up to 1/sqrt(eps) for near-constant groups).
        xg = refs[0].detach().reshape(shape[0], G, -1)
        rstd_max = (xg.var(-1, unbiased=False) + 1e-5).rsqrt().max().item()
        floor = 4 * btol * dy.abs().max().item() * rstd_max * (1 + (w.abs().max().item() if w is not None else 0))
        for g, r in zip(torch.autograd.grad(y, got, dy), torch.autograd.grad(ref, want, dy.cpu().double())):
            assert torch.isfinite(g).all()
            assert rel_err(g.cpu(), r) <= 4 * btol or (g.cpu().double() - r).abs().max() <= floor, pb

    run()


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_group_norm_act_logsumexp(device):
    @settings(max_examples=_examples(device, 500, 30), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(act_problems(), st.booleans())
    def run(pb, with_input_bias):
        shape, G = pb["shape"], pb["G"]
        gen, dtype, x, w, b, stat_rel = _fuzz_inputs(pb, device)
        ib = (torch.randn(shape[1], generator=gen)).to(device, dtype) if with_input_bias else None
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, ib, w, b)]
        y = ge.group_norm_act_logsumexp(leaves[0], G, leaves[2], leaves[3], 1e-5, pb["act"], pb["residual"], leaves[1])
        refs = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in (x, ib, w, b)]
        v = refs[0] if refs[1] is None else refs[0] + refs[1].view((1, -1) + (1,) * (x.dim() - 2))
        r = act_ref(gn_decomposed(v, G, refs[2], refs[3]), pb["act"])
        ref = torch.logsumexp(r + v if pb["residual"] else r, 1, keepdim=True)
        ftol, btol = (t + stat_rel for t in TOL[dtype])
        assert y.shape == ref.shape and torch.isfinite(y).all()
        # the residual carries |v| (up to 1e4) into the logsumexp: bound relative to its size
        scale = ref.detach().abs().max().item() + 1.0
        assert (y.detach().cpu().double() - ref.detach()).abs().max().item() <= 4 * ftol * scale, pb
        if pb["act"] in KINKED:
            return
        dy = torch.randn(y.shape, generator=gen).to(device, dtype)
        got = [t for t in leaves if t is not None]
        want = [t for t in refs if t is not None]
        vg = v.detach().reshape(shape[0], G, -1)
        rstd_max = (vg.var(-1, unbiased=False) + 1e-5).rsqrt().max().item()
        floor = 4 * btol * dy.abs().max().item() * rstd_max * (1 + (w.abs().max().item() if w is not None else 0))
        for g, rr in zip(torch.autograd.grad(y, got, dy), torch.autograd.grad(ref, want, dy.cpu().double())):
            assert torch.isfinite(g).all()
            assert rel_err(g.cpu(), rr) <= 4 * btol or (g.cpu().double() - rr).abs().max() <= floor, pb

    run()


@st.composite
def conv_problems(draw):
    groups = draw(st.sampled_from([1, 2]))
    cin = groups * draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 4]))
    cout = groups * G * draw(st.integers(1, 2))
    k = draw(st.integers(1, 4))
    stride = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    padding = draw(st.integers(0, (k - 1) * dilation // 2))
    output_padding = draw(st.integers(0, max(0, min(stride, dilation) - 1)))
    return dict(N=draw(st.integers(1, 2)), cin=cin, cout=cout, H=draw(st.integers(1, 9)), W=draw(st.integers(1, 9)),
                k=k, stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                groups=groups, G=G, approx=draw(st.sampled_from(["none", "tanh"])), bias=draw(st.booleans()),
                affine=draw(st.booleans()), layout=draw(st.sampled_from(["contiguous", "channels_last", "sliced"])),
                offset=draw(st.sampled_from([0.5, -3.0, 100.0])), seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_conv_transpose2d_gelu_group_norm(device):
    @settings(max_examples=_examples(device, 500, 20), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(conv_problems())
    def run(pb):
        gen = torch.Generator().manual_seed(pb["seed"])
        x = layout_input((pb["N"], pb["cin"], pb["H"], pb["W"]), torch.float32, device, pb["layout"], 1.0,
                         pb["offset"], gen)
        w = (torch.randn(pb["cin"], pb["cout"] // pb["groups"], pb["k"], pb["k"], generator=gen) * 0.5).to(device)
        cb = (torch.randn(pb["cout"], generator=gen) * 0.5).to(device) if pb["bias"] else None
        gw = (torch.randn(pb["cout"], generator=gen) * 0.5 + 1).to(device) if pb["affine"] else None
        gb = (torch.randn(pb["cout"], generator=gen) * 0.5).to(device) if pb["affine"] else None
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, cb, gw, gb)]
        args = (pb["stride"], pb["padding"], pb["output_padding"], pb["dilation"], pb["groups"], 1e-5, pb["approx"])
        torch.backends.cudnn.allow_tf32 = False
        try:
            y = ge.conv_transpose2d_gelu_group_norm(leaves[0], leaves[1], leaves[2], pb["G"], leaves[3], leaves[4],
                                                    *args)
            dy = torch.randn(y.shape, generator=gen).to(device)
            got = torch.autograd.grad(y, [t for t in leaves if t is not None], dy)
        finally:
            torch.backends.cudnn.allow_tf32 = True
        refs = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in (x, w, cb, gw, gb)]
        z = F.conv_transpose2d(refs[0], refs[1], refs[2], pb["stride"], pb["padding"], pb["output_padding"],
                               pb["groups"], pb["dilation"])
        a = F.gelu(z, approximate=pb["approx"])
        ref = gn_decomposed(a, pb["G"], refs[3], refs[4])
        assert y.shape == ref.shape and torch.isfinite(y).all()
        assert (y.detach().cpu().double() - ref.detach()).abs().max().item() <= 1e-4 * (ref.abs().max().item() + 1), pb
        want = torch.autograd.grad(ref, [t for t in refs if t is not None], dy.cpu().double(), retain_graph=True)
        dz = torch.autograd.grad(ref, z, dy.cpu().double())[0]
        ag = a.detach().reshape(a.shape[0], pb["G"], -1)
        rstd_max = (ag.var(-1, unbiased=False) + 1e-5).rsqrt().max().item()  # near-constant groups amplify
        # PyTorch's own float32 unfused model (its native GroupNorm kernels, which use the same analytic
        # backward with a float32 mean) on the same inputs: large GN-input means (offset 100) make the
        # float32 gradients cancellation-dominated; gnext must be within 4x of PyTorch's error there.
        f32 = [t.detach().cpu().float().requires_grad_() if t is not None else None for t in (x, w, cb, gw, gb)]
        z32 = F.conv_transpose2d(f32[0], f32[1], f32[2], pb["stride"], pb["padding"], pb["output_padding"],
                                 pb["groups"], pb["dilation"])
        gn32 = F.group_norm if z32[0].numel() > pb["G"] else gn_decomposed  # F.group_norm: > 1 value per group
        ref32 = gn32(F.gelu(z32, approximate=pb["approx"]), pb["G"], f32[3], f32[4])
        torch_grads = torch.autograd.grad(ref32, [t for t in f32 if t is not None], dy.cpu())
        # float32 statistics: the mean's rounding, ~ulp32(|mean|) * rstd relative, bounds the analytic backward
        rstd_g = (ag.var(-1, unbiased=False) + 1e-5).rsqrt()
        stat_rel = 8 * EPS32 * (1 + (ag.mean(-1).abs() * rstd_g).max().item())
        # The conv's gradients sum dz (whose group sums are 0) times x or w: a relative error e of dz gives up
        # to e * sum|dz| * max(|x|, |w|) (inputs offset by 100 make that the whole gradient).
        fanout = dz.abs().sum().item() * max(refs[0].abs().max().item(), refs[1].abs().max().item(), 1.0)
        for g, r, t32 in zip(got, want, torch_grads):
            floor = ((1e-5 + stat_rel) * rstd_max * (r.abs().max().item() + dy.abs().max().item() + 1)
                     + (stat_rel + 16 * EPS32) * fanout)
            err = (g.cpu().double() - r).abs().max().item()
            torch_err = (t32.double() - r).abs().max().item()
            assert rel_err(g.cpu(), r) <= 1e-3 or err <= floor or err <= 4 * torch_err, (pb, err, torch_err)

    run()


def _ops_step(x, wc, gw, gb, res, dy1, dy3):
    """Forward + backward of group_norm_act (two activations) and of the fused op, raw ops."""
    out = []
    for act in ("silu", "tanh_hardswish"):
        y, mean, rstd = torch.ops.gnext.group_norm_act(x, 8, gw, gb, 1e-5, act, res)
        out += [y, mean, rstd, *torch.ops.gnext.group_norm_act_backward(dy1, x, mean, rstd, gw, gb, 8, act,
                                                                          [True, True, True])]
    y3, z, m3, r3, _ = torch.ops.gnext.conv_transpose2d_gelu_group_norm(x, wc, gb, [1, 1], [0, 0], [0, 0], [1, 1], 1, 8,
                                                                    gw, gb, 1e-5, "none")
    # backward without the conv gradients (cuDNN's weight gradient is not deterministic by default)
    out += [y3, z, m3, r3, *[t for t in torch.ops.gnext.conv_transpose2d_gelu_group_norm_backward(
        dy3, x, wc, gb, z, m3, r3, gw, [1, 1], [0, 0], [0, 0], [1, 1], 1, 8, "none", [False, False, True, True, True])
        if t is not None]]
    return out


def _ops_inputs(gen, fmt=None):
    x = rand_input((2, 64, 40, 40), torch.float32, "cuda", memory_format=fmt, gen=gen)
    wc = (torch.randn(64, 64, 3, 3, generator=gen) * 0.05).cuda()
    gw = (torch.randn(64, generator=gen) * 0.5 + 1).cuda()
    gb = torch.randn(64, generator=gen).cuda()
    res = rand_input((2, 64, 40, 40), torch.float32, "cuda", memory_format=fmt, gen=gen)
    dy1 = torch.randn((2, 64, 40, 40), generator=gen).cuda().contiguous(memory_format=fmt or torch.contiguous_format)
    dy3 = torch.randn((2, 64, 42, 42), generator=gen).cuda().contiguous(memory_format=torch.channels_last)
    return x, wc, gw, gb, res, dy1, dy3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, torch.channels_last], ids=["nchw", "cl"])
def test_gpu_deterministic_ops(fmt):
    inputs = _ops_inputs(torch.Generator().manual_seed(0), fmt)
    first = _ops_step(*inputs)
    for _ in range(9):
        for a, r in zip(_ops_step(*inputs), first):
            assert torch.equal(a, r)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_ops():
    torch.backends.cudnn.benchmark = False
    static = list(_ops_inputs(torch.Generator().manual_seed(1)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _ops_step(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _ops_step(*static)
    for seed in range(3):
        fresh = _ops_inputs(torch.Generator().manual_seed(10 + seed))
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for a, r in zip(static_out, _ops_step(*static)):
            assert torch.equal(a, r)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_propagate_like_pytorch(device):
    x = rand_input((2, 8, 6, 6), torch.float32, device)
    x[0, 0, 1, 1] = float("nan")
    x[1, 5, 2, 3] = float("inf")
    y = ge.group_norm_act(x, 4, None, None, 1e-5, "silu", None)
    ref = F.silu(F.group_norm(x, 4))
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    torch.testing.assert_close(y[ok], ref[ok], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_constant_group_gives_beta_activated(device):
    x = torch.full((2, 8, 5, 5), 3.0, device=device)
    b = torch.randn(8, device=device)
    y = ge.group_norm_act(x, 4, None, b, 1e-5, "gelu", None)
    torch.testing.assert_close(y, F.gelu(b).view(1, 8, 1, 1).expand_as(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_size_and_noncontiguous_grads(device):
    for shape in [(0, 8, 4, 4), (2, 8, 0, 4)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        y = ge.group_norm_act(x, 4, None, None, 1e-5, "silu", None)
        assert y.shape == x.shape
        (g,) = torch.autograd.grad(y.sum(), x)
        assert g.shape == x.shape
    x = rand_input((2, 8, 6, 5), torch.float32, device).requires_grad_()
    dy = torch.randn(2, 8, 5, 6, device=device).transpose(2, 3)  # non-contiguous grad_out
    y = ge.group_norm_act(x, 4, None, None, 1e-5, "gelu", None)
    ref = F.gelu(F.group_norm(x, 4))
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0],
                               rtol=1e-4, atol=1e-5)
