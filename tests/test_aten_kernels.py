# SPDX-License-Identifier: BSD-3-Clause
"""enable_aten_kernels(): PyTorch's GroupNorm (F.group_norm, nn.GroupNorm, torch.native_group_norm and its
backward) running gnext's CUDA kernels under PyTorch's own autograd, against a float64 reference and
against ATen's kernels (disabled again) in the same test."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import groupnorm_ext as ge
from conftest import BWD_TOL, FWD_TOL, HAS_CUDA, poison, rand_input, reference, rel_err

gpu = pytest.mark.gpu
CL = torch.channels_last
try:
    from groupnorm_ext._build_info import BUILD_INFO
except ImportError:  # an in-tree build without setup.py's record
    BUILD_INFO = {"cuda": "unknown"}
CPU_ONLY = BUILD_INFO.get("cuda") is None


def test_cpu_only_build_says_there_is_nothing_to_enable():
    if not CPU_ONLY:
        pytest.skip("a CUDA build")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        ge.enable_aten_kernels()
    assert not ge.aten_kernels_enabled()


@pytest.fixture(autouse=True)
def _restore(request):
    """Every test leaves the kernels as it found them (off); a CPU-only build has none to give ATen."""
    if CPU_ONLY and request.node.name != "test_cpu_only_build_says_there_is_nothing_to_enable":
        pytest.skip("CPU-only build (GNEXT_CPU_ONLY=1): no CUDA kernels to give ATen")
    assert not ge.aten_kernels_enabled()
    yield
    ge.disable_aten_kernels()


def _cuda_kernel_debug():
    return torch._C._dispatch_dump("aten::native_group_norm").split("\nCUDA:")[1].splitlines()[0]


def test_enable_disable_switches_the_cuda_kernel():
    assert "group_norm_aten.cpp" not in _cuda_kernel_debug()
    assert ge.enable_aten_kernels() is False
    assert ge.aten_kernels_enabled()
    assert "group_norm_aten.cpp" in _cuda_kernel_debug()
    dump = torch._C._dispatch_dump("aten::native_group_norm_backward")
    assert "group_norm_aten.cpp" in dump.split("\nCUDA:")[1].splitlines()[0]
    assert ge.enable_aten_kernels() is True  # idempotent
    assert ge.disable_aten_kernels() is True
    assert not ge.aten_kernels_enabled()
    assert "group_norm_aten.cpp" not in _cuda_kernel_debug()
    assert ge.disable_aten_kernels() is False


def test_context_manager_restores_on_exception():
    with pytest.raises(ValueError):
        with ge.aten_kernels():
            assert ge.aten_kernels_enabled()
            raise ValueError("inside")
    assert not ge.aten_kernels_enabled()
    ge.enable_aten_kernels()
    with ge.aten_kernels(False):
        assert not ge.aten_kernels_enabled()
    assert ge.aten_kernels_enabled()


def test_cpu_group_norm_untouched():
    gen = torch.Generator().manual_seed(0)
    x = rand_input((2, 8, 5, 5), torch.float32, "cpu", gen=gen).requires_grad_()
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    y0 = F.group_norm(x, 4, w, b)
    (g0,) = torch.autograd.grad(y0.square().sum(), x)
    with ge.aten_kernels():
        y1 = F.group_norm(x, 4, w, b)
        (g1,) = torch.autograd.grad(y1.square().sum(), x)
    assert torch.equal(y0, y1) and torch.equal(g0, g1)


# (shape, G, memory format, affine): odd sizes, G = 1 and G = C, N = 1, HxW = 1, 3-D and 5-D, channels_last.
CASES = [
    ((2, 6, 7, 9), 3, None, "same"),
    ((2, 6, 7, 9), 3, CL, "same"),
    ((3, 12, 5, 5), 12, None, "same"),
    ((2, 8, 16, 16), 1, None, "none"),
    ((1, 32, 8, 8), 8, None, "weight"),
    ((4, 16), 4, None, "same"),
    ((2, 12, 33), 4, None, "same"),
    ((2, 8, 3, 5, 7), 2, None, "same"),
    ((8, 320, 32, 32), 32, None, "same"),
    ((8, 320, 32, 32), 32, CL, "fp32"),
    ((2, 64, 128, 128), 32, None, "fp32"),
]


def _params(C, dtype, affine, gen):
    if affine == "none":
        return None, None
    pdtype = torch.float32 if affine == "fp32" else dtype
    w = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5 + 1).to("cuda", pdtype).requires_grad_()
    b = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).to("cuda", pdtype).requires_grad_()
    return (w, None) if affine == "weight" else (w, b)


def _run(x, G, w, b, dy):
    """F.group_norm forward and its gradients (PyTorch's autograd) for x, w, b."""
    xr = x.detach().clone().requires_grad_()
    y = F.group_norm(xr, G, w, b, 1e-5)
    wanted = [t for t in (xr, w, b) if t is not None]
    grads = torch.autograd.grad(y, wanted, dy)
    return y.detach(), grads


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-G{c[1]}-"
                         f"{'cl' if c[2] is not None else 'nchw'}-{c[3]}")
def test_f_group_norm_matches_reference(case, dtype):
    shape, G, fmt, affine = case
    gen = torch.Generator().manual_seed(sum(shape) + G)
    x = rand_input(shape, dtype, "cuda", memory_format=fmt, gen=gen)
    w, b = _params(shape[1], dtype, affine, gen)
    dy = rand_input(shape, dtype, "cuda", scale=1.0, offset=0.5, gen=gen)
    # ATen's CUDA kernels refuse float32 weights with a float16/bfloat16 input ("expected scalar type"); gnext's
    # take them (only the float64 reference is compared there).
    mixed = affine == "fp32" and dtype != torch.float32
    y_aten, g_aten = (None, [None] * 3) if mixed else _run(x, G, w, b, dy)  # ATen's kernels
    poison("cuda", x.numel() * x.element_size())
    with ge.aten_kernels():
        y, grads = _run(x, G, w, b, dy)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _run(x, G, w, b, dy)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("gnext" in n for n in names), names[:10]
    atens = ("RowwiseMoments", "GroupNorm", "GammaBeta", "ComputeInternalGradients", "BackwardFusedParams")
    assert not any(a in n for n in names if "gnext" not in n for a in atens), names
    ref_y, *ref_g = reference(x, G, w, b, 1e-5, dy=dy)
    ref_g = [g for g in ref_g if g is not None]
    assert y.dtype == dtype and y.shape == x.shape
    # At least as accurate as ATen's kernels (whose mean/rstd are kept in the input's dtype too), and within
    # the dtype's bound.
    err, err_aten = rel_err(y, ref_y), 0.0 if mixed else rel_err(y_aten, ref_y)
    assert torch.isfinite(y).all() and err <= max(FWD_TOL[dtype], 1.5 * err_aten), (err, err_aten)
    for got, aten, ref, wrt, name in zip(grads, g_aten, ref_g, [t for t in (x, w, b) if t is not None],
                                         ("input", "weight", "bias")):
        assert got.dtype == wrt.dtype and got.shape == wrt.shape, name
        e, ea = rel_err(got, ref), 0.0 if aten is None else rel_err(aten, ref)
        assert torch.isfinite(got).all() and e <= max(BWD_TOL[dtype], 1.5 * ea), (name, e, ea)


@gpu
@pytest.mark.parametrize("dtype,affine", [(torch.float32, "same"), (torch.float16, "same"), (torch.bfloat16, "same"),
                                          (torch.bfloat16, "fp32"), (torch.float16, "none")])
def test_native_group_norm_outputs_keep_atens_dtypes(dtype, affine):
    gen = torch.Generator().manual_seed(3)
    x = rand_input((3, 16, 6, 6), dtype, "cuda", gen=gen)
    w, b = _params(16, dtype, affine, gen)
    args = (x, w, b, 3, 16, 36, 4, 1e-5)
    with ge.aten_kernels():
        out = torch.native_group_norm(*args)
    # ATen's rule (param_scalar_type): float32 statistics for a 16-bit input with float32 weight/bias (mixed;
    # ATen's CUDA kernels refuse that input, its CPU kernels take it), else the input's dtype.
    stats = torch.float32 if affine == "fp32" else dtype
    assert out[0].dtype == dtype and out[1].dtype == out[2].dtype == stats
    assert out[0].shape == x.shape and out[1].shape == out[2].shape == (3, 4)
    if affine != "fp32":
        ref = torch.native_group_norm(*args)  # ATen's kernels
        assert [o.dtype for o in out] == [r.dtype for r in ref]
    _, rmean, rrstd = reference(x, 4, w, b, 1e-5)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out[1].dtype]
    torch.testing.assert_close(out[1].double(), rmean, rtol=tol, atol=tol)
    torch.testing.assert_close(out[2].double(), rrstd, rtol=tol, atol=tol)


@gpu
def test_native_group_norm_with_flattened_input():
    """ATen takes any input of N*C*HxW elements; gnext's kernels work on it as (N, C, HxW)."""
    gen = torch.Generator().manual_seed(5)
    x4 = rand_input((2, 8, 5, 5), torch.float32, "cuda", gen=gen)
    w, b = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    x = x4.reshape(2, 200)
    dy = torch.randn_like(x)
    ref = torch.native_group_norm(x, w, b, 2, 8, 25, 4, 1e-5)
    ref_b = torch.ops.aten.native_group_norm_backward(dy, x, ref[1], ref[2], w, 2, 8, 25, 4, [True, True, True])
    with ge.aten_kernels():
        out = torch.native_group_norm(x, w, b, 2, 8, 25, 4, 1e-5)
        out_b = torch.ops.aten.native_group_norm_backward(dy, x, out[1], out[2], w, 2, 8, 25, 4, [True, False, True])
        with pytest.raises(RuntimeError, match="N\\*C\\*HxW"):
            torch.native_group_norm(x, w, b, 2, 8, 24, 4, 1e-5)
    assert out[0].shape == x.shape and out_b[0].shape == x.shape
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_b[0], ref_b[0], rtol=1e-4, atol=1e-5)
    assert out_b[1] is None  # output_mask[1] False: undefined, as ATen returns it
    torch.testing.assert_close(out_b[2], ref_b[2], rtol=1e-4, atol=1e-4)


@gpu
def test_module_training_double_backward_and_graph_replay():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 32, 3, padding=1), torch.nn.GroupNorm(8, 32), torch.nn.SiLU(),
                                torch.nn.Conv2d(32, 8, 3, padding=1)).cuda()
    x = torch.randn(4, 8, 16, 16, device="cuda") * 2 + 1

    def grads(m):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    ref = grads(model)
    with ge.aten_kernels():
        got = grads(model)
        # double backward (create_graph=True): PyTorch's formula over the saved mean/rstd
        xr = x.clone().requires_grad_()
        y = F.group_norm(xr, 4, gw8 := torch.randn(8, device="cuda") + 1, None)
        (gx,) = torch.autograd.grad(y.square().sum(), xr, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), xr)
        # CUDA graph capture and replay of a forward + backward
        static_x = x.clone().requires_grad_()
        gw = torch.randn(8, device="cuda") * 0.5 + 1
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                F.group_norm(static_x, 4, gw).sum().backward()
        torch.cuda.current_stream().wait_stream(s)
        static_x.grad = None
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = F.group_norm(static_x, 4, gw)
            out.square().sum().backward()
        g.replay()
        torch.cuda.synchronize()
        replayed = static_x.grad.clone()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)
    xr = x.clone().requires_grad_()
    y = F.group_norm(xr, 4, gw8, None)
    (gx_ref,) = torch.autograd.grad(y.square().sum(), xr, create_graph=True)
    (ggx_ref,) = torch.autograd.grad(gx_ref.sum(), xr)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ggx, ggx_ref, rtol=1e-3, atol=1e-3)
    sx = x.clone().requires_grad_()
    F.group_norm(sx, 4, gw).square().sum().backward()
    torch.testing.assert_close(replayed, sx.grad, rtol=1e-4, atol=1e-4)


@gpu
def test_float64_keeps_working():
    """gnext's kernels have no float64 path; the override computes it with ATen ops (gradcheck still runs)."""
    gen = torch.Generator().manual_seed(7)
    x = rand_input((2, 6, 3, 5), torch.float64, "cuda", gen=gen).requires_grad_()
    w = torch.randn(6, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    y_ref = F.group_norm(x, 3, w, b)
    g_ref = torch.autograd.grad(y_ref, (x, w, b), dy)
    with ge.aten_kernels():
        y = F.group_norm(x, 3, w, b)
        g = torch.autograd.grad(y, (x, w, b), dy)
        assert torch.autograd.gradcheck(lambda t: F.group_norm(t, 3, w, b), (x[:1, :, :2, :2].detach().clone()
                                                                            .requires_grad_(),))
        _, mean, rstd = torch.native_group_norm(x.detach(), w, b, 2, 6, 15, 3, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@gpu
def test_errors_name_the_argument():
    x = torch.randn(2, 6, 4, 4, device="cuda")
    with ge.aten_kernels():
        with pytest.raises(RuntimeError, match="divisible"):
            torch.native_group_norm(x, None, None, 2, 6, 16, 4, 1e-5)
        with pytest.raises(RuntimeError, match="dtype"):
            torch.native_group_norm(x.int(), None, None, 2, 6, 16, 3, 1e-5)
        with pytest.raises(RuntimeError, match="weight"):
            torch.native_group_norm(x, torch.ones(5, device="cuda"), None, 2, 6, 16, 3, 1e-5)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU-only behaviour")
def test_enable_without_gpu_still_registers():
    """The registration needs no GPU (CI): CUDA calls are what it changes."""
    ge.enable_aten_kernels()
    assert ge.aten_kernels_enabled()
