# SPDX-License-Identifier: BSD-3-Clause
"""group_norm_act_logsumexp: logsumexp_c([v] + act(GroupNorm(v))), v = x + input_bias, forward and
gradients (x, input_bias, weight, bias) vs a float64 reference on fresh random inputs with non-zero
mean: every activation, dtypes, NCHW / channels_last / strided / 3-D and 5-D inputs, HxW = 1, G = 1,
G = C, odd sizes, C above the block size; NaN/Inf; determinism; CUDA graphs; opcheck; torch.compile;
error messages."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import groupnorm_ext as ge
from conftest import BWD_TOL, DEVICES, act_ref, gn_decomposed, poison, rand_input, rel_err

CL = torch.channels_last
ACTS = list(ge.functional.ACTIVATIONS)
# The output is a logsumexp of O(1..10) values: relative bounds on it and on the gradients.
FWD = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _composite(x, ib, G, w, b, act, residual, eps=1e-5, gn=F.group_norm):
    """The unfused model (KernelBench L2#92's tail) in x's dtype, differentiable."""
    v = x if ib is None else x + ib.view((1, -1) + (1,) * (x.dim() - 2))
    r = act_ref(gn(v, G, w, b, eps), act)
    if residual:
        r = r + v
    return torch.logsumexp(r, 1, keepdim=True)


def _reference(x, ib, G, w, b, act, residual, dy):
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in (x, ib, w, b)]
    out = _composite(leaves[0], leaves[1], G, leaves[2], leaves[3], act, residual, gn=gn_decomposed)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, present, dy.cpu().double()))
    return out.detach(), [next(grads) if t is not None else None for t in leaves]


def _make(shape, dtype, device, fmt=None, with_bias=True, affine=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = rand_input(shape, dtype, device, memory_format=fmt, gen=gen)
    C = shape[1]
    ib = (torch.randn(C, generator=gen) * 2).to(device, dtype) if with_bias else None
    w = (torch.randn(C, generator=gen) * 0.5 + 1).to(device, dtype) if affine else None
    b = (torch.randn(C, generator=gen) * 0.5).to(device, dtype) if affine else None
    return gen, x, ib, w, b


def _check(device, dtype, x, ib, w, b, G, act, residual, gen, tol_scale=1.0):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, ib, w, b)]
    poison(device, 8 * x.numel())
    out = ge.group_norm_act_logsumexp(leaves[0], G, leaves[2], leaves[3], 1e-5, act, residual, leaves[1])
    assert out.shape == (x.shape[0], 1) + tuple(x.shape[2:]) and out.dtype == dtype
    dy = torch.randn(out.shape, generator=gen).to(device, dtype)
    present = [t for t in leaves if t is not None]
    poison(device, 8 * x.numel())
    grads = iter(torch.autograd.grad(out, present, dy))
    grads = [next(grads) if t is not None else None for t in leaves]
    ref, ref_grads = _reference(x, ib, G, w, b, act, residual, dy)
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), ref) <= tol_scale * FWD[dtype], (act, rel_err(out.cpu(), ref))
    for name, g, r in zip(("input", "input_bias", "weight", "bias"), grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            assert g.shape == r.shape and g.dtype == dtype, name
            assert torch.isfinite(g).all(), name
            err = rel_err(g.cpu(), r)
            assert err <= tol_scale * 4 * BWD_TOL[dtype], f"{act} grad {name}: {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
def test_matches_float64_reference(device, act, dtype, fmt):
    seed = ACTS.index(act)
    gen, x, ib, w, b = _make((2, 16, 9, 7), dtype, device, fmt, seed=seed)  # CL: vector loads
    _check(device, dtype, x, ib, w, b, 4, act, True, gen)
    gen, x, ib, w, b = _make((3, 12, 5, 6), dtype, device, fmt, with_bias=False, affine=False, seed=seed + 1)
    _check(device, dtype, x, ib, w, b, 3, act, False, gen)  # C = 12: scalar channel loads (fp16/bf16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,G,fmt", [
    ((1, 8, 1, 1), 8, None),          # HxW = 1, G = C
    ((4, 16, 1, 1), 1, CL),           # HxW = 1, G = 1
    ((2, 6, 13), 3, None),            # 3-D input, odd length
    ((1, 8, 3, 4, 5), 2, None),       # 5-D input
    ((2, 520, 3, 5), 8, CL),          # C above the block size: threads loop over channel parameters
    ((1, 64, 67, 71), 16, CL),        # several CTAs per image, partial last sweep
    ((3, 64, 33, 35), 16, None),      # NCHW, several CTAs per image
])
def test_shapes(device, shape, G, fmt):
    for dtype in (torch.float32, torch.bfloat16):
        gen, x, ib, w, b = _make(shape, dtype, device, fmt, seed=len(shape) + G)
        _check(device, dtype, x, ib, w, b, G, "tanh_hardswish", True, gen)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_large_mean(device):
    gen = torch.Generator().manual_seed(5)
    base = rand_input((4, 24, 10, 12), torch.float32, device, gen=gen)
    ib = torch.randn(16, generator=gen).to(device)
    w = torch.randn(16, generator=gen).to(device)
    sliced = base[1:3, 4:20, 1:9, ::2]                                 # unaligned, non-contiguous
    permuted = base[:, :16].permute(0, 1, 3, 2)                          # transposed spatial dims
    for x in (sliced, permuted):
        _check(device, torch.float32, x, ib, w, w, 4, "silu", True, gen)
    # Large mean, unit variance: float32 itself limits the mean to ~ulp(1e4) = 1e-3, so the bound is
    # scaled by the error of PyTorch's own float32 composite (F.group_norm etc.) on the same input.
    big = rand_input((2, 16, 8, 8), torch.float32, device, scale=1.0, offset=1e4, gen=gen)
    ref = _composite(big.double(), None, 4, w.double(), w.double(), "gelu", False)
    torch_err = rel_err(_composite(big, None, 4, w, w, "gelu", False), ref)
    _check(device, torch.float32, big, None, w, w, 4, "gelu", False, gen,
           tol_scale=max(1.0, 2 * torch_err / FWD[torch.float32]))


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_propagate_like_torch(device):
    x = rand_input((2, 8, 4, 4), torch.float32, device)
    x[0, 3, 1, 2] = float("nan")        # poisons group 1 of sample 0: every pixel of its channels
    x[1, :, 0, 0] = float("inf")        # +inf everywhere in sample 1 -> its statistics are NaN
    out = ge.group_norm_act_logsumexp(x, 4, None, None, 1e-5, "identity", True)
    ref = _composite(x, None, 4, None, None, "identity", True)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    ok = torch.isfinite(ref)
    torch.testing.assert_close(out[ok], ref[ok], rtol=1e-5, atol=1e-5)
    # constant groups: variance 0 gives beta, finite
    c = torch.full((2, 8, 3, 3), 7.0, device=device)
    torch.testing.assert_close(ge.group_norm_act_logsumexp(c, 4, activation="silu", residual=False),
                               _composite(c, None, 4, None, None, "silu", False))


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    x = torch.empty(0, 8, 4, 4, device=device, requires_grad=True)
    out = ge.group_norm_act_logsumexp(x, 4)
    assert out.shape == (0, 1, 4, 4)
    out.sum().backward()
    assert x.grad.shape == x.shape


def _raw_step(x, ib, w, b, dy):
    """Forward and backward of the raw ops (every kernel phase)."""
    out, mean, rstd = torch.ops.gnext.group_norm_act_logsumexp(x, ib, 16, w, b, 1e-5, "tanh_hardswish", True)
    grads = torch.ops.gnext.group_norm_act_logsumexp_backward(dy, out, x, ib, mean, rstd, w, b, 16, "tanh_hardswish",
                                                             True, [True, True, True, True])
    return [out, mean, rstd, *grads]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
def test_deterministic(fmt):
    gen, x, ib, w, b = _make((2, 64, 40, 40), torch.float16, "cuda", fmt, seed=3)
    dy = torch.randn((2, 1, 40, 40), generator=gen).to("cuda", torch.float16)
    first = _raw_step(x, ib, w, b, dy)
    for _ in range(9):
        for i, (a, e) in enumerate(zip(_raw_step(x, ib, w, b, dy), first)):
            assert torch.equal(a, e), f"output {i} differs between runs"
    leaves = [t.clone().requires_grad_() for t in (x, ib, w, b)]
    runs = [torch.autograd.grad(ge.group_norm_act_logsumexp(leaves[0], 16, leaves[2], leaves[3], 1e-5,
                                                           "tanh_hardswish", True, leaves[1]), leaves, dy)
            for _ in range(3)]
    assert all(torch.equal(a, e) for r in runs[1:] for a, e in zip(r, runs[0]))


@pytest.mark.gpu
def test_graph_replay():
    gen, x, ib, w, b = _make((2, 64, 40, 40), torch.float32, "cuda", CL, seed=4)
    static = [x, ib, w, b, torch.randn((2, 1, 40, 40), generator=gen).cuda()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _raw_step(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _raw_step(*static)
    for seed in range(3):
        fresh = _make((2, 64, 40, 40), torch.float32, "cuda", CL, seed=10 + seed)[1:]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, e) in enumerate(zip(static_out, _raw_step(*static))):
            assert torch.equal(a, e), f"output {i}: replay differs from eager"


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(2)
    for shape, G, fmt, act in [((2, 6, 5, 7), 3, None, "silu"), ((2, 8, 4, 4), 4, CL, "tanh_hardswish")]:
        x = rand_input(shape, torch.float32, device, memory_format=fmt, gen=gen)
        w = torch.randn(shape[1], generator=gen).to(device)
        torch.library.opcheck(torch.ops.gnext.group_norm_act_logsumexp.default, (x, w, G, w, w, 1e-5, act, True))
        torch.library.opcheck(torch.ops.gnext.group_norm_act_logsumexp.default,
                              (x.requires_grad_(), None, G, w, None, 1e-5, act, False))
        out, mean, rstd = torch.ops.gnext.group_norm_act_logsumexp(x, w, G, w, w, 1e-5, act, True)
        torch.library.opcheck(torch.ops.gnext.group_norm_act_logsumexp_backward.default,
                              (torch.randn_like(out), out.detach(), x.detach(), w, mean, rstd, w, w, G, act, True,
                               [True, True, True, True]))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()
    gen, x, ib, w, b = _make((2, 8, 6, 6), torch.float32, device, seed=4)
    leaves = [t.requires_grad_() for t in (x, ib, w, b)]

    def f(x, ib, w, b):
        return ge.group_norm_act_logsumexp(x, 4, w, b, 1e-5, "tanh_hardswish", True, ib)

    fc = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    y_c, y_e = fc(*leaves), f(*leaves)
    torch.testing.assert_close(y_c, y_e)
    for a, e in zip(torch.autograd.grad(y_c.sum(), leaves), torch.autograd.grad(y_e.sum(), leaves)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_messages(device):
    x = torch.randn(2, 8, 4, 4, device=device)
    op = torch.ops.gnext.group_norm_act_logsumexp
    with pytest.raises(RuntimeError, match=r"input_bias must have shape \(C,\) = \(8\)"):
        op(x, torch.zeros(4, device=device), 4, None, None, 1e-5, "silu", True)
    with pytest.raises(RuntimeError, match="activation must be one of"):
        op(x, None, 4, None, None, 1e-5, "swish", True)
    with pytest.raises(RuntimeError, match="C=8 must be divisible by num_groups=3"):
        op(x, None, 3, None, None, 1e-5, "silu", True)
    with pytest.raises(RuntimeError, match="input dtype must be float32, float16 or bfloat16"):
        op(x.to(torch.int32), None, 4, None, None, 1e-5, "silu", True)
    with pytest.raises(RuntimeError, match="input_bias dtype must match input"):
        op(x, torch.zeros(8, device=device, dtype=torch.float64), 4, None, None, 1e-5, "silu", True)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="input_bias is on cpu but input is on cuda"):
            op(x, torch.zeros(8), 4, None, None, 1e-5, "silu", True)
    out, mean, rstd = op(x, None, 4, None, None, 1e-5, "silu", True)
    with pytest.raises(RuntimeError, match=r"grad_out.shape=\[2, 8, 4, 4\] must be \(N, 1, \*\)"):
        torch.ops.gnext.group_norm_act_logsumexp_backward(x, out, x, None, mean, rstd, None, None, 4, "silu", True,
                                                          [True, False, False, False])
