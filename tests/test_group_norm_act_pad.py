# SPDX-License-Identifier: BSD-3-Clause
"""group_norm_act_pad: F.pad(act(GroupNorm(x + input_bias[c])), pad, mode, value) against a float64 reference (the
GroupNorm of conftest.reference, PyTorch's activations and F.pad), forward and backward, on odd sizes, every layout,
both modes, with and without input_bias; its argument errors; and the converter's padded form (with the bias of the
convolution before a padded norm added by that norm) on a causal 3-D block and diffusers' HunyuanVideo decoder."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_ext as ge
from groupnorm_ext.ops.group_norm_act_pad import unpad_grad

from conftest import (BWD_TOL, DEVICES, FWD_TOL, LAYOUTS, act_ref, assert_close_to_ref, gn_decomposed, layout_input,
                      poison, reference)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def _ref_pad(y, pad, mode, value):
    """float64 F.pad for any number of padded dims (F.pad's replicate mode takes only spatial-dims-many)."""
    if mode == "constant":
        return F.pad(y, pad, value=value)
    for k in range(len(pad) // 2):
        d = y.dim() - 1 - k
        n = y.shape[d]
        y = y.index_select(d, torch.arange(-pad[2 * k], n + pad[2 * k + 1], device=y.device).clamp(0, n - 1))
    return y


def _check(device, dtype, shape, G, act, pad, mode, value=0.0, layout="contiguous", affine=True, seed=0,
           offset=2.0, backward=True, fwd_tol=FWD_TOL, bwd_tol=BWD_TOL, input_bias=None):
    """input_bias: None, or the dtype of a per-channel bias (mean 0, std 3) that the op adds to x."""
    gen = torch.Generator().manual_seed(seed)
    x = layout_input(shape, dtype, device, layout, 3.0, offset, gen)
    C = shape[1]
    w = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device) if affine else None
    b = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).to(device) if affine else None
    ib = (torch.randn(C, generator=gen, dtype=torch.float64) * 3).to(input_bias).to(device) if input_bias else None
    view = (1, C) + (1,) * (len(shape) - 2)
    xb = x if ib is None else x.double() + ib.double().view(view)
    n_ref, _, _ = reference(xb, G, w, b, 1e-5)
    ref = _ref_pad(act_ref(n_ref, act), pad, mode, value)
    poison(device, ref.numel() * 4)
    xr = x.detach().requires_grad_(backward)
    wr = w.to(dtype).requires_grad_(backward) if affine else None
    br = b.to(dtype).requires_grad_(backward) if affine else None
    ibr = ib.detach().clone().requires_grad_(backward) if input_bias else None
    out = ge.group_norm_act_pad(xr, G, wr, br, 1e-5, act, pad, mode, value, input_bias=ibr)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close_to_ref(out.detach(), ref, dtype, fwd_tol)
    if not backward:
        return
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    out.backward(dy.to(dtype))
    # float64 gradients of the same composition, through autograd
    xd = x.detach().double().requires_grad_()
    wd = w.detach().clone().requires_grad_() if affine else None
    bd = b.detach().clone().requires_grad_() if affine else None
    ibd = ib.detach().double().requires_grad_() if input_bias else None
    xbd = xd if ibd is None else xd + ibd.view(view)
    _ref_pad(act_ref(gn_decomposed(xbd, G, wd, bd), act), pad, mode, value).backward(dy)
    assert_close_to_ref(xr.grad, xd.grad, dtype, bwd_tol)
    if input_bias:  # the input's gradient summed per channel: as accurate as the input's
        assert ibr.grad.dtype == input_bias
        assert_close_to_ref(ibr.grad, ibd.grad, dtype, bwd_tol)
    if affine:
        assert_close_to_ref(wr.grad, wd.grad, dtype, bwd_tol)
        assert_close_to_ref(br.grad, bd.grad, dtype, bwd_tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["replicate", "constant"])
@pytest.mark.parametrize("shape,G,pad", [
    ((2, 12, 5, 9, 7), 4, (1, 1, 1, 1, 2, 0)),   # HunyuanVideo's causal pad
    ((1, 8, 3, 6, 10), 8, (0, 2, 1, 0, 0, 3)),   # G = C, uneven pads
    ((3, 6, 7, 5), 1, (2, 3, 1, 1)),             # 4-D, G = 1
    ((2, 4, 11), 2, (3, 1)),                     # 3-D
    ((1, 16, 1, 1), 4, (1, 1, 1, 1)),            # HxW = 1: every output a copy of one element
    ((2, 8, 4, 6, 5), 2, (1, 1)),                # 5-D with only W padded
])
def test_matches_float64_reference(device, dtype, mode, shape, G, pad):
    _check(device, dtype, shape, G, "silu", pad, mode, value=0.25 if mode == "constant" else 0.0, seed=len(shape))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["identity", "relu", "gelu", "hardswish", "tanh_hardswish"])
def test_activations(device, act):
    _check(device, torch.float32, (2, 12, 3, 10, 9), 3, act, (1, 1, 1, 1, 2, 0), "replicate", seed=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(device, layout):
    _check(device, torch.float16, (2, 8, 3, 12, 10), 4, "silu", (1, 1, 1, 1, 2, 0), "replicate", layout=layout,
           seed=5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["replicate", "constant"])
@pytest.mark.parametrize("bias_dtype", ["input", "float32"])
def test_input_bias(device, dtype, mode, bias_dtype):
    """GroupNorm of x + input_bias[c] (a convolution's bias not yet added): forward and every gradient; the bias
    (std 3) moves each channel's mean, so a bias the kernels dropped or added twice fails."""
    _check(device, dtype, (2, 12, 3, 7, 9), 4, "silu", (1, 1, 1, 1, 2, 0), mode, value=0.5, seed=11,
           input_bias=dtype if bias_dtype == "input" else torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_bias_layouts(device, layout):
    _check(device, torch.float16, (1, 8, 2, 5, 6), 2, "silu", (1, 1, 1, 1, 2, 0), "replicate", layout=layout,
           seed=12, input_bias=torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_no_affine_large_mean(device):
    """Mean 300, std 3: float32 rounds the mean by ulp(300) / 2 = 1.5e-5, 5e-6 of the std, which bounds any
    float32 GroupNorm's output error (test_group_norm.py: test_large_mean_small_variance)."""
    tol = {torch.float32: 4e-5}
    _check(device, torch.float32, (1, 6, 4, 9, 11), 3, "silu", (1, 1, 1, 1, 2, 0), "replicate", affine=False,
           offset=300.0, seed=7, fwd_tol=tol, bwd_tol={torch.float32: 4e-4})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape,pad", [
    ((1, 64, 5, 130, 66), (1, 1, 1, 1, 2, 0)),   # planes of several CTAs, rows not a multiple of any vector
    ((2, 32, 300, 301), (1, 1, 1, 1)),           # a 4-D map
    ((1, 32, 2, 2048, 1030), (1, 1, 1, 1, 2, 0)),  # planes that loop (> the grid's CTAs per plane)
])
def test_large_planes(dtype, shape, pad):
    _check("cuda", dtype, shape, 8, "silu", pad, "replicate", seed=9, backward=dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["replicate", "constant"])
@pytest.mark.parametrize("shape,pad", [
    ((2, 8, 3, 2, 301), (3, 2, 1, 1, 2, 1)),     # odd rows: each source row starts at another alignment
    ((1, 16, 4, 257), (0, 0, 2, 2)),             # unpadded rows, padded H only
    ((3, 4, 1000), (5, 7)),                      # 3-D: one long row per (n, c)
    ((1, 8, 2, 3, 1100), (1, 1, 1, 1, 2, 0)),    # rows of several trips
    ((1, 4, 3, 7, 520), (1, 1, 1, 1, 2, 0)),     # an odd number of rows, 2 segments each
])
@pytest.mark.parametrize("rows_per_warp", [1, 2])
def test_rows_kernel(dtype, mode, shape, pad, rows_per_warp, tuning):
    """Rows of >= 256 elements (the row kernel: vector loads and stores around unaligned heads and tails), each warp
    on 1 or 2 rows at once (GNEXT_PAD_ROWS)."""
    tuning.set("GNEXT_PAD_ROWS", rows_per_warp)
    _check("cuda", dtype, shape, 4, "silu", pad, mode, value=-0.5 if mode == "constant" else 0.0, seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["replicate", "constant"])
@pytest.mark.parametrize("shape,pad", [
    ((1, 8, 3, 37, 512), (1, 1, 1, 1, 2, 0)),    # HunyuanVideo's pad; H not a multiple of a stage's rows
    ((1, 8, 2, 70, 256), (2, 2, 1, 1, 2, 0)),    # 32 rows a stage: three stages per frame, the last partial
    ((2, 4, 2, 40, 256), (3, 2, 1, 2, 1, 1)),    # uneven pads on every side, back frames and rows too
    ((1, 8, 1, 9, 128), (1, 1, 2, 0, 2, 0)),     # one source frame: every output frame from it
    ((1, 4, 4, 5, 64), (1, 1, 1, 1, 2, 0)),      # short rows: a stage holds every row of a frame
    ((1, 4, 2, 3, 8192), (1, 1, 1, 1, 2, 0)),    # a 16-bit row of one whole stage (fp32: the row kernel)
    ((2, 8, 33, 516), (1, 1, 1, 1)),             # 4-D, rows of 16-byte multiples only in float32
    ((3, 4, 1, 1, 16), (1, 1, 1, 1, 1, 1)),      # one source row per (n, c)
    ((1, 4, 2, 6, 256), (6, 1, 0, 0, 0, 0)),     # a left pad wider than a float32 vector (its halo not staged)
])
@pytest.mark.parametrize("tile", [0, 2])
def test_tile_kernel(dtype, mode, shape, pad, tile, tuning):
    """Source rows staged in shared memory by cp.async (GNEXT_PAD_TILE=2: wherever the rows are 16-byte multiples
    of at most a stage), against the row and flat kernels (GNEXT_PAD_TILE=0), both against float64."""
    tuning.set("GNEXT_PAD_TILE", tile)
    _check("cuda", dtype, shape, 4, "silu", pad, mode, value=-0.5 if mode == "constant" else 0.0, seed=17,
           backward=False, input_bias=torch.float32 if shape[1] == 8 else None)


@pytest.mark.gpu
def test_tile_kernel_matches_rows(tuning):
    """The tile kernel writes bitwise what the row kernel writes (same coefficients, same per-element arithmetic)."""
    x = torch.randn(1, 32, 5, 64, 512, device="cuda", dtype=torch.float16) * 3 + 2
    w, b = torch.randn(32, device="cuda"), torch.randn(32, device="cuda")
    tuning.set("GNEXT_PAD_TILE", 0)
    ref = ge.group_norm_act_pad(x, 8, w, b, 1e-5, "silu", (1, 1, 1, 1, 2, 0))
    tuning.set("GNEXT_PAD_TILE", 1)
    out = ge.group_norm_act_pad(x, 8, w, b, 1e-5, "silu", (1, 1, 1, 1, 2, 0))
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_cuda_graph_and_compile():
    x = torch.randn(2, 16, 3, 20, 18, device="cuda", dtype=torch.float16) + 1
    w, b = torch.randn(16, device="cuda"), torch.randn(16, device="cuda")
    ref = ge.group_norm_act_pad(x, 4, w, b, 1e-5, "silu", (1, 1, 1, 1, 2, 0))
    f = torch.compile(lambda t: ge.group_norm_act_pad(t, 4, w, b, 1e-5, "silu", (1, 1, 1, 1, 2, 0)), fullgraph=True)
    torch.testing.assert_close(f(x), ref, rtol=0, atol=0)
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ge.group_norm_act_pad(static, 4, w, b, 1e-5, "silu", (1, 1, 1, 1, 2, 0))
    static.copy_(x * 2)
    g.replay()
    torch.testing.assert_close(out, ge.group_norm_act_pad(x * 2, 4, w, b, 1e-5, "silu", (1, 1, 1, 1, 2, 0)))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """Schema, fake kernel, autograd registration and AOT dispatch (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 8, 3, 5, 4, generator=gen) + 1).to(device)
    w, b = torch.randn(8, generator=gen).to(device), torch.randn(8, generator=gen).to(device)
    op = torch.ops.gnext.group_norm_act_pad.default
    torch.library.opcheck(op, (x, 4, w, b, 1e-5, "silu", [1, 1, 1, 1, 2, 0], "replicate", 0.0))
    torch.library.opcheck(op, (x.clone().requires_grad_(), 4, w.clone().requires_grad_(), None, 1e-5, "gelu",
                               [2, 1], "constant", 0.5))
    torch.library.opcheck(op, (x.clone().requires_grad_(), 4, w, b, 1e-5, "silu", [1, 1, 1, 1, 2, 0], "replicate",
                               0.0, b.clone().requires_grad_()))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, 8, 3, 4, 5, device=device)
    out = ge.group_norm_act_pad(x, 4, None, None, 1e-5, "silu", (1, 1, 1, 1, 2, 0))
    assert out.shape == (0, 8, 5, 6, 7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs,match", [
    (dict(pad=(1, 1, 1)), "pad must hold 2 values"),
    (dict(pad=()), "pad must hold 2 values"),
    (dict(pad=(1, 1, 1, 1, 1, 1, 1, 1)), "at most 6"),
    (dict(pad=(1, -1)), r"pad values must be in \[0, 2\^20\)"),
    (dict(mode="reflect"), "mode must be 'replicate' or 'constant', got mode='reflect'"),
    (dict(activation="swish"), "activation"),
    (dict(input_bias=torch.zeros(4)), r"input_bias must have shape \(C,\) = \(8\), got input_bias.shape=\[4\]"),
    (dict(input_bias=torch.zeros(8, dtype=torch.half)),
     r"input_bias dtype must match input \(Float\) or be float32, got Half"),
])
def test_errors(device, kwargs, match):
    x = torch.randn(1, 8, 3, 4, 5, device=device)
    args = dict(pad=(1, 1, 1, 1, 2, 0), mode="replicate", activation="silu", input_bias=None) | kwargs
    ib = args["input_bias"].to(device) if args["input_bias"] is not None else None
    with pytest.raises(RuntimeError, match=match):
        ge.group_norm_act_pad(x, 4, None, None, 1e-5, args["activation"], args["pad"], args["mode"], input_bias=ib)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_shapes(device):
    with pytest.raises(RuntimeError, match="must be divisible by num_groups"):
        ge.group_norm_act_pad(torch.randn(1, 6, 4, 4, device=device), 4, pad=(1, 1))
    with pytest.raises(RuntimeError, match="1 to 3 spatial dims"):
        ge.group_norm_act_pad(torch.randn(2, 4, device=device), 2, pad=(1, 1))
    with pytest.raises(RuntimeError, match="replicate padding needs the padded dims non-empty"):
        ge.group_norm_act_pad(torch.randn(1, 4, 0, 3, device=device), 2, pad=(1, 1, 1, 1))
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ge.group_norm_act_pad(torch.randn(1, 4, 3, 3, device=device), 2, torch.ones(3, device=device), pad=(1, 1))


def test_unpad_grad_is_the_adjoint_of_the_pad():
    """<pad(u), g> = <u, unpad_grad(g)> for both modes: the backward's fold is F.pad's exact adjoint."""
    gen = torch.Generator().manual_seed(11)
    u = torch.randn(2, 3, 4, 5, 6, generator=gen, dtype=torch.float64)
    for mode in ("replicate", "constant"):
        for pad in [(1, 1, 1, 1, 2, 0), (2, 0), (0, 3, 1, 2)]:
            g = torch.randn(_ref_pad(u, list(pad), mode, 0.0).shape, generator=gen, dtype=torch.float64)
            lhs = (_ref_pad(u, list(pad), mode, 0.0) * g).sum()
            rhs = (u * unpad_grad(g, list(pad), mode)).sum()
            torch.testing.assert_close(lhs, rhs)


# --- the converter's padded form -------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_tf32():
    """The model tests compare a converted model with the original: float32 convolutions in TF32 (cuDNN's default)
    would make that comparison one of TF32 noise."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


class CausalConv3d(nn.Module):
    """A causal convolution that pads by itself (replicate; 2 frames before, none after), as video VAEs have."""

    def __init__(self, c, pad_mode="replicate"):
        super().__init__()
        self.pad, self.pad_mode = (1, 1, 1, 1, 2, 0), pad_mode
        self.conv = nn.Conv3d(c, c, 3)

    def forward(self, x):
        return self.conv(F.pad(x, self.pad, mode=self.pad_mode))


class Block(nn.Module):
    def __init__(self, c=16, pad_mode="replicate"):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(4, c), nn.GroupNorm(4, c)
        self.act, self.drop = nn.SiLU(), nn.Dropout(0.0)
        self.conv1, self.conv2 = CausalConv3d(c, pad_mode), CausalConv3d(c, pad_mode)

    def forward(self, x):
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.drop(self.act(self.norm2(h))))
        return x + h


class Escapes(Block):
    """norm2's activated output is also used outside the padding module: it must not be written padded."""

    def forward(self, x):
        h = self.conv1(self.act(self.norm1(x)))
        a = self.act(self.norm2(h))
        return x + self.conv2(a) + a.mean()


class Pointwise(nn.Module):
    """A 1x1x1 causal convolution that pads by itself, with every pad value 0 (HunyuanVideo's shortcuts): the
    padding is a copy."""

    def __init__(self, c, child=None):
        super().__init__()
        self.conv = child if child is not None else nn.Conv3d(c, c, 1)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 0, 0, 0, 0, 0), mode="replicate"))


class PadsOther(Pointwise):
    """Pads a tensor it computed, not its input: left alone."""

    def forward(self, x):
        return self.conv(F.pad(x * 2, (0, 0, 0, 0, 0, 0), mode="replicate"))


class Shortcut(Block):
    def __init__(self, c=16):
        super().__init__(c)
        self.shortcut, self.other = Pointwise(c), PadsOther(c)
        self.inplace = Pointwise(c, nn.ReLU(inplace=True))  # a child that writes its input: its copy is needed

    def forward(self, x):
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.drop(self.act(self.norm2(h))))
        return self.shortcut(x) + h + self.other(x) + self.inplace(x)


def _pad_calls(fn):
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += func is F.pad
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        out = fn()
    return out, Count.n


def _unbiased_convs(fn):
    """fn() under no_grad, and how many convolutions it ran without a bias."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (F.conv1d, F.conv2d, F.conv3d):
                Count.n += (args[2] if len(args) > 2 else (kwargs or {}).get("bias")) is None
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        out = fn()
    return out, Count.n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_mode", ["replicate", "constant"])
def test_converter_writes_padded_conv_inputs(device, pad_mode):
    torch.manual_seed(0)
    model = nn.Sequential(Block(pad_mode=pad_mode), Escapes(pad_mode=pad_mode)).to(device).eval()
    x = torch.randn(1, 16, 3, 9, 10, device=device) * 2 + 1
    with torch.no_grad():
        ref = model(x)
    keys = list(model.state_dict())
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(model), example_inputs=(x,), return_counts=True)
    assert counts["group_norm_act"] == 4 and counts["pad_into_conv"] == 3, counts
    assert list(conv.state_dict()) == [k.replace("act.", "act.act.") for k in keys]
    for _ in range(2):
        out, n_pad = _pad_calls(lambda: conv(x))
        assert n_pad == 1  # only Escapes.conv2 pads
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # Block.conv1's output goes only into norm2, a padded norm: norm2 adds conv1's bias. No other convolution's does
    # (Block.conv2's goes into the sum; Escapes.norm2 is not padded).
    out, n_unbiased = _unbiased_convs(lambda: conv(x))
    assert n_unbiased == 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # Called by itself, outside its block, that convolution adds its own bias; so it does once norm2 is swapped out.
    torch.testing.assert_close(_unbiased_convs(lambda: conv[0].conv1(x))[0], model[0].conv1(x).detach())
    swapped = copy.deepcopy(conv)
    swapped[0].norm2 = copy.deepcopy(model[0].norm2)
    out, n_unbiased = _unbiased_convs(lambda: swapped(x))
    assert n_unbiased == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # A deep copy keeps the padded form; gradients flow through it, the folded bias's included.
    dup = copy.deepcopy(conv).train()
    xr = x.clone().requires_grad_()
    dup(xr).square().sum().backward()
    xe = x.clone().requires_grad_()
    eager = copy.deepcopy(model).train()
    eager(xe).square().sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad, rtol=1e-3, atol=1e-3)
    for (name, p), (_, q) in zip(dup.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_converter_skips_zero_padding(device):
    """A module that pads its own input by 0 for a convolution child hands the input to it (F.pad only copies); one
    that pads another tensor, or whose child writes its input, keeps its padding."""
    torch.manual_seed(2)
    model = Shortcut().to(device).eval()
    x = torch.randn(1, 16, 3, 9, 10, device=device) * 2 + 1
    with torch.no_grad():
        ref = model(x)
    ref_n = _pad_calls(lambda: model(x))[1]
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(model), example_inputs=(x,), return_counts=True)
    assert counts["pad_into_conv"] == 2, counts
    out, n_pad = _pad_calls(lambda: conv(x))
    assert (ref_n, n_pad) == (5, 2)  # left: PadsOther's and the in-place child's
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_pad_calls(lambda: conv.shortcut(x))[0], model.shortcut(x).detach())
    off = ge.convert_group_norm_act(copy.deepcopy(model), example_inputs=(x,), pad_into_conv=False)
    assert _pad_calls(lambda: off(x))[1] == 5


def test_converter_padded_module_with_other_inputs_runs_its_own_forward():
    """A padding module patched for a norm still pads inputs that do not come from it."""
    torch.manual_seed(1)
    blk = Block().eval()
    x = torch.randn(1, 16, 3, 8, 8)
    ge.convert_group_norm_act(blk, example_inputs=(x,))
    with torch.no_grad():
        direct = blk.conv1(x)  # x is not a padded norm output
        ref = blk.conv1.conv(F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate"))
    torch.testing.assert_close(direct, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_diffusers_hunyuan_video_decoder_padded(device):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLHunyuanVideo(
        block_out_channels=(16, 32, 32), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, layers_per_block=1, norm_num_groups=8, latent_channels=4,
        temporal_compression_ratio=4, spatial_compression_ratio=4).to(device).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    z = torch.randn(1, 4, 2, 8, 8, device=device)
    ref, n_before = _pad_calls(lambda: vae.decoder(z))
    dec, counts = ge.convert_group_norm_act(vae.decoder, example_inputs=(z,), return_counts=True)
    out, n_after = _pad_calls(lambda: dec(z))
    assert counts["pad_into_conv"] == counts["group_norm_act"] > 0, counts
    # The shortcuts' 1x1x1 convolutions (32 -> 16 channels) skip their zero padding; the up-samplers write their
    # convolution's padded input in one buffer.
    shortcuts = sum(getattr(m, "conv_shortcut", None) is not None for m in dec.modules())
    ups = [m for m in dec.modules() if type(m).__name__ == "HunyuanVideoUpsampleCausal3D"]
    assert n_after == n_before - counts["pad_into_conv"] - shortcuts - len(ups) and shortcuts > 0 and ups
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    # Each resnet block's conv1 leaves its bias to norm2. Every block but the mid block's first (whose output goes
    # into attention) carries its conv2's, shortcut's or up-sampler's bias on to the next block.
    blocks = [m for m in dec.modules() if type(m).__name__ == "HunyuanVideoResnetBlockCausal3D"]
    carried = [m for m in blocks + ups if m is not dec.mid_block.resnets[0]]
    assert counts["stream_bias"] == len(carried)
    out, n_unbiased = _unbiased_convs(lambda: dec(z))
    assert n_unbiased == len(blocks) + len(carried) + sum(getattr(m, "conv_shortcut", None) is not None
                                                         for m in carried)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def _hunyuan_decoder(device, seed=0):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLHunyuanVideo(
        block_out_channels=(16, 32, 32), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, layers_per_block=1, norm_num_groups=8, latent_channels=4,
        temporal_compression_ratio=4, spatial_compression_ratio=4).eval()
    with torch.no_grad():
        for p in vae.parameters():  # biases well away from 0, so that one left out shows
            p.add_(torch.randn_like(p) * 0.3 + (0.5 if p.dim() == 1 else 0.0))
    return vae.decoder.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_hunyuan_stream_biases_half(device, dtype):
    """The decoder in 2-byte floats with the biases carried down the residual stream: as close to a float64 decode
    as PyTorch's own in that dtype. (On the CPU the half convolutions run in float32 with rounded outputs.)"""
    dec = _hunyuan_decoder(device)
    z = torch.randn(1, 4, 3, 8, 8, device=device)
    with torch.no_grad():
        exact = copy.deepcopy(dec).double()(z.double())
        dec = dec.to(dtype)
        eager = dec(z.to(dtype)).double()
    conv, counts = ge.convert_group_norm_act(dec, example_inputs=(z.to(dtype),), return_counts=True)
    assert counts["stream_bias"] > 0
    with torch.no_grad():
        out = conv(z.to(dtype)).double()
    err, err_eager = (out - exact).abs().max().item(), (eager - exact).abs().max().item()
    assert err <= 2 * err_eager + 1e-2 * exact.abs().max().item(), (err, err_eager)


def test_hunyuan_stream_bias_kept_where_the_output_escapes():
    """A block whose output the running module returns (or uses itself) adds its own biases; called by itself, a
    block adds its own too; with a gradient, the blocks' own forwards run."""
    dec = _hunyuan_decoder("cpu")

    class Tap(nn.Module):  # returns the first up block's output beside the second's
        def __init__(self):
            super().__init__()
            self.a, self.b = dec.up_blocks[0], dec.up_blocks[1]

        def forward(self, x):
            h = self.a(x)
            return self.b(h), h

    tap = Tap().eval()
    x = torch.randn(1, 32, 2, 4, 4)
    with torch.no_grad():
        ref = tap(x)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(tap), example_inputs=(x,), return_counts=True)
    assert not hasattr(conv.a.upsamplers[0], "_gnext_stream_block") and counts["stream_bias"] > 0
    with torch.no_grad():
        out = conv(x)
        alone = conv.b.resnets[0](ref[1])
        alone_ref = tap.b.resnets[0](ref[1])
        up_alone, up_ref = conv.b.upsamplers[0](ref[1]), tap.b.upsamplers[0](ref[1])

    def close(a, b):  # the outputs reach ~5e3 (no norm at the end): float32 rounding relative to the largest
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())

    for o, r in zip(out, ref):
        close(o, r)
    assert not hasattr(out[1], "_gnext_pending") and not hasattr(alone, "_gnext_pending")
    close(alone, alone_ref)
    assert "forward" in conv.b.upsamplers[0].__dict__ and not hasattr(up_alone, "_gnext_pending")
    close(up_alone, up_ref)
    xg = x.clone().requires_grad_()
    close(conv(xg)[0], ref[0])


def test_converted_padded_model_compiles_without_breaks():
    """Under torch.compile the padded norms and their padding modules take their unpadded paths (a tensor attribute
    set in compiled code would break the graph): fullgraph=True traces, and the result equals the original's."""
    torch.manual_seed(3)
    model = nn.Sequential(Block(), Block()).eval()
    x = torch.randn(1, 16, 3, 9, 10)
    with torch.no_grad():
        ref = model(x)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(model), example_inputs=(x,), return_counts=True)
    assert counts["pad_into_conv"] == 4
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(conv, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_hunyuan_stream_bias_into_a_swapped_norm():
    """A block handed its input without the biases, whose norm1 was swapped for a plain GroupNorm after the
    conversion (model surgery), adds them to its input first: the decode still equals the original's."""
    dec = _hunyuan_decoder("cpu")
    z = torch.randn(1, 4, 2, 8, 8)
    with torch.no_grad():
        ref = dec(z)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(dec), example_inputs=(z,), return_counts=True)
    blk = conv.up_blocks[1].resnets[0]
    assert "_gnext_stream_block" in conv.up_blocks[0].upsamplers[0].__dict__ and counts["stream_bias"] > 0
    plain = nn.GroupNorm(blk.norm1.num_groups, blk.norm1.num_channels, eps=blk.norm1.eps)
    plain.load_state_dict(blk.norm1.state_dict())
    blk.norm1 = plain  # its activation gate applies SiLU to what no fused norm announced
    with torch.no_grad():
        out = conv(z)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_hunyuan_stream_bias_into_swapped_convolutions():
    """Blocks whose convolutions were swapped after the conversion for modules of another class (a split decode's
    halo convolutions, say) run their class's forward, with any pending biases added to their input: the decode
    still equals the original's, and the blocks whose convolutions were kept still carry the biases."""
    dec = _hunyuan_decoder("cpu")
    z = torch.randn(1, 4, 2, 8, 8)
    with torch.no_grad():
        ref = dec(z)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(dec), example_inputs=(z,), return_counts=True)
    assert counts["stream_bias"] > 0

    class Wrapped(nn.Module):  # the same convolution behind a class the stream forwards do not know
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    blk, up = conv.up_blocks[1].resnets[0], conv.up_blocks[0].upsamplers[0]
    blk.conv2, up.conv = Wrapped(blk.conv2), Wrapped(up.conv)
    with torch.no_grad():
        out, n_unbiased = _unbiased_convs(lambda: conv(z))
    assert n_unbiased > 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frames,factor", [(3, (2, 2, 2)), (1, (2, 2, 2)), (4, (1, 2, 2)), (2, (2, 1, 3))])
def test_hunyuan_upsampler_padded_input(device, frames, factor):
    """The up-sampler's convolution input written in one buffer equals F.pad(cat(interpolations)) exactly, and the
    converted up-sampler's output equals its own forward's, with integer factors and (through its own forward)
    without."""
    hy = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video")
    from groupnorm_ext.convert import _hy_upsample_forward, _hy_upsampled_padded

    torch.manual_seed(0)
    up = hy.HunyuanVideoUpsampleCausal3D(6, 6, upsample_factor=factor).to(device).eval()
    x = torch.randn(2, 6, frames, 5, 7, device=device) + 3
    first, rest = x.split((1, frames - 1), dim=2)
    parts = [F.interpolate(first.squeeze(2), scale_factor=factor[1:], mode="nearest").unsqueeze(2)]
    if frames > 1:
        parts.append(F.interpolate(rest, scale_factor=factor, mode="nearest"))
    ref = F.pad(torch.cat(parts, dim=2), up.conv.time_causal_padding, mode="replicate")
    got = _hy_upsampled_padded(up, x)
    assert got is not None and torch.equal(got, ref)
    up.upsample_factor = (2, 1.5, 2)
    assert _hy_upsampled_padded(up, x) is None
    with torch.no_grad():
        torch.testing.assert_close(_hy_upsample_forward(up, x), up(x), rtol=1e-5, atol=1e-5)
    up.upsample_factor = factor
    with torch.no_grad():  # the stream forward, called by itself: its bias added
        ref = up(x)
        out = _hy_upsample_forward(up, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
