# SPDX-License-Identifier: BSD-3-Clause
"""opcheck (schema, fake kernels, autograd registration, AOT dispatch) and torch.compile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import groupnorm_ext as ge
from conftest import DEVICES, gn_decomposed, rand_input

CL = torch.channels_last


def _sample_inputs(device):
    gen = torch.Generator().manual_seed(0)
    for shape, g, fmt, dtype in [
        ((2, 6, 5, 7), 3, None, torch.float32),
        ((2, 8, 4, 4), 4, CL, torch.float32),
        ((2, 8, 10), 2, None, torch.float16),
        ((3, 8), 8, None, torch.bfloat16),
    ]:
        x = rand_input(shape, dtype, device, memory_format=fmt, gen=gen)
        w = torch.randn(shape[1], generator=gen).to(device, dtype)
        b = torch.randn(shape[1], generator=gen).to(device, dtype)
        yield x, g, w, b


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward(device):
    for x, g, w, b in _sample_inputs(device):
        torch.library.opcheck(torch.ops.gnext.group_norm.default, (x, g, w, b, 1e-5))
        torch.library.opcheck(torch.ops.gnext.group_norm.default, (x.requires_grad_(), g, w, b, 1e-5))
        torch.library.opcheck(torch.ops.gnext.group_norm.default, (x.detach(), g, None, None, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(device):
    for x, g, w, b in _sample_inputs(device):
        _, mean, rstd = torch.ops.gnext.group_norm(x, g, w, b, 1e-5)
        dy = torch.randn_like(x)
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            torch.library.opcheck(torch.ops.gnext.group_norm_backward.default, (dy, x, mean, rstd, w, g, mask))
        torch.library.opcheck(torch.ops.gnext.group_norm_backward.default,
                              (dy, x, mean, rstd, None, g, [True, False, False]))


class _Net(torch.nn.Module):
    def __init__(self, C, G):
        super().__init__()
        self.gn = ge.GroupNorm(G, C)

    def forward(self, x):
        return torch.sin(self.gn(x)) * 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [None, CL], ids=["nchw", "cl"])
def test_compile_fullgraph_forward_backward(device, fmt):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    net = _Net(8, 4).to(device)
    with torch.no_grad():
        net.gn.weight.copy_(torch.randn(8, generator=gen))
        net.gn.bias.copy_(torch.randn(8, generator=gen))
    x = rand_input((2, 8, 6, 6), torch.float32, device, memory_format=fmt, gen=gen).requires_grad_()
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(net, fullgraph=True, backend=backend)
    y_c = compiled(x)
    g_c = torch.autograd.grad(y_c.sum(), [x, net.gn.weight, net.gn.bias])
    y_e = net(x)
    g_e = torch.autograd.grad(y_e.sum(), [x, net.gn.weight, net.gn.bias])
    torch.testing.assert_close(y_c, y_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)
    # and against PyTorch's own GroupNorm
    ref = torch.sin(F.group_norm(x, 4, net.gn.weight, net.gn.bias)) * 2
    torch.testing.assert_close(y_c, ref, rtol=1e-5, atol=1e-5)


def test_ops_leave_the_layout_to_inductor():
    """Every gnext overload carries torch.Tag.flexible_layout (added in _registry.py; the stable ABI of torch
    2.11 cannot attach tags), so Inductor adds no layout constraint: without it, each call in an NCHW model
    whose convolutions Inductor runs channels_last paid a transposing copy in and out (BiT training step
    on the H100: 11.6 ms of GPU kernels against 8.4 with the tag)."""
    from torch._inductor.lowering import maybe_layout_constraints
    from torch._library.utils import get_layout_constraint_tag

    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("gnext::")]
    assert len(names) == 24  # 17 ops and 7 _no_autograd twins
    for name in names:
        packet = getattr(ge.ops, name.split("::")[1])
        for overload in packet.overloads():
            op = getattr(packet, overload)
            assert get_layout_constraint_tag(op) == torch.Tag.flexible_layout, op
            assert maybe_layout_constraints(op) is None, op


@pytest.mark.gpu
@pytest.mark.parametrize("view", ["transposed", "sliced", "channels_last"])
def test_inductor_any_input_layout_training(view):
    """With no layout constraint Inductor hands the op whatever strides its producer has: views that are
    not dense, and channels_last tensors of a graph traced with NCHW ones. Forward and gradients of the
    compiled function match eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1).cuda()
    w = torch.randn(16, generator=gen).cuda().requires_grad_()
    b = torch.randn(16, generator=gen).cuda().requires_grad_()

    def f(x):
        h = x * 1.5
        h = {"transposed": lambda t: t.transpose(2, 3), "sliced": lambda t: t[:, :, 1:-1, ::2],
             "channels_last": lambda t: conv(t)}[view](h)
        y = ge.group_norm_act(h, 4, w, b, activation="silu")
        return conv(y).sin() if view == "channels_last" else y.cos()

    x = rand_input((2, 16, 12, 10), torch.float32, "cuda", gen=gen).requires_grad_()
    with torch.backends.cudnn.flags(allow_tf32=False):
        y_c = torch.compile(f, fullgraph=True)(x)
        g_c = torch.autograd.grad(y_c.square().sum(), [x, w, b])
        y_e = f(x)
        g_e = torch.autograd.grad(y_e.square().sum(), [x, w, b])
    torch.testing.assert_close(y_c, y_e, rtol=1e-4, atol=1e-4)
    for a, e in zip(g_c, g_e):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_shapes(device):
    torch._dynamo.reset()
    f = torch.compile(lambda x: ge.group_norm(x, 4), fullgraph=True, dynamic=True,
                      backend="inductor" if device == "cuda" else "aot_eager")
    for shape in [(2, 8, 5, 5), (3, 8, 7, 2), (1, 8, 9)]:
        x = rand_input(shape, torch.float32, device)
        torch.testing.assert_close(f(x), F.group_norm(x, 4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_optional_and_partial_inputs(device):
    """Gradients with None optionals before others (weight None, bias given) and requires_grad on
    only some inputs, for every op, against autograd through elementary PyTorch ops."""
    gen = torch.Generator().manual_seed(3)
    x = rand_input((2, 8, 5, 5), torch.float32, device, gen=gen)
    b = torch.randn(8, generator=gen).to(device)
    for w_on, b_on, x_grad in [(False, True, True), (True, False, True), (False, True, False), (True, True, False)]:
        w = torch.randn(8, generator=gen).to(device) if w_on else None
        bb = b if b_on else None
        leaves = {"x": x.clone().requires_grad_(x_grad)}
        if w is not None:
            leaves["w"] = w.clone().requires_grad_()
        if bb is not None:
            leaves["b"] = bb.clone().requires_grad_(not x_grad)
        want = [t for t in leaves.values() if t.requires_grad]
        ours = ge.group_norm(leaves["x"], 4, leaves.get("w"), leaves.get("b"))
        ref = gn_decomposed(leaves["x"], 4, leaves.get("w"), leaves.get("b"))
        for a, r in zip(torch.autograd.grad(ours.sum() * 2, want), torch.autograd.grad((ref.sum() * 2), want)):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
        ours = ge.group_norm_act(leaves["x"], 4, leaves.get("w"), leaves.get("b"), 1e-5, "silu", None)
        ref = F.silu(gn_decomposed(leaves["x"], 4, leaves.get("w"), leaves.get("b")))
        for a, r in zip(torch.autograd.grad((ours * ours).sum(), want), torch.autograd.grad((ref * ref).sum(), want)):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    # fused conv op: conv_bias None, GN affine
    xc = rand_input((2, 4, 5, 5), torch.float32, device, scale=1.0, offset=0.5, gen=gen)
    wc = (torch.randn(4, 8, 3, 3, generator=gen) * 0.2).to(device).requires_grad_()
    gw = torch.randn(8, generator=gen).to(device).requires_grad_()
    gb = torch.randn(8, generator=gen).to(device).requires_grad_()
    torch.backends.cudnn.allow_tf32 = False
    try:
        ours = ge.conv_transpose2d_gelu_group_norm(xc, wc, None, 2, gw, gb)
        ref = F.group_norm(F.gelu(F.conv_transpose2d(xc, wc)), 2, gw, gb)
        for a, r in zip(torch.autograd.grad((ours * ours).sum(), [wc, gw, gb]),
                        torch.autograd.grad((ref * ref).sum(), [wc, gw, gb])):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cudnn.allow_tf32 = True


class _Tagged(torch.Tensor):
    """A __torch_function__ subclass that records the functions it sees."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["group_norm", "group_norm_act"])
def test_eager_entry_matches_dispatcher_path(device, op):
    """functional.* in eager mode skips the dispatcher's Python Autograd kernel (_autograd._eager): same
    outputs and gradients as torch.ops.gnext.* through that kernel, and the node it records says which
    path ran. Double backward raises on both."""
    gen = torch.Generator().manual_seed(3)
    x = rand_input((2, 8, 5, 3), torch.float32, device, gen=gen)
    w, b = (torch.randn(8, generator=gen).to(device) for _ in range(2))
    dy = torch.randn(x.shape, generator=gen).to(device)
    extra = ("silu", None) if op == "group_norm_act" else ()
    fn = getattr(ge, op)
    results = {}
    for path in ("eager", "dispatcher"):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        if path == "eager":
            y = fn(leaves[0], 4, leaves[1], leaves[2], 1e-5, *extra)
        else:
            y = getattr(torch.ops.gnext, op).default(leaves[0], 4, leaves[1], leaves[2], 1e-5, *extra)[0]
        assert type(y.grad_fn).__name__ == f"{op}_{'eager' if path == 'eager' else 'autograd'}Backward"
        results[path] = (y.detach(), *torch.autograd.grad(y, leaves, dy, create_graph=True))
        with pytest.raises(RuntimeError, match="not implemented"):
            torch.autograd.grad(results[path][1].sum(), leaves)
    for a, c in zip(results["eager"], results["dispatcher"]):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    # no grad needed: no autograd node at all
    with torch.no_grad():
        assert fn(x.requires_grad_(), 4, w, b, 1e-5, *extra).grad_fn is None
    assert fn(x.detach(), 4, w, b, 1e-5, *extra).grad_fn is None


@pytest.mark.parametrize("device", DEVICES)
def test_eager_entry_leaves_subclasses_to_torch_function(device):
    """A tensor subclass's __torch_function__ sees the op (the eager entry is for plain tensors only)."""
    x = rand_input((2, 4, 3, 3), torch.float32, device, gen=torch.Generator().manual_seed(4)).as_subclass(_Tagged)
    _Tagged.seen.clear()
    y = ge.group_norm(x, 2)
    assert any("group_norm" in s for s in _Tagged.seen), _Tagged.seen
    torch.testing.assert_close(y.as_subclass(torch.Tensor), F.group_norm(x.as_subclass(torch.Tensor), 2),
                               rtol=1e-5, atol=1e-5)
