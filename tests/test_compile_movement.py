# SPDX-License-Identifier: BSD-3-Clause
"""The compile pass's data-movement rules (groupnorm_ext/_compile_movement.py): an up-sampling padded for a
convolution becomes one index of its source, and pads of size 0 read by convolutions are dropped. Checked: the
rewritten graph gives bitwise the same tensors as eager, what must stay stays, the rule's `when`, gradients, and
diffusers' HunyuanVideo decoder under torch.compile with the pass."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from groupnorm_ext import _compile_movement, compile_fusion
from conftest import DEVICES, perturb_params, rand_input, run_graph_pass

_STATS = ("gather", "zero_pad")


def _moved(model, *args):
    """The model's outputs under torch.compile with a backend that runs only the movement rules (when='always',
    no Inductor), its eager outputs, the counts and the rewritten graph; under no_grad."""
    stats = dict.fromkeys(_STATS, 0)
    out, ref, graph = run_graph_pass(model, args,
                                     lambda graph: _compile_movement.rewrite_movement(graph, stats, lambda x, y: True))
    return out, ref, stats, graph


def _moves(fusion):
    """The movement rules' counts of the `fusion` fixture (conftest)."""
    counts = fusion()
    return {k: counts[k] for k in _STATS}


def _targets(graph):
    return [n.target for n in graph.nodes if n.op in ("call_function", "call_method")]


class Upsampler(nn.Module):
    """HunyuanVideo's up-sampler (diffusers HunyuanVideoUpsampleCausal3D), its causal convolution's replicate pad
    written out: the first frame up-sampled in height and width, the others in time too, concatenated, padded."""

    def __init__(self, C, factor=(2, 2, 2)):
        super().__init__()
        self.factor = factor
        self.conv = nn.Conv3d(C, C, 3)

    def forward(self, x):
        first, other = x.split((1, x.size(2) - 1), dim=2)
        first = F.interpolate(first.squeeze(2), scale_factor=self.factor[1:], mode="nearest").unsqueeze(2)
        other = F.interpolate(other.contiguous(), scale_factor=self.factor, mode="nearest")
        h = F.pad(torch.cat((first, other), dim=2), (1, 1, 1, 1, 2, 0), mode="replicate")
        return h, self.conv(h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor", [(2, 2, 2), (1, 2, 2), (2, 3, 1)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_upsampler_is_one_gather(device, factor, layout):
    """A contiguous source is indexed flat (one index vector: a one-dimensional kernel for Inductor), a strided one
    by one vector per dimension."""
    m = perturb_params(Upsampler(6, factor)).to(device)
    x = rand_input((2, 6, 4, 5, 7), torch.float32, device, memory_format=layout)
    out, ref, stats, graph = _moved(m, x)
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    assert stats == {"gather": 1, "zero_pad": 0}
    targets = _targets(graph)
    (gather,) = [n for n in graph.nodes if n.target is torch.ops.aten._unsafe_index.Tensor]
    assert len(gather.args[1]) == (1 if layout == torch.contiguous_format else 5)
    assert not any(t in (F.interpolate, torch.cat, F.pad, torch._C._nn.pad, "split") for t in targets), targets


@pytest.mark.parametrize("device", DEVICES)
def test_2d_and_sizes(device):
    """4-D tensors, factors given as sizes, a pad of a pad, odd sizes and a single row."""

    def f(x, y):
        a = F.pad(F.interpolate(x, size=(2 * x.shape[2], 3 * x.shape[3]), mode="nearest"), (2, 1, 0, 3),
                  mode="replicate")
        b = F.pad(F.pad(F.interpolate(y, scale_factor=2.0), (1, 0, 1, 0), mode="replicate"), (0, 2, 0, 2),
                  mode="replicate")
        return a, b

    x, y = rand_input((1, 3, 5, 7), torch.float32, device), rand_input((2, 4, 1, 9), torch.float16, device)
    out, ref, stats, graph = _moved(f, x, y)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
    assert stats == {"gather": 2, "zero_pad": 0}
    targets = _targets(graph)
    assert targets.count(torch.ops.aten._unsafe_index.Tensor) == 2
    assert not any(t in compile_fusion._PADS for t in targets), targets  # the pad of a pad is in its gather


def test_chains_left_alone():
    """No gather for: a constant pad, a non-integer or non-nearest up-sampling, an intermediate read elsewhere, a
    pad of no up-sampling, two sources, a permutation after the up-sampling, a split along channels."""

    def f(x, z):
        up = F.interpolate(x, scale_factor=2.0)
        return (
            F.pad(F.interpolate(x, scale_factor=2.0), (1, 1, 1, 1), value=0.5),                    # constant
            F.pad(F.interpolate(x, scale_factor=1.5), (1, 1, 1, 1), mode="replicate"),             # 1.5
            F.pad(F.interpolate(x, scale_factor=2.0, mode="bilinear"), (1, 1, 1, 1), mode="replicate"),
            F.pad(up, (1, 1, 1, 1), mode="replicate"), up,                                          # read twice
            F.pad(x, (1, 1, 1, 1), mode="replicate"),                                               # no up-sampling
            F.pad(F.interpolate(torch.cat((x, z), 2), scale_factor=2.0), (1, 1, 1, 1), mode="replicate"),
            F.pad(F.interpolate(x, scale_factor=2.0).transpose(2, 3), (1, 1, 1, 1), mode="replicate"),
            F.pad(F.interpolate(x.split(2, dim=1)[0], scale_factor=2.0), (1, 1, 1, 1), mode="replicate"),
        )

    x, z = rand_input((1, 4, 3, 5), torch.float32, "cpu"), rand_input((1, 4, 2, 5), torch.float32, "cpu")
    out, ref, stats, graph = _moved(f, x, z)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
    assert stats == {"gather": 0, "zero_pad": 0}


def test_zero_pads_read_by_convolutions_are_dropped():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c3, self.c2 = nn.Conv3d(4, 5, 1), nn.Conv2d(4, 5, 1)

        def forward(self, x, y):
            a = self.c3(F.pad(x, (0, 0, 0, 0, 0, 0), mode="replicate"))  # a 1x1x1 causal convolution: dropped
            b = self.c2(F.pad(y, (0, 0, 0, 0)))                            # constant, size 0: dropped
            p = F.pad(x, (0, 0, 0, 0, 0, 0), mode="replicate")
            return a, b, self.c3(p), p * 2                                  # also read by a mul: kept

    x, y = rand_input((1, 4, 3, 5, 6), torch.float32, "cpu"), rand_input((2, 4, 5, 6), torch.float32, "cpu")
    out, ref, stats, graph = _moved(perturb_params(M()), x, y)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
    assert stats == {"gather": 0, "zero_pad": 2}
    assert sum(t in compile_fusion._PADS for t in _targets(graph)) == 1


def test_when():
    """when='auto': inference graphs on CUDA; when='always': every graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cuda = torch.empty(1, 8, 4, 4, device="cuda")
        train = torch.empty(1, 8, 4, 4, device="cuda", requires_grad=True) * 1
    cpu = torch.empty(1, 8, 4, 4, device="meta")
    rule = compile_fusion._movement_applies
    assert rule(cuda, cuda, "auto") and rule(cuda, train, "always") and rule(cpu, cpu, "always")
    assert not rule(cuda, train, "auto") and not rule(cpu, cpu, "auto")


@pytest.mark.parametrize("device", DEVICES)
def test_training_gradients(device, fusion, no_tf32):
    """With when='always' a training graph is rewritten too: the gather's backward (index_put with accumulation)
    gives eager's gradients."""
    m = perturb_params(Upsampler(4)).to(device)
    x = rand_input((1, 4, 3, 4, 5), torch.float32, device).requires_grad_()
    ref = m(x)[1]
    ref_g = torch.autograd.grad(ref.square().sum(), [x, *m.parameters()])
    out = torch.compile(m, fullgraph=True)(x)[1]
    g = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
    assert _moves(fusion) == {"gather": 1, "zero_pad": 0}
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)


def test_dynamic_shapes_are_left(fusion):
    m = perturb_params(Upsampler(4))
    comp = torch.compile(m, dynamic=True)
    with torch.no_grad():
        for t in (3, 4):
            x = rand_input((1, 4, t, 4, 5), torch.float32, "cpu")
            assert torch.equal(comp(x)[0], m(x)[0])
    assert _moves(fusion) == {"gather": 0, "zero_pad": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_hunyuan_video_decoder(device, fusion, no_tf32):
    """diffusers' HunyuanVideo decoder (small widths) under torch.compile with the pass: its 3 up-samplers are
    gathers, its 2 shortcut convolutions' zero pads are dropped, and the decode matches eager."""
    hy = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video")
    torch.manual_seed(0)
    vae = perturb_params(hy.AutoencoderKLHunyuanVideo(block_out_channels=(16, 32, 64, 64), norm_num_groups=4))
    dec = vae.decoder.eval().to(device)
    z = rand_input((1, 16, 3, 8, 8), torch.float32, device)
    with torch.no_grad():
        ref = dec(z)
        out = torch.compile(dec)(z)
    assert _moves(fusion) == {"gather": 3, "zero_pad": 2}
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_large_outputs_are_left(monkeypatch):
    """Above _MAX_EVAL_NUMEL output elements per channel the chain is not run at compile time, and stays."""
    monkeypatch.setattr(_compile_movement, "_MAX_EVAL_NUMEL", 5 * 10 * 14 - 1)
    m = perturb_params(Upsampler(3, (1, 2, 2)))
    x = rand_input((1, 3, 3, 4, 6), torch.float32, "cpu")  # padded output 5 x 10 x 14
    out, ref, stats, graph = _moved(m, x)
    assert torch.equal(out[0], ref[0]) and stats == {"gather": 0, "zero_pad": 0}
    monkeypatch.setattr(_compile_movement, "_MAX_EVAL_NUMEL", 5 * 10 * 14)
    assert _moved(m, x)[2] == {"gather": 1, "zero_pad": 0}
