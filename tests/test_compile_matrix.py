# SPDX-License-Identifier: BSD-3-Clause
"""torch integration of every gnext op in one model: torch.compile(fullgraph=True) forward and
backward in the default mode and in mode="reduce-overhead" (CUDA graphs), torch.export round trip
(export, save, load, run), and dynamic shapes (dynamic=True) compiled once for several shapes."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import groupnorm_ext as ge
from conftest import DEVICES, rand_input


class AllOps(nn.Module):
    """ConvTranspose2d+GELU+GroupNorm -> GroupNorm -> GroupNorm+SiLU+residual -> GroupNorm+act+logsumexp."""

    def __init__(self, C=8, G=4):
        super().__init__()
        self.up = ge.ConvTranspose2dGELUGroupNorm(C, C, 3, G)
        self.gn = ge.GroupNorm(G, C)
        self.gn_act = ge.GroupNormAct(G, C, activation="silu")
        self.lse_norm = nn.GroupNorm(G, C)
        self.lse_bias = nn.Parameter(torch.randn(C) * 0.1)
        self.G = G

    def forward(self, x):
        a = self.up(x)
        b = self.gn(a)
        c = self.gn_act(b, a)
        n = self.lse_norm
        return ge.group_norm_act_logsumexp(c, self.G, n.weight, n.bias, n.eps, "tanh_hardswish", True,
                                           self.lse_bias)


def _grads(model, x):
    out = model(x)
    leaves = [x] + list(model.parameters())
    return [out] + list(torch.autograd.grad((out * out).sum(), leaves))


def _model_and_input(device, seed=0, shape=(2, 8, 6, 6)):
    torch.manual_seed(seed)
    model = AllOps().to(device)
    x = rand_input(shape, torch.float32, device, scale=1.0, offset=0.5).requires_grad_()
    return model, x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_every_op(device, mode, no_tf32):
    if mode == "reduce-overhead" and device == "cpu":
        pytest.skip("CUDA graphs")
    torch._dynamo.reset()
    model, x = _model_and_input(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend, mode=None if mode == "default" else mode)
    want = _grads(model, x)
    for _ in range(3):  # reduce-overhead: warm-up, record, replay
        got = _grads(compiled, x)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_export_round_trip(device, no_tf32):
    model, x = _model_and_input(device, seed=1)
    x = x.detach()
    ep = torch.export.export(model, (x,))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"gnext.conv_transpose2d_gelu_group_norm.default", "gnext.group_norm.default",
            "gnext.group_norm_act.default", "gnext.group_norm_act_logsumexp.default"} <= names, names
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    x2 = rand_input(tuple(x.shape), torch.float32, device, scale=1.0, offset=0.5)
    torch.testing.assert_close(loaded.module()(x2), model(x2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_shapes_compile_once(device, no_tf32):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model, _ = _model_and_input(device, seed=2)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    # N >= 2 and H != W: sizes 0/1 and equal sizes are specialized by design (duck sizing), not by gnext
    for shape in [(2, 8, 6, 7), (3, 8, 5, 9), (4, 8, 9, 4)]:
        x = rand_input(shape, torch.float32, device, scale=1.0, offset=0.5).requires_grad_()
        for a, e in zip(_grads(compiled, x), _grads(model, x)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
