# SPDX-License-Identifier: BSD-3-Clause
"""Fused ConvTranspose2d + GELU + GroupNorm (torch.ops.gnext.conv_transpose2d_gelu_group_norm):
forward and every gradient vs a float64 reference of the unfused PyTorch model, on fresh random
inputs with non-zero mean; opcheck; torch.compile; the module, its checkpoint mapping and the
converter; error messages."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_ext as ge
from conftest import DEVICES, poison, rand_input, rel_err

CL = torch.channels_last
# (N, C_in, C_out, H, W, k, stride, padding, output_padding, dilation, conv groups, G, approximate,
#  conv bias, GN affine)
CASES = [
    (2, 8, 16, 9, 7, 3, 1, 0, 0, 1, 1, 4, "none", True, True),
    (1, 6, 12, 5, 6, 4, 2, 1, 1, 1, 2, 3, "tanh", True, True),   # conv groups, output_padding, G=3
    (3, 4, 8, 6, 5, 3, 2, 1, 0, 2, 1, 8, "none", False, False),  # dilation, G = C, no biases
    (2, 8, 8, 1, 1, 1, 1, 0, 0, 1, 1, 1, "tanh", True, True),    # 1x1 output (HxW = 1), G = 1
    (2, 16, 32, 13, 11, 3, 1, 0, 0, 1, 1, 8, "none", True, True),  # odd sizes, 15x13 output
]
# ||out - ref|| / ||ref|| bounds: (forward, gradients)
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 2e-2), torch.bfloat16: (3e-2, 6e-2)}


def _params(case, dtype, device, gen):
    N, cin, cout, H, W, k, s, p, op, d, groups, G, approx, has_cb, affine = case
    w = (torch.randn(cin, cout // groups, k, k, generator=gen) * (1.0 / (cin * k * k)) ** 0.5).to(device, dtype)
    cb = (torch.randn(cout, generator=gen) * 0.5 + 0.3).to(device, dtype) if has_cb else None
    gw = (torch.randn(cout, generator=gen) * 0.5 + 1).to(device, dtype) if affine else None
    gb = (torch.randn(cout, generator=gen) * 0.5).to(device, dtype) if affine else None
    return w, cb, gw, gb


def _reference(case, x, w, cb, gw, gb, dy):
    N, cin, cout, H, W, k, s, p, op, d, groups, G, approx, has_cb, affine = case
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in (x, w, cb, gw, gb)]
    xd, wd, cbd, gwd, gbd = leaves
    z = F.conv_transpose2d(xd, wd, cbd, s, p, op, groups, d)
    y = F.group_norm(F.gelu(z, approximate=approx), G, gwd, gbd, 1e-5)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, present, dy.cpu().double()))
    return y.detach(), [next(grads) if t is not None else None for t in leaves]


def _run(case, dtype, device, fmt, seed):
    N, cin, cout, H, W, k, s, p, op, d, groups, G, approx, has_cb, affine = case
    gen = torch.Generator().manual_seed(seed)
    x = rand_input((N, cin, H, W), dtype, device, scale=1.0, offset=0.5, memory_format=fmt, gen=gen)
    w, cb, gw, gb = _params(case, dtype, device, gen)
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, cb, gw, gb)]
    poison(device, 4 * N * cout * (H * s + k * d) * (W * s + k * d))
    y = ge.conv_transpose2d_gelu_group_norm(leaves[0], leaves[1], leaves[2], G, leaves[3], leaves[4], s, p, op, d,
                                            groups, 1e-5, approx)
    dy = torch.randn(y.shape, generator=gen).to(device, dtype)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, present, dy))
    return x, w, cb, gw, gb, dy, y, [next(grads) if t is not None else None for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_float64_reference(device, dtype, fmt, case):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("float16 conv_transpose2d on the CPU is not what users run")
    torch.backends.cudnn.allow_tf32 = False
    try:
        x, w, cb, gw, gb, dy, y, grads = _run(case, dtype, device, fmt, seed=hash(case) % 1000)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    ref, ref_grads = _reference(case, x, w, cb, gw, gb, dy)
    ftol, btol = TOL[dtype]
    assert y.shape == ref.shape and y.dtype == dtype
    assert y.is_contiguous(memory_format=fmt or torch.contiguous_format)  # the input's layout
    assert torch.isfinite(y).all()
    assert rel_err(y.cpu(), ref) <= ftol, rel_err(y.cpu(), ref)
    for name, g, r in zip(("input", "weight", "conv_bias", "gn_weight", "gn_bias"), grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            assert g.shape == r.shape and torch.isfinite(g).all(), name
            err = rel_err(g.cpu(), r)
            assert err <= btol, f"grad {name}: relative error {err:.2e} > {btol:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cout,G", [(64, 8), (12, 3), (40, 5), (1024, 32)])
def test_nchw_input_nchw_output(cout, G, dtype):
    """An NCHW input gives an NCHW-contiguous output, written by the elementwise pass through its shared-memory
    tile (C_out 64: 16-byte channel vectors; 12: 16-byte (fp32) or scalar (bf16) vectors; 40 with a 71x9 output
    map: a partial last tile; 1024: too wide for the tiles, computed channels_last and copied), with the
    values of the channels_last output of the same input in channels_last and of the float64 reference."""
    H, W = (69, 7) if cout == 40 else (9, 7)
    case = (2, 16, cout, H, W, 3, 1, 0, 0, 1, 1, G, "none", True, True)
    gen = torch.Generator().manual_seed(cout)
    x = rand_input((2, 16, H, W), dtype, "cuda", scale=1.0, offset=0.5, gen=gen)
    w, cb, gw, gb = _params(case, dtype, "cuda", gen)
    poison("cuda", 8 * 2 * cout * (H + 2) * (W + 2))
    torch.backends.cudnn.allow_tf32 = False
    try:
        names = _conv_kernels(lambda: ge.conv_transpose2d_gelu_group_norm(x, w, cb, G, gw, gb))
        y = ge.conv_transpose2d_gelu_group_norm(x, w, cb, G, gw, gb)
        y_cl = ge.conv_transpose2d_gelu_group_norm(x.contiguous(memory_format=CL), w, cb, G, gw, gb)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    assert y.is_contiguous() and y_cl.is_contiguous(memory_format=CL)
    tiled = cout != 1024
    assert any("out_nchw" in n for n in names) == tiled, names
    torch.testing.assert_close(y, y_cl, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-5)
    xd, wd, cbd, gwd, gbd = (t.cpu().double() for t in (x, w, cb, gw, gb))
    ref = F.group_norm(F.gelu(F.conv_transpose2d(xd, wd, cbd)), G, gwd, gbd, 1e-5)
    assert rel_err(y.cpu(), ref) <= TOL[dtype][0]


@pytest.mark.gpu
def test_tf32_follows_cudnn_flag():
    """TF32 on (PyTorch's default for cuDNN convs): ~1e-3 relative of the float64 reference."""
    case = CASES[4]
    x, w, cb, gw, gb, dy, y, grads = _run(case, torch.float32, "cuda", None, seed=3)
    ref, ref_grads = _reference(case, x, w, cb, gw, gb, dy)
    assert rel_err(y.cpu(), ref) <= 5e-3
    for g, r in zip(grads, ref_grads):
        assert rel_err(g.cpu(), r) <= 1e-2


# Float32 TF32 cases: output maps of 285, 99 and 35 pixels, C_out = 48, G = C, G = 1, a 1x1 kernel,
# padding > 0, both GELU forms.
TF32_CASES = [
    (2, 32, 64, 17, 13, 3, 1, 0, 0, 1, 1, 8, "none", True, True),
    (1, 64, 48, 9, 9, 3, 1, 1, 0, 1, 1, 48, "tanh", True, True),
    (3, 32, 32, 5, 7, 1, 1, 0, 0, 1, 1, 1, "none", False, False),
    (2, 64, 64, 30, 30, 3, 1, 0, 0, 1, 1, 8, "tanh", True, True),
]


def _conv_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
@pytest.mark.parametrize("case", TF32_CASES, ids=[f"tf32case{i}" for i in range(len(TF32_CASES))])
def test_tf32_cases_match_float64_reference(case, fmt):
    """cuDNN conv (TF32) + gnext's GroupNorm: forward and every gradient within TF32 tolerances of float64,
    and the output in the input's layout."""
    x, w, cb, gw, gb, dy, y, grads = _run(case, torch.float32, "cuda", fmt, seed=11)
    ref, ref_grads = _reference(case, x, w, cb, gw, gb, dy)
    assert torch.isfinite(y).all() and y.is_contiguous(memory_format=fmt or torch.contiguous_format)
    assert rel_err(y.cpu(), ref) <= 5e-3, rel_err(y.cpu(), ref)
    for name, g, r in zip(("input", "weight", "conv_bias", "gn_weight", "gn_bias"), grads, ref_grads):
        if g is not None:
            err = rel_err(g.cpu(), r)
            assert err <= 1e-2, f"grad {name}: relative error {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [None, CL, "sliced"])
def test_input_cl_output_and_saved_input(device, fmt):
    """The op's input_cl output: on CUDA the channels_last copy of an input not dense in channels_last
    (NCHW, sliced), which autograd saves in place of the input so the backward does not transpose it
    again; (0,) for channels_last input and on the CPU. Gradients do not depend on it (checked against
    float64 in test_matches_float64_reference for both layouts)."""
    case = CASES[0]
    gen = torch.Generator().manual_seed(8)
    N, cin, cout, H, W = case[:5]
    if fmt == "sliced":
        x = rand_input((N, cin, H, W + 2), torch.float32, device, scale=1.0, offset=0.5, gen=gen)[..., 1:-1]
    else:
        x = rand_input((N, cin, H, W), torch.float32, device, scale=1.0, offset=0.5, memory_format=fmt, gen=gen)
    w, cb, gw, gb = _params(case, torch.float32, device, gen)
    args = (cb, [1, 1], [0, 0], [0, 0], [1, 1], 1, case[11], gw, gb, 1e-5, "none")
    input_cl = torch.ops.gnext.conv_transpose2d_gelu_group_norm(x, w, *args)[4]
    copied = device == "cuda" and fmt != CL
    if copied:
        assert input_cl.shape == x.shape and input_cl.is_contiguous(memory_format=CL) and torch.equal(input_cl, x)
    else:
        assert input_cl.shape == (0,)
    xl = x.detach().requires_grad_()
    y = ge.conv_transpose2d_gelu_group_norm(xl, w, cb, case[11], gw, gb)
    saved = y.grad_fn.saved_tensors[0]
    assert torch.equal(saved, x)
    assert saved.is_contiguous(memory_format=CL) if copied else saved.data_ptr() == xl.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(5)
    for case, fmt in ((CASES[0], None), (CASES[1], CL), (CASES[2], None)):
        N, cin, cout, H, W, k, s, p, op, d, groups, G, approx, has_cb, affine = case
        x = rand_input((N, cin, H, W), torch.float32, device, scale=1.0, offset=0.5, memory_format=fmt, gen=gen)
        w, cb, gw, gb = _params(case, torch.float32, device, gen)
        args = (x, w, cb, [s, s], [p, p], [op, op], [d, d], groups, G, gw, gb, 1e-5, approx)
        op_f = torch.ops.gnext.conv_transpose2d_gelu_group_norm.default
        torch.library.opcheck(op_f, args)
        torch.library.opcheck(op_f, (x.requires_grad_(), w.requires_grad_()) + args[2:])
        _, z, mean, rstd, _ = op_f(*args)
        dy = torch.randn(z.shape, generator=gen).to(device)
        for mask in ([True, True, True, True, True], [True, False, False, False, False],
                     [False, False, True, True, True]):
            torch.library.opcheck(torch.ops.gnext.conv_transpose2d_gelu_group_norm_backward.default,
                                  (dy, x.detach(), w.detach(), cb, z, mean, rstd, gw) + args[3:9] + (approx, mask))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_module(device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = ge.ConvTranspose2dGELUGroupNorm(8, 16, 3, num_groups=4, stride=2, padding=1, output_padding=1).to(device)
    x = rand_input((2, 8, 7, 6), torch.float32, device, scale=1.0, offset=0.5).requires_grad_()
    compiled = torch.compile(m, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    y_c = compiled(x)
    g_c = torch.autograd.grad((y_c * y_c).sum(), [x] + list(m.parameters()))
    y_e = m(x)
    g_e = torch.autograd.grad((y_e * y_e).sum(), [x] + list(m.parameters()))
    torch.testing.assert_close(y_c, y_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_module_checkpoint_mapping_and_converter():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.ConvTranspose2d(4, 8, 3, stride=2), nn.GELU(approximate="tanh"), nn.GroupNorm(2, 8), nn.ReLU())
    with torch.no_grad():
        seq[2].weight.normal_()
        seq[2].bias.normal_()
    x = rand_input((2, 4, 5, 5), torch.float32, "cpu", scale=1.0, offset=0.5)
    ref = seq(x)
    fused = ge.ConvTranspose2dGELUGroupNorm(4, 8, 3, num_groups=2, stride=2, approximate="tanh")
    assert set(fused.state_dict()) == {"conv.weight", "conv.bias", "norm.weight", "norm.bias"}
    mapping = {"0.": "conv.", "2.": "norm."}
    fused.load_state_dict({mapping[k[:2]] + k[2:]: v for k, v in seq.state_dict().items()})
    torch.testing.assert_close(torch.relu(fused(x)), ref, rtol=1e-5, atol=1e-5)
    converted = ge.convert_conv_transpose_gelu_group_norm(seq)
    assert isinstance(converted[0], ge.ConvTranspose2dGELUGroupNorm)
    assert isinstance(converted[1], nn.Identity) and isinstance(converted[2], nn.Identity)
    assert converted[0].conv.weight is seq[0].conv.weight  # shared, not copied
    torch.testing.assert_close(converted(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_messages(device):
    x = torch.randn(2, 4, 5, 5, device=device)
    w = torch.randn(4, 8, 3, 3, device=device)
    f = ge.conv_transpose2d_gelu_group_norm
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh'"):
        f(x, w, None, 2, approximate="erf")
    with pytest.raises(RuntimeError, match=r"conv_bias must have shape \(C_out,\) = \(8\)"):
        f(x, w, torch.randn(7, device=device), 2)
    with pytest.raises(RuntimeError, match="must be divisible by num_groups=3"):
        f(x, w, None, 3)
    with pytest.raises(RuntimeError, match="input must be \\(N, C_in, H, W\\)"):
        f(x[0], w, None, 2)
    with pytest.raises(RuntimeError, match="weight dtype"):
        f(x, w.double(), None, 2)
    with pytest.raises(RuntimeError, match="input dtype must be float32, float16 or bfloat16"):
        f(x.double(), w.double(), None, 2)
