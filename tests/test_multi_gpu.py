# SPDX-License-Identifier: BSD-3-Clause
"""Device and stream handling: ops on cuda:1 while cuda:0 is current (needs 2 GPUs), ops on a
side stream, and no host synchronization inside any op (torch.cuda.set_sync_debug_mode("error")).
The DistributedDataParallel check is scripts/dev/ddp_check.py (torchrun, 2 GPUs)."""
from __future__ import annotations

import pytest
import torch

import groupnorm_ext as ge
from conftest import HAS_CUDA, rand_input

two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _all_ops(x, wc, gw, gb, res):
    """Every gnext op forward and backward; returns outputs and gradients."""
    leaves = [t.detach().requires_grad_() for t in (x, wc, gw, gb, res)]
    x_, wc_, gw_, gb_, res_ = leaves
    y1 = ge.group_norm(x_, 4, gw_, gb_)
    y2 = ge.group_norm_act(x_, 4, gw_, gb_, 1e-5, "silu", res_)
    y3 = ge.conv_transpose2d_gelu_group_norm(x_, wc_, None, 4, gw_, gb_, stride=2, padding=1, output_padding=1)
    y4 = ge.group_norm_act_logsumexp(x_, 4, gw_, gb_, 1e-5, "tanh_hardswish", True, input_bias=gb_)
    loss = (y1 * y1).sum() + (y2 * y1).sum() + (y3 * y3).sum() + (y4 * y4).sum()
    grads = torch.autograd.grad(loss, leaves)
    return [y1, y2, y3, y4, *grads]


def _inputs(device, gen):
    x = rand_input((2, 16, 12, 10), torch.float32, device, gen=gen)
    wc = (torch.randn(16, 16, 3, 3, generator=gen) * 0.1).to(device)
    gw = (torch.randn(16, generator=gen) * 0.5 + 1).to(device)
    gb = torch.randn(16, generator=gen).to(device)
    res = rand_input((2, 16, 12, 10), torch.float32, device, gen=gen)
    return x, wc, gw, gb, res


@two_gpus
def test_ops_on_second_gpu_while_first_is_current():
    torch.backends.cudnn.deterministic = True
    try:
        ref = _all_ops(*_inputs("cuda:0", torch.Generator().manual_seed(0)))
        with torch.cuda.device(0):
            out = _all_ops(*_inputs("cuda:1", torch.Generator().manual_seed(0)))
    finally:
        torch.backends.cudnn.deterministic = False
    for a, b in zip(out, ref):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-5)


@two_gpus
def test_side_stream_on_second_gpu():
    inputs = _inputs("cuda:1", torch.Generator().manual_seed(1))
    ref = _all_ops(*inputs)
    torch.cuda.synchronize(1)
    s = torch.cuda.Stream(device="cuda:1")
    s.wait_stream(torch.cuda.current_stream("cuda:1"))
    with torch.cuda.device(0), torch.cuda.stream(s):
        out = _all_ops(*inputs)
    s.synchronize()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_no_host_sync_inside_ops():
    inputs = _inputs("cuda", torch.Generator().manual_seed(2))
    _all_ops(*inputs)  # warm-up: cuDNN handles, kernel attributes
    big = rand_input((1, 32, 96, 96), torch.float16, "cuda")  # (a host-to-device copy syncs: made before)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = inputs[0]
        ge.group_norm(x, 4)
        ge.group_norm_act(x, 4, None, None, 1e-5, "gelu", None)
        ge.group_norm(big, 8)  # one-pass, groups split over CTAs (counters memset)
        ge.group_norm(x.contiguous(memory_format=torch.channels_last), 4)
        leaves = [t.detach().requires_grad_() for t in (x, inputs[2], inputs[3])]
        y = ge.group_norm_act(leaves[0], 4, leaves[1], leaves[2], 1e-5, "silu", None)
        torch.autograd.grad(y, leaves, torch.ones_like(y))
        _all_ops(*inputs)  # every op forward and backward, the fused conv op included
    finally:
        torch.cuda.set_sync_debug_mode("default")


@two_gpus
def test_inputs_on_different_gpus_raise():
    x = torch.randn(2, 8, 4, 4, device="cuda:0")
    w1 = torch.ones(8, device="cuda:1")
    with pytest.raises(RuntimeError, match=r"weight is on cuda:1 but input is on cuda:0"):
        ge.group_norm(x, 4, w1)
    with pytest.raises(RuntimeError, match=r"bias is on cuda:1 but input is on cuda:0"):
        ge.group_norm_act(x, 4, None, w1, 1e-5, "silu")
    with pytest.raises(RuntimeError, match=r"residual is on cuda:1 but input is on cuda:0"):
        ge.group_norm_act(x, 4, None, None, 1e-5, "silu", x.to("cuda:1"))
    with pytest.raises(RuntimeError, match=r"input_bias is on cuda:1 but input is on cuda:0"):
        ge.group_norm_act_logsumexp(x, 4, input_bias=w1)
    with pytest.raises(RuntimeError, match=r"weight is on cuda:1 but input is on cuda:0"):
        ge.conv_transpose2d_gelu_group_norm(x, torch.randn(8, 8, 3, 3, device="cuda:1"), None, 4)
    _, mean, rstd = torch.ops.gnext.group_norm(x, 4, None, None, 1e-5)
    with pytest.raises(RuntimeError, match=r"grad_out is on cuda:1 but input is on cuda:0"):
        torch.ops.gnext.group_norm_backward(x.to("cuda:1"), x, mean, rstd, None, 4, [True, False, False])
