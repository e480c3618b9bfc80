# SPDX-License-Identifier: BSD-3-Clause
"""Shared helpers: devices, float64 references, output poisoning, tolerances."""
from __future__ import annotations

import os

import pytest
import torch

import groupnorm_ext  # registers torch.ops.gnext

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# ||out - ref|| / ||ref|| bounds per dtype (forward output, gradients).
FWD_TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
BWD_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# Elementwise |out - ref| <= ATOL * max|ref| on top of the norm bound.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads, not all of them
    (n workers x all cores oversubscribed the device hosts: their CPU-heavy tests ran several times slower)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fusion():
    """Fresh compile caches; enable_compile_fusion(when='always') for the test, removed afterwards. Yields a function
    that returns the pass's counts since the test began (compile_fusion_stats)."""
    from groupnorm_ext import compile_fusion

    torch._dynamo.reset()
    before = dict(compile_fusion.compile_fusion_stats)
    with torch._inductor.config.patch(fx_graph_cache=False):
        groupnorm_ext.enable_compile_fusion(when="always")
        try:
            yield lambda: {k: compile_fusion.compile_fusion_stats[k] - before[k] for k in before}
        finally:
            groupnorm_ext.disable_compile_fusion()
            torch._dynamo.reset()


def run_graph_pass(model, args, rewrite):
    """model(*args) under torch.compile with a backend that applies rewrite(graph) to Dynamo's graph and runs it
    eagerly (no Inductor), and model(*args); under no_grad. Returns (compiled output, eager output, the graph)."""
    graphs = []

    def backend(gm, example_inputs):
        rewrite(gm.graph)
        gm.graph.lint()
        gm.recompile()
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = torch.compile(model, backend=backend, fullgraph=True)(*args)
            ref = model(*args)
    finally:
        torch._dynamo.reset()
    (graph,) = graphs
    return out, ref, graph


def rand_input(shape, dtype, device, scale=3.0, offset=2.0, memory_format=None, gen=None):
    """Fresh random input with non-zero mean: scale * randn + offset."""
    x = torch.randn(shape, dtype=torch.float64, generator=gen) * scale + offset
    x = x.to(device=device, dtype=dtype)
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    return x


def poison(device, nbytes):
    """Fills freed caching-allocator blocks with NaN so that an output element a kernel forgets to
    write is NaN (CUDA; on the CPU freed memory may not be reused, so this is best effort)."""
    if device == "cpu" or nbytes == 0:
        return
    n = (nbytes + 3) // 4
    bufs = [torch.full((n,), float("nan"), device=device) for _ in range(4)]
    bufs += [torch.full((max(1, n // 8),), float("nan"), device=device) for _ in range(4)]
    del bufs


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close_to_ref(out, ref, dtype, tol):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values (unwritten poisoned output?)"
    err = rel_err(out, ref)
    assert err <= tol[dtype], f"relative error {err:.3e} > {tol[dtype]:.1e} ({dtype})"
    bound = ATOL[dtype] * ref.abs().max().item() + 1e-12
    worst = (out.double() - ref.double()).abs().max().item()
    assert worst <= bound * 4, f"max abs error {worst:.3e} > {bound * 4:.3e} ({dtype})"


def reference(x, num_groups, weight, bias, eps, dy=None):
    """float64 GroupNorm from its definition (Wu & He 2018: biased variance over each group of
    C/G channels x spatial positions), differentiated by autograd for dy. Also valid for groups of
    a single value, which torch.nn.functional.group_norm refuses."""
    N, C = x.shape[0], x.shape[1]
    xd = x.detach().double().contiguous().requires_grad_(dy is not None)
    wd = weight.detach().double().requires_grad_(dy is not None) if weight is not None else None
    bd = bias.detach().double().requires_grad_(dy is not None) if bias is not None else None
    shaped = xd.view(N, num_groups, -1)
    mean = shaped.mean(-1, keepdim=True)
    var = (shaped - mean).pow(2).mean(-1, keepdim=True)
    rstd = (var + eps).rsqrt()
    y = ((shaped - mean) * rstd).view(xd.shape)
    pshape = (1, C) + (1,) * (xd.dim() - 2)
    if wd is not None:
        y = y * wd.view(pshape)
    if bd is not None:
        y = y + bd.view(pshape)
    if dy is None:
        return y.detach(), mean.detach().view(N, num_groups), rstd.detach().view(N, num_groups)
    inputs = [t for t in (xd, wd, bd) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy.double())
    it = iter(grads)
    return y.detach(), next(it), next(it) if wd is not None else None, next(it) if bd is not None else None


def act_ref(n, act):
    """The activations of group_norm_act by name, as PyTorch computes them."""
    import torch.nn.functional as F

    return {
        "identity": lambda t: t, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu": F.relu, "tanh": torch.tanh, "hardswish": F.hardswish,
        "tanh_hardswish": lambda t: F.hardswish(torch.tanh(t)),
    }[act](n)


def gn_decomposed(x, G, w, b, eps=1e-5):
    """GroupNorm from elementary ops, differentiable by autograd in any dtype. Unlike F.group_norm it
    accepts groups of one value, and its backward works for weight=None with a bias on torch 2.11
    (F.group_norm's fails there when the input does not require grad: 'tensor does not have a device')."""
    xs = x.reshape(x.shape[0], G, -1)
    mean = xs.mean(-1, keepdim=True)
    var = (xs - mean).pow(2).mean(-1, keepdim=True)
    y = ((xs - mean) * (var + eps).rsqrt()).reshape(x.shape)
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    if w is not None:
        y = y * w.view(shape)
    if b is not None:
        y = y + b.view(shape)
    return y


LAYOUTS = ["contiguous", "channels_last", "permuted", "sliced"]


def layout_input(shape, dtype, device, layout, scale, offset, gen):
    """scale * randn + offset of `shape` in one of LAYOUTS: channels_last(_3d) for 4-D/5-D shapes (else
    contiguous), "permuted" (the last two spatial dims' strides swapped, 4-D and up), "sliced" (every
    other element of a twice-wider last dim, so not 16-byte aligned rows)."""
    if layout == "sliced":
        wide = list(shape)
        wide[-1] *= 2
        x = torch.randn(wide, generator=gen, dtype=torch.float64)[..., ::2]
    elif layout == "permuted" and len(shape) >= 4:
        perm_shape = list(shape)
        perm_shape[-1], perm_shape[-2] = perm_shape[-2], perm_shape[-1]
        x = torch.randn(perm_shape, generator=gen, dtype=torch.float64).transpose(-1, -2)
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = (x * scale + offset).to(dtype).to(device)  # keeps the strides of a non-contiguous x
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "channels_last" and x.dim() == 5:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    assert x.shape == tuple(shape)
    return x


@pytest.fixture
def no_tf32():
    """float32 convs without TF32 for the test: a 1-ulp change of a conv's input flips TF32 roundings."""
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = prev


class _Tuning:
    """The planner's overrides for one test (groupnorm_ext.set_tuning over the defaults, not the environment)."""

    def __init__(self):
        self.knobs: dict[str, int] = {}

    def set(self, name: str, value: str | int) -> None:
        """Sets knob `name` (GNEXT_*) to `value`; "" leaves it at its default."""
        if value == "":
            self.knobs.pop(name, None)
        else:
            self.knobs[name] = int(value)
        groupnorm_ext.set_tuning(self.knobs)


@pytest.fixture
def tuning():
    """Sets the launch planner's knobs for the test (tuning.set("GNEXT_ONEPASS", "0")); restored afterwards."""
    previous = groupnorm_ext.set_tuning({})
    yield _Tuning()
    groupnorm_ext.set_tuning(previous)


def perturb_params(model, scale=0.3):
    """Adds scale * randn to every parameter (default inits are too regular: weight 1, bias 0) and
    returns the model."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model

