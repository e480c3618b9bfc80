# SPDX-License-Identifier: BSD-3-Clause
"""enable_compile_fusion(): Inductor's pre-grad pass rewrites GroupNorm + activation (+ residual) into
gnext::group_norm_act. Checked: it fires (counted rewrites and gnext nodes in the compiled graph), the
compiled model matches eager (forward and gradients) in inference and training, fullgraph=True, dynamic
shapes, mode="reduce-overhead" (CUDA), chains that must stay unfused, and the 'auto' rule.
On the CPU the pass runs with when="always" (the 'auto' rule fuses CUDA tensors only)."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_ext as ge
from groupnorm_ext import compile_fusion
from conftest import DEVICES, perturb_params, rand_input, run_graph_pass


class Block(nn.Module):
    """norm1 -> act -> conv -> norm2 -> act (+ residual), the ResnetBlock2D shape, written in forward."""

    def __init__(self, C=16, G=4, act=None, residual=True):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(G, C), nn.GroupNorm(G, C, eps=1e-6)
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.act = act or nn.SiLU()
        self.residual = residual

    def forward(self, x):
        h = self.act(self.norm1(x))
        h = self.conv(h)
        h = self.act(self.norm2(h))
        return x + h if self.residual else h


def _close(out, ref, rel_l2, rel_max):
    """Half-precision comparison: relative L2 error <= rel_l2 and max |out - ref| <= rel_max * max |ref|."""
    out, ref = out.double(), ref.double()
    assert ((out - ref).norm() / ref.norm()).item() <= rel_l2
    assert (out - ref).abs().max().item() <= rel_max * ref.abs().max().item()


ACTS = [nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.Tanh(), nn.Hardswish()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS, ids=lambda a: type(a).__name__ + getattr(a, "approximate", ""))
def test_fires_and_matches_eager_training(device, act, fusion):
    torch.manual_seed(0)
    model = perturb_params(Block(act=act)).to(device)
    x = rand_input((2, 16, 9, 7), torch.float32, device).requires_grad_()
    ref = model(x)
    ref_g = torch.autograd.grad((ref * ref).sum(), [x, *model.parameters()])
    comp = torch.compile(model, fullgraph=True)
    out = comp(x)
    g = torch.autograd.grad((out * out).sum(), [x, *model.parameters()])
    # no_autograd: the forward graph's 2 group_norm_act (the backward graph calls the backward op's twin already:
    # _autograd._call_backward, traced with grad mode off)
    assert fusion() == {"group_norm_act": 2, "residual": 1, "input_bias": 1, "left": 0, "no_autograd": 2, "pad": 0,
                        "unmatched": 0, "modulate": 0, "gather": 0, "zero_pad": 0}
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


class CausalBlock3D(nn.Module):
    """A video VAE's causal 3D block: norm -> SiLU -> causal replicate pad -> Conv3d, twice, + residual (5-D)."""

    def __init__(self, C=16, G=4):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(G, C, eps=1e-6), nn.GroupNorm(G, C, eps=1e-6)
        self.conv1, self.conv2 = nn.Conv3d(C, C, 3), nn.Conv3d(C, C, 3)

    def forward(self, x):
        pad = (1, 1, 1, 1, 2, 0)
        h = self.conv1(F.pad(F.silu(self.norm1(x)), pad, mode="replicate"))
        h = self.conv2(F.pad(F.silu(self.norm2(h)), pad, mode="replicate"))
        return x + h


@pytest.mark.parametrize("device", DEVICES)
def test_5d_video_block(device, fusion):
    """5-D GroupNorm -> SiLU chains (the HunyuanVideo decoder's) are rewritten, inference and training."""
    torch.manual_seed(0)
    model = perturb_params(CausalBlock3D()).to(device)
    x = rand_input((1, 16, 5, 6, 7), torch.float32, device).requires_grad_()
    # float32 convolutions without TF32: cuDNN's TF32 algorithms, which may differ between the two graphs' calls
    # (one of them without conv1's bias), put the gradients 3% apart on a few elements
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = model(x)
        ref_g = torch.autograd.grad(ref.square().sum(), [x, *model.parameters()])
        comp = torch.compile(model, fullgraph=True)
        out = comp(x)
        g = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    # conv1's bias: norm2's input_bias; both chains write their convolution's replicate-padded input
    assert fusion()["group_norm_act"] == 2 and fusion()["input_bias"] == 1 and fusion()["pad"] == 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_dynamic_shapes(device, fusion):
    torch.manual_seed(0)
    model = perturb_params(Block()).to(device).eval()
    comp = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for shape in [(2, 16, 8, 8), (3, 16, 5, 11), (1, 16, 12, 4)]:
            x = rand_input(shape, torch.float32, device)
            torch.testing.assert_close(comp(x), model(x), rtol=1e-4, atol=1e-4)
    assert fusion()["group_norm_act"] >= 2


def test_gnext_op_in_the_compiled_graph(fusion):
    """The graph AOTAutograd hands Inductor holds gnext's forward and backward ops, not aten's GroupNorm."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen = []

    def backend(gm, example_inputs):
        def compiler(g, _):
            seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return make_boxed_func(g.forward)

        compile_fusion._rewrite(gm.graph, "always")
        gm.recompile()
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler)

    model = perturb_params(Block())
    x = rand_input((2, 16, 6, 6), torch.float32, "cpu").requires_grad_()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    assert sum("gnext.group_norm_act.default" in s for s in seen) == 2
    assert sum("gnext.group_norm_act_backward_no_autograd.default" in s for s in seen) == 2
    assert not any("native_group_norm" in s for s in seen)


def test_post_grad_graphs_call_the_twins(fusion):
    """After AOTAutograd, every gnext call with a twin of no Autograd kernel calls the twin, in the training forward
    and backward graphs (the post-grad pass; the backward ops' twins come from _autograd._call_backward already) and
    in inference graphs; the twins have no Autograd kernel, and the compiled model still matches eager, gradients
    included."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    for name in ("group_norm", "group_norm_backward", "group_norm_act", "group_norm_act_backward",
                 "group_norm_act_pad", "group_norm_act_modulate"):
        op, twin = getattr(torch.ops.gnext, name).default, getattr(torch.ops.gnext, name + "_no_autograd").default
        assert compile_fusion._no_autograd(op) is twin and compile_fusion._no_autograd(twin) is None
        assert str(twin._schema).replace("_no_autograd(", "(") == str(op._schema)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(twin.name(), "Autograd")
        assert torch.Tag.flexible_layout in twin.tags
    assert compile_fusion._no_autograd(torch.ops.aten.add.Tensor) is None

    seen = []

    def backend(gm, example_inputs):
        def compiler(g, _):
            compile_fusion._retarget(g.graph)
            g.recompile()
            seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return make_boxed_func(g.forward)

        compile_fusion._rewrite(gm.graph, "always")
        gm.recompile()
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler)

    torch.manual_seed(0)
    model = perturb_params(Block())
    x = rand_input((2, 16, 6, 5), torch.float32, "cpu").requires_grad_()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    g = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    ref = model(x)
    ref_g = torch.autograd.grad(ref.square().sum(), [x, *model.parameters()])
    assert sum(s == "gnext.group_norm_act_no_autograd.default" for s in seen) == 2
    assert sum(s == "gnext.group_norm_act_backward_no_autograd.default" for s in seen) == 2
    assert not any(s in ("gnext.group_norm_act.default", "gnext.group_norm_act_backward.default") for s in seen)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)

    seen.clear()
    with torch.no_grad():
        y = torch.compile(model.eval(), backend=backend, fullgraph=True)(x)
    assert seen.count("gnext.group_norm_act_no_autograd.default") == 2 and not y.requires_grad
    torch.testing.assert_close(y, ref.detach(), rtol=1e-4, atol=1e-4)


def _rewritten(model, *args):
    """The model's outputs under torch.compile with a backend that runs only the pre-grad pass (when='always', no
    Inductor), its eager outputs, the pass's counts and the rewritten graph; under no_grad."""
    before = dict(compile_fusion.compile_fusion_stats)
    out, ref, graph = run_graph_pass(model, args, lambda graph: compile_fusion._rewrite(graph, "always"))
    return out, ref, {k: compile_fusion.compile_fusion_stats[k] - before[k] for k in before}, graph


def test_conv_bias_taken_into_the_op():
    """A convolution whose output only the GroupNorm reads runs without its bias, which the op adds as it reads
    (input_bias): positional and keyword biases, 1-D to 3-D. Left in the convolution: an output with another
    user, a convolution without a bias. The rewritten graph matches eager."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.c3 = nn.Conv2d(8, 16, 3, padding=1), nn.Conv1d(8, 16, 1), nn.Conv3d(8, 16, 1)
            self.c4 = nn.Conv2d(8, 16, 1, bias=False)
            self.n = nn.GroupNorm(4, 16)

        def forward(self, x, x1, x3):
            a = F.silu(self.n(self.c1(x)))                                     # moved
            b = F.silu(self.n(F.conv2d(x, self.c1.weight, bias=self.c1.bias, padding=1)))  # keyword: moved
            h = self.c1(x)
            c = F.silu(self.n(h)) + h                                          # h has two users: kept
            d = F.silu(self.n(self.c4(x)))                                     # no bias
            e = F.gelu(self.n(self.c2(x1)))                                    # 1-D: moved
            f = F.silu(self.n(self.c3(x3)))                                    # 3-D: moved
            return a, b, c, d, e, f

    args = (rand_input((2, 8, 6, 5), torch.float32, "cpu"), rand_input((2, 8, 7), torch.float32, "cpu"),
            rand_input((1, 8, 3, 4, 5), torch.float32, "cpu"))
    out, ref, stats, graph = _rewritten(perturb_params(M()), *args)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert stats == {"group_norm_act": 6, "residual": 1, "input_bias": 4, "left": 0, "no_autograd": 0,
                     "pad": 0, "unmatched": 0, "modulate": 0, "gather": 0, "zero_pad": 0}  # no Inductor
    ops = [n for n in graph.nodes if n.target is torch.ops.gnext.group_norm_act.default]
    assert sum(n.args[7] is not None for n in ops) == 4
    convs = [n for n in graph.nodes if n.target in compile_fusion._CONVS]
    with_bias = [n for n in convs if (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")) is not None]
    assert len(convs) == 6 and len(with_bias) == 1  # the conv whose output has two users


def test_conv_bias_moved_past_other_readers():
    """A convolution output that the GroupNorm and other readers share runs without its bias too, where each other
    reader can take it: a convolution with no padding and one group (its bias gains sum_k W b; directly, through the
    block's `.contiguous()`, through a pad of size 0, with or without a bias of its own) or an add with a tensor of
    the output's shape (it reads x + b). Kept where another reader is there (a mul, a padded or grouped convolution)
    or where the reader is the chain's own residual add. The rewritten graph matches eager."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.c3 = nn.Conv2d(8, 16, 3, padding=1), nn.Conv3d(8, 16, 3, padding=1)
            self.short, self.short_nb = nn.Conv2d(16, 12, 1), nn.Conv2d(16, 12, 1, bias=False)
            self.short3 = nn.Conv3d(16, 12, 1)
            self.k3, self.pad1, self.grouped = nn.Conv2d(16, 12, 3, stride=2), nn.Conv2d(16, 12, 3, padding=1), \
                nn.Conv2d(16, 16, 1, groups=2)
            self.n = nn.GroupNorm(4, 16)

        def forward(self, x, x3):
            h = self.c(x)
            a = (F.silu(self.n(h)), self.short(h), self.short_nb(h), self.k3(h))     # moved: convolutions
            h = self.c(x)
            b = self.short(F.silu(self.n(h))) + self.short(h)                         # moved
            h = self.c(x)
            c = F.silu(self.n(h)) * 2 + h                                              # moved: an add
            h = self.c3(x3).contiguous()
            d = (F.silu(self.n(h)), self.short3(F.pad(h, (0, 0, 0, 0, 0, 0), mode="replicate")))  # moved
            h = self.c(x)
            e = (F.silu(self.n(h)), h * 2)                                             # kept: a mul
            h = self.c(x)
            f = (F.silu(self.n(h)), self.pad1(h))                                      # kept: padding
            h = self.c(x)
            g = (F.silu(self.n(h)), self.grouped(h))                                   # kept: groups
            h = self.c(x)
            k = F.silu(self.n(h)) + h                                                  # kept: the op's residual
            return a, b, c, d, e, f, g, k

    args = (rand_input((2, 8, 6, 5), torch.float32, "cpu"), rand_input((1, 8, 3, 4, 5), torch.float32, "cpu"))
    out, ref, stats, graph = _rewritten(perturb_params(M()), *args)
    flat = lambda t: [v for o in t for v in (o if isinstance(o, tuple) else (o,))]  # noqa: E731
    for o, r in zip(flat(out), flat(ref)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert stats["group_norm_act"] == 8 and stats["input_bias"] == 4 and stats["residual"] == 1
    convs = [n for n in graph.nodes if n.target in compile_fusion._CONVS]
    firsts = [n for n in convs if compile_fusion._meta(n.args[1]).shape[:3] == (16, 8, 3)]  # self.c, self.c3
    assert len(firsts) == 8
    biased = [n for n in firsts if (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")) is not None]
    assert len(biased) == 4  # e, f, g, k


class SharedConvOutput(nn.Module):
    """A convolution output read by a GroupNorm chain, an identity residual add and a 1x1x1 causal shortcut (through
    its pad of size 0), after `.contiguous()`: a video block after an up-sampler."""

    def __init__(self):
        super().__init__()
        self.c, self.c2 = nn.Conv3d(8, 16, 3, padding=1), nn.Conv3d(16, 16, 3, padding=1)
        self.short = nn.Conv3d(16, 12, 1)
        self.n = nn.GroupNorm(4, 16)

    def forward(self, x):
        h = self.c(x).contiguous()
        return self.c2(F.silu(self.n(h))) + h, self.short(F.pad(h, (0,) * 6, mode="replicate"))


@pytest.mark.parametrize("device", DEVICES)
def test_conv_bias_moved_past_readers_training(device, fusion, no_tf32):
    """Under torch.compile (Inductor) with the bias moved past the add and the shortcut: the forward and every
    gradient (the convolutions' biases and weights included) match eager."""
    torch.manual_seed(0)
    m = perturb_params(SharedConvOutput()).to(device)
    x = rand_input((1, 8, 3, 4, 5), torch.float32, device).requires_grad_()
    ref = m(x)
    ref_g = torch.autograd.grad(sum(r.square().sum() for r in ref), [x, *m.parameters()])
    out = torch.compile(m, fullgraph=True)(x)
    g = torch.autograd.grad(sum(r.square().sum() for r in out), [x, *m.parameters()])
    assert fusion()["input_bias"] == 1
    for a, b in zip((*out, *g), (*ref, *ref_g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hunyuan_video_decoder_biases_moved():
    """diffusers' HunyuanVideo decoder (small widths), the pre-grad pass and the movement rules run on Dynamo's graph
    (no Inductor): every convolution whose output a GroupNorm reads runs without its bias, conv_in's and the
    up-samplers' included (read by the next block's norm1 and by its shortcut convolution or residual add), and the
    decode matches eager."""
    hy = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video")
    torch.manual_seed(0)
    vae = perturb_params(hy.AutoencoderKLHunyuanVideo(block_out_channels=(16, 32, 64, 64), norm_num_groups=4))
    dec = vae.decoder.eval()
    z = rand_input((1, 16, 3, 8, 8), torch.float32, "cpu")
    before = dict(compile_fusion.compile_fusion_stats)

    def passes(graph):
        compile_fusion._rewrite(graph, "always")
        compile_fusion.rewrite_movement(graph, compile_fusion.compile_fusion_stats, lambda x, y: True)

    out, ref, graph = run_graph_pass(dec, (z,), passes)
    stats = {k: compile_fusion.compile_fusion_stats[k] - before[k] for k in before}
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # 29 norms: 14 read a conv1's output alone, 4 the output of conv_in or an up-sampler's convolution
    assert (stats["group_norm_act"], stats["pad"], stats["input_bias"], stats["gather"]) == (29, 29, 18, 3)
    sources = []
    for n in graph.nodes:
        if n.target is torch.ops.gnext.group_norm_act_pad.default:
            x = n.args[0]
            x = x.args[0] if x.target == "contiguous" else x
            if x.target in compile_fusion._CONVS:
                sources.append(x.args[2] if len(x.args) > 2 else x.kwargs.get("bias"))
    assert len(sources) == 18 and all(b is None for b in sources)


class SpatialNorm(nn.Module):
    """CogVideoX's spatial norm (CogVideoXSpatialNorm3D) -> SiLU: the latents z upsampled to x's size by nearest
    neighbour (the first frame apart where x has an odd number of frames over 1), two 1x1x1 convolutions of them,
    GroupNorm(x) * conv_y + conv_b. knobs: the variants the pass must leave alone."""

    def __init__(self, C=16, G=4, Z=4, kernel=1, mode="nearest", act=True, order=True):
        super().__init__()
        self.norm = nn.GroupNorm(G, C, eps=1e-6)
        self.conv_y, self.conv_b = nn.Conv3d(Z, C, kernel, padding=kernel // 2), nn.Conv3d(Z, C, kernel,
                                                                                           padding=kernel // 2)
        self.mode, self.act, self.order = mode, act, order

    def forward(self, x, z):
        size = x.shape[-3:]
        if x.shape[2] > 1 and x.shape[2] % 2 == 1:
            zq = torch.cat([F.interpolate(z[:, :, :1], size=(1,) + size[1:], mode=self.mode),
                            F.interpolate(z[:, :, 1:], size=(size[0] - 1,) + size[1:], mode=self.mode)], dim=2)
        else:
            zq = F.interpolate(z, size=size, mode=self.mode)
        _cache = zq[:, :, 0:].clone()  # noqa: F841  (a frame cache nothing reads, as CogVideoXCausalConv3d makes)
        y, b = self.conv_y(zq), self.conv_b(zq)
        h = self.norm(x) * y + b if self.order else b + y * self.norm(x)
        return F.silu(h) if self.act else h


@pytest.mark.parametrize("device", DEVICES)
def test_modulated_norms(device):
    """GroupNorm(x) * scale + shift (-> activation), scale and shift 1x1x1 conv3ds of nearest-upsampled latents
    (CogVideoX's spatial norm), becomes group_norm_act_modulate with the convolutions at the latents' height and
    width: both operand orders, with and without the activation, the first frame apart or not, the dead clone of
    the upsampled latents dropped, a non-contiguous x through x.contiguous(). Left alone (counted as unmatched):
    3x3x3 convolutions, another upsampling mode, latents at x's size, latents read elsewhere. Same values as eager."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fused = nn.ModuleList([SpatialNorm(), SpatialNorm(act=False, order=False)])
            self.kept = nn.ModuleList([SpatialNorm(kernel=3), SpatialNorm(mode="nearest-exact")])
            self.same = SpatialNorm()

        def forward(self, x, x4, z, z_big):
            out = [self.fused[0](x, z), self.fused[1](x4, z)] + [m(x, z) for m in self.kept]
            out.append(self.same(x, z_big))                              # no upsampling
            n = self.same.norm
            zq = F.interpolate(z, size=x4.shape[-3:])
            out += [F.silu(n(x4) * self.same.conv_y(zq) + self.same.conv_b(zq)), zq]  # zq read elsewhere
            xt = x.transpose(3, 4).contiguous().transpose(3, 4)
            out.append(self.fused[0](xt, z))                              # non-contiguous x: copied
            return out

    x, x4 = rand_input((1, 16, 5, 8, 6), torch.float32, device), rand_input((1, 16, 4, 8, 6), torch.float32, device)
    z, z_big = rand_input((1, 4, 3, 4, 3), torch.float32, device), rand_input((1, 4, 5, 8, 6), torch.float32, device)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        out, ref, stats, graph = _rewritten(perturb_params(M()).to(device), x, x4, z, z_big)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert stats["modulate"] == 3 and stats["group_norm_act"] == 3 and stats["unmatched"] == 4, stats
    ops = [n for n in graph.nodes if n.target is torch.ops.gnext.group_norm_act_modulate.default]
    assert [n.args[7] for n in ops] == ["silu", "identity", "silu"]
    assert [n.args[0].op == "call_method" and n.args[0].target == "contiguous" for n in ops] == [False, False, True]
    for n in ops:  # scale and shift at the latents' height and width
        assert [tuple(compile_fusion._meta(a).shape) for a in n.args[5:7]] == [(1, 16) + tuple(n.args[0].meta[
            "example_value"].shape[2:3]) + (4, 3)] * 2
    # six spatial norms clone their latents; the three fused ones' clones are gone
    assert sum(n.op == "call_method" and n.target == "clone" for n in graph.nodes) == 3
    # a channel's plane at the op's bound for smaller scale and shift (2^31 - 4096 elements): left
    with mock.patch.object(compile_fusion, "_MAX_UPSAMPLED_PLANE", 5 * 8 * 6):
        out, ref, stats, _ = _rewritten(SpatialNorm().to(device), x, z)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert stats["modulate"] == 0 and stats["unmatched"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_modulated_norm_training(device, fusion):
    """A spatial norm -> SiLU rewritten in a training graph (when='always'): the compiled forward and the gradients of
    x, the latents and every parameter match eager's (the op's autograd sums scale's and shift's gradients back to
    the latents' size)."""
    torch.manual_seed(0)
    model = perturb_params(SpatialNorm()).to(device)
    x = rand_input((1, 16, 5, 8, 6), torch.float32, device).requires_grad_()
    z = rand_input((1, 4, 3, 4, 3), torch.float32, device).requires_grad_()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = model(x, z)
        ref_g = torch.autograd.grad(ref.square().sum(), [x, z, *model.parameters()])
        out = torch.compile(model, fullgraph=True)(x, z)
        g = torch.autograd.grad(out.square().sum(), [x, z, *model.parameters()])
    assert fusion()["modulate"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_modulated_norms_into_causal_concatenations(device):
    """A modulated chain whose output (through eval dropouts) goes only into torch.cat along time behind copies of
    its first frame or behind a cache (CogVideoXCausalConv3d's input) becomes one group_norm_act_modulate_cat: no
    full-size output for Inductor to copy into the concatenation. Left as group_norm_act_modulate + cat: the output
    first in the cat, another dim, another slice than the first frame, the output read elsewhere too. Same values
    as eager."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.n = SpatialNorm()

        def forward(self, x, z, cache):
            y = F.dropout(self.n(x, z), 0.0, False)
            first = y[:, :, :1]
            out = [torch.cat([first, first, y], dim=2)]                        # copies of the first frame
            out.append(torch.cat([cache, self.n(x, z)], dim=2))                # a cache
            out.append(torch.cat([self.n(x, z), cache], dim=2))                # output first: kept
            out.append(torch.cat([x, self.n(x, z)], dim=1))                    # along C: kept
            y = self.n(x, z)
            out.append(torch.cat([y[:, :, 1:2], y], dim=2))                    # not the first frame: kept
            y = self.n(x, z)
            out += [torch.cat([cache, y], dim=2), y]                           # y read elsewhere: kept
            return out

    x, z = rand_input((1, 16, 5, 8, 6), torch.float32, device), rand_input((1, 4, 3, 4, 3), torch.float32, device)
    cache = rand_input((1, 16, 2, 8, 6), torch.float32, device)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        out, ref, stats, graph = _rewritten(perturb_params(M()).to(device), x, z, cache)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert stats["modulate"] == 6 and stats["pad"] == 2, stats
    cats = [n for n in graph.nodes if n.target is torch.ops.gnext.group_norm_act_modulate_cat.default]
    assert [(n.args[8], n.args[9] is None) for n in cats] == [(2, True), (2, False)]
    assert sum(n.target is torch.cat for n in graph.nodes) == 4 + 6  # the 4 kept, and the spatial norms' latents


def test_cogvideox_decoder_modulated_norms():
    """diffusers' CogVideoX decoder (small widths): every spatial norm above the latents' resolution is rewritten
    (25 of 37 here, the 3 whose input is the up-sampler's strided output through a contiguous copy; the 12 at the
    latents' own size stay Inductor's), and the decode matches eager."""
    cogvideox = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_cogvideox")
    torch.manual_seed(0)
    vae = perturb_params(cogvideox.AutoencoderKLCogVideoX(block_out_channels=(16, 32, 32, 64), norm_num_groups=4,
                                                          latent_channels=16)).eval()

    class Decode(nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, z):
            return self.vae.decode(z).sample

    out, ref, stats, graph = _rewritten(Decode(), rand_input((1, 16, 3, 8, 8), torch.float32, "cpu"))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert stats["modulate"] == 25 and stats["unmatched"] == 12, stats
    copies = [n for n in graph.nodes if n.op == "call_method" and n.target == "contiguous"
              and any(u.target is torch.ops.gnext.group_norm_act_modulate_cat.default for u in n.users)]
    assert len(copies) == 3, copies
    # each writes its causal convolution's input, behind 2 copies of its first frame (one batch of latent frames)
    assert stats["pad"] == 25, stats
    # 5 latent frames: two batches, the second's convolutions concatenating the first's cached frames
    out, ref, stats, graph = _rewritten(Decode(), rand_input((1, 16, 5, 8, 8), torch.float32, "cpu"))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    cats = [n for n in graph.nodes if n.target is torch.ops.gnext.group_norm_act_modulate_cat.default]
    assert stats["pad"] == stats["modulate"] == len(cats) == 50, stats
    assert sum(n.args[9] is None for n in cats) == 25


def test_padded_outputs():
    """GroupNorm -> activation (-> dropouts that return their input) -> F.pad, replicate or constant with sizes >= 0
    over spatial dims, of a contiguous 3-D or 5-D input, becomes one group_norm_act_pad (the causal convolutions of
    video VAEs); the other pads (4-D or channels_last inputs, a crop, the channel dim, after a dropout that drops)
    stay after group_norm_act. Same values as eager."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.n, self.c = nn.GroupNorm(4, 8), nn.Conv3d(8, 8, 3)

        def forward(self, x, y):
            a = self.c(F.pad(F.silu(self.n(x)), (1, 1, 1, 1, 2, 0), mode="replicate"))  # causal conv: padded
            b = F.pad(F.dropout(F.gelu(self.n(x)), 0.1, False), (2, 1), value=0.5)       # eval dropout: padded
            c = F.pad(F.silu(self.n(y)), (1, 1, 0, 3))                                   # 4-D: not padded
            d = F.pad(F.silu(self.n(y)), (-1, 1))                                        # a crop: not padded
            e = F.pad(F.silu(self.n(y)), (1, 1, 1, 1, 1, 1))                             # pads C: not padded
            f = F.pad(F.dropout(F.silu(self.n(y)), 0.5, True), (1, 1))                   # drops: not padded
            g = F.pad(F.silu(self.n(x.to(memory_format=torch.channels_last_3d))), (1, 1))  # NDHWC: not padded
            return a, b, c, d, e, f, g

    x, y = rand_input((1, 8, 4, 5, 6), torch.float32, "cpu"), rand_input((2, 8, 5, 7), torch.float32, "cpu")
    out, ref, stats, graph = _rewritten(perturb_params(M()), x, y)
    for o, r in zip(out[:5] + out[6:], ref[:5] + ref[6:]):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert out[5].shape == ref[5].shape
    assert stats["group_norm_act"] == 7 and stats["pad"] == 2, stats
    padded = [n for n in graph.nodes if n.target is torch.ops.gnext.group_norm_act_pad.default]
    assert [(n.args[6], n.args[7], n.args[8]) for n in padded] == \
        [([1, 1, 1, 1, 2, 0], "replicate", 0.0), ([2, 1], "constant", 0.5)]
    assert sum(n.target in compile_fusion._PADS for n in graph.nodes) == 5
    assert sum(n.target in compile_fusion._DROPOUTS for n in graph.nodes) == 1


def test_chains_left_alone(fusion):
    """No rewrite when the GroupNorm output or the activation output has another user, for an unknown
    activation, for a broadcasting add (only the activation is fused), and under autocast-like dtype
    changes."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.n = nn.GroupNorm(4, 16)

        def forward(self, x, b):
            y = self.n(x)
            a = F.silu(y) + y                          # y has two users: unfused
            s = torch.sigmoid(self.n(x))               # not an activation gnext has: unfused
            r = F.silu(self.n(x)) + b                  # broadcast residual: act fused, add kept
            return a + s + r

    m = perturb_params(M())
    x, b = rand_input((2, 16, 5, 5), torch.float32, "cpu"), torch.randn(16, 1, 1)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x, b), m(x, b), rtol=1e-4, atol=1e-4)
    assert fusion() == {"group_norm_act": 1, "residual": 0, "input_bias": 0, "left": 0, "no_autograd": 1, "pad": 0,
                        "unmatched": 2, "modulate": 0, "gather": 0, "zero_pad": 0}


def test_auto_rule():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # CUDA tensors without a GPU
        cuda = torch.empty(1, 128, 256, 256, dtype=torch.float16, device="cuda")
        small = torch.empty(2, 8, 4, 4, dtype=torch.float16, device="cuda")
        sd_unet = torch.empty(2, 320, 64, 64, dtype=torch.float16, device="cuda")  # below _MIN_NUMEL
        five_d = torch.empty(2, 64, 4, 32, 32, dtype=torch.float16, device="cuda")  # below _MIN_NUMEL
        video = torch.empty(1, 128, 17, 256, 256, dtype=torch.float16, device="cuda")
        train = torch.empty(1, 128, 256, 256, dtype=torch.float16, device="cuda", requires_grad=True) * 1
        w64 = torch.empty(64, dtype=torch.float64, device="cuda")
    cpu = torch.empty(2, 64, 32, 32, device="meta")
    rule = compile_fusion._fusable
    assert rule(cuda, cuda, (None, None), "auto")
    assert not rule(small, small, (None, None), "auto") and rule(small, small, (None, None), "always")
    assert not rule(sd_unet, sd_unet, (None, None), "auto") and rule(sd_unet, sd_unet, (None, None), "always")
    assert not rule(five_d, five_d, (None, None), "auto") and rule(five_d, five_d, (None, None), "always")
    assert rule(video, video, (None, None), "auto")
    assert not rule(cuda, train, (None, None), "auto") and rule(cuda, train, (None, None), "always")
    assert not rule(cpu, cpu, (None, None), "auto") and rule(cpu, cpu, (None, None), "always")
    assert not rule(cuda, cuda.float(), (None, None), "always")  # autocast: output in float32
    assert not rule(cuda, cuda, (w64, None), "always")
    with pytest.raises(ValueError, match="when must be 'auto' or 'always', got 'sometimes'"):
        ge.enable_compile_fusion(when="sometimes")


def test_chains_left_by_the_rule_are_counted_and_warned_once(caplog):
    """when='auto' on CPU tensors: the matched chains stay with Inductor, counted in compile_fusion_stats['left'],
    and the reason is logged as a warning once per process (Dynamo's graph run through the pass alone)."""
    import logging

    def backend(gm, example_inputs):
        compile_fusion._rewrite(gm.graph, "auto")
        gm.recompile()
        return gm.forward

    model = perturb_params(Block(C=16, G=4)).eval()
    compile_fusion._warned.discard("not a CUDA tensor (when='auto')")
    before = compile_fusion.compile_fusion_stats["left"]
    torch._dynamo.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="groupnorm_ext"), torch.no_grad():
            f = torch.compile(model, backend=backend, dynamic=False)
            for shape in ((2, 16, 8, 8), (1, 16, 6, 6)):  # two graphs
                x = rand_input(shape, torch.float32, "cpu")
                torch.testing.assert_close(f(x), model(x))
    finally:
        torch._dynamo.reset()
    assert compile_fusion.compile_fusion_stats["left"] - before == 4  # 2 chains per graph
    warned = [r.getMessage() for r in caplog.records if "left to Inductor" in r.getMessage()]
    assert len(warned) == 1 and "2 GroupNorm->activation chain(s)" in warned[0] and "not a CUDA tensor" in warned[0]


def test_graph_with_no_chain_is_counted_and_warned_once(caplog):
    """A graph whose GroupNorms start no chain the pass fuses (GroupNorm(x) * scale + shift -> SiLU with full-size
    scale and shift given; a sigmoid) rewrites nothing: each GroupNorm is counted in
    compile_fusion_stats['unmatched'] and each reason logged once per process as a warning. A graph that rewrites
    a chain warns about none of its other GroupNorms."""
    import logging

    class Modulated(nn.Module):
        def __init__(self, fused=False):
            super().__init__()
            self.n, self.fused = nn.GroupNorm(4, 16), fused

        def forward(self, x, scale, shift):
            y = F.silu(self.n(x) * scale + shift) + torch.sigmoid(self.n(x))
            return y + F.silu(self.n(x)) if self.fused else y

    x, scale, shift = (rand_input((2, 16, 5, 5), torch.float32, "cpu") for _ in range(3))
    reasons = ("GroupNorm followed by sigmoid, not an activation the op fuses (SiLU, GELU, ReLU, tanh, hardswish)",
               compile_fusion._FULL_SIZE_MODULATION)  # in the order of the sorted messages
    _warned_before = set(compile_fusion._warned)
    compile_fusion._warned.difference_update(reasons)
    try:
        for fused, rewrites, warnings in ((True, 1, 0), (False, 0, 2), (False, 0, 0)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="groupnorm_ext"):
                out, ref, stats, _ = _rewritten(perturb_params(Modulated(fused)).eval(), x, scale, shift)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            assert stats["group_norm_act"] == rewrites and stats["unmatched"] == 2
            warned = [r.getMessage() for r in caplog.records if "none was rewritten" in r.getMessage()]
            assert len(warned) == warnings, warned  # the third graph: reported already
            for w, why in zip(sorted(warned), reasons):
                assert "1 GroupNorm call(s)" in w and why in w
    finally:
        compile_fusion._warned.clear()
        compile_fusion._warned.update(_warned_before)


def test_enable_disable_keeps_a_previous_pass():
    from torch._inductor import config

    calls = []
    hooks = {False: "pre_grad_custom_pass", True: "post_grad_custom_post_pass"}
    prev = {post: getattr(config, hook) for post, hook in hooks.items()}
    try:
        for post, hook in hooks.items():
            setattr(config, hook, lambda g, post=post: calls.append(post))
        ge.enable_compile_fusion()
        ge.enable_compile_fusion()  # twice: still one gnext pass per hook
        passes = {post: getattr(config, hook) for post, hook in hooks.items()}
        for post, p in passes.items():
            cls = compile_fusion._pass_class(post)
            assert isinstance(p, cls) and not isinstance(p.previous, cls)
            assert p.uuid() is None  # the previous pass has no uuid: Inductor must bypass its cache
            p(torch.fx.Graph())
        assert calls == [False, True]
        ge.disable_compile_fusion()
        for post, hook in hooks.items():
            now = getattr(config, hook)
            assert now is not passes[post] and not isinstance(now, compile_fusion._pass_class(post))
            setattr(config, hook, None)
        ge.enable_compile_fusion()
        for hook in hooks.values():
            assert isinstance(getattr(config, hook).uuid(), bytes)  # alone: cacheable
        assert config.pre_grad_custom_pass.uuid() != config.post_grad_custom_post_pass.uuid()
    finally:
        ge.disable_compile_fusion()
        for post, hook in hooks.items():
            setattr(config, hook, prev[post])


def test_pass_pickles_with_its_uuid():
    """torch 2.11's FX-graph cache pickles the Inductor config, the pass included (an unpicklable pass
    there bypasses the cache: 'Failed to pickle cache key'). The pass round-trips, and its pickle
    changes with its uuid (the 'when' argument here), so cache keys do too."""
    import pickle

    for post_grad in (False, True):
        cls = compile_fusion._pass_class(post_grad)
        auto, always = cls("auto"), cls("always")
        back = pickle.loads(pickle.dumps(auto))
        assert isinstance(back, cls) and back.when == "auto" and back.previous is None
        assert back.uuid() == auto.uuid() != always.uuid()
        assert pickle.dumps(auto) != pickle.dumps(always)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_training_and_reduce_overhead(dtype, channels_last):
    """CUDA, half precision: a training graph rewritten (when='always') matches eager in outputs and
    gradients; when='auto' leaves training graphs alone and rewrites the inference graph, also under
    mode='reduce-overhead' (CUDA graphs)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = perturb_params(Block(C=64, G=32)).cuda().to(dtype).to(memory_format=fmt)
    x = rand_input((2, 64, 32, 32), dtype, "cuda", memory_format=fmt).requires_grad_()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # relative L2; elementwise: a few ulps of max|ref|
    stats = compile_fusion.compile_fusion_stats
    with torch._inductor.config.patch(fx_graph_cache=False), contextlib.ExitStack() as stack:
        try:
            for when, expected in (("auto", 0), ("always", 2)):
                torch._dynamo.reset()
                before = stats["group_norm_act"]
                ge.enable_compile_fusion(when=when)
                out = torch.compile(model, fullgraph=True)(x)
                g = torch.autograd.grad(out.float().square().sum(), [x, *model.parameters()])
                assert stats["group_norm_act"] - before == expected, when
                ref = model(x)
                ref_g = torch.autograd.grad(ref.float().square().sum(), [x, *model.parameters()])
                _close(out, ref, tol, 8 * torch.finfo(dtype).eps)
                for a, b in zip(g, ref_g):
                    _close(a, b, 3 * tol, 32 * torch.finfo(dtype).eps)
            torch._dynamo.reset()
            before = stats["group_norm_act"]
            ge.enable_compile_fusion()
            # the size threshold is test_auto_rule's; here 'auto' must fire on an inference graph
            stack.enter_context(mock.patch.object(compile_fusion, "_MIN_NUMEL", 1))
            ro = torch.compile(model.eval(), mode="reduce-overhead", fullgraph=True)
            with torch.no_grad():
                xi = x.detach()
                for _ in range(3):
                    y = ro(xi)
                _close(y, model(xi), tol, 8 * torch.finfo(dtype).eps)
            assert stats["group_norm_act"] - before == 2
        finally:
            ge.disable_compile_fusion()
            torch._dynamo.reset()
