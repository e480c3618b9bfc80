# SPDX-License-Identifier: BSD-3-Clause
"""Bad input gets a clear error naming the problem (CPU always, CUDA when present)."""
from __future__ import annotations

import pytest
import torch

import groupnorm_ext as ge
from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda d: (torch.randn(2, 6, 3, device=d), 4, None, None), r"C=6 must be divisible by num_groups=4"),
        (lambda d: (torch.randn(2, 6, 3, device=d), 0, None, None), r"num_groups must be positive, got num_groups=0"),
        (lambda d: (torch.randn(2, 6, 3, device=d), -2, None, None), r"num_groups must be positive"),
        (lambda d: (torch.randn(2, 6, 3, device=d), 3, torch.ones(5, device=d), None), r"weight must have shape \(C,\) = \(6\), got weight.shape=\[5\]"),
        (lambda d: (torch.randn(2, 6, 3, device=d), 3, None, torch.ones(2, 3, device=d)), r"bias must have shape \(C,\) = \(6\)"),
        (lambda d: (torch.randint(0, 5, (2, 6, 3), device=d), 3, None, None), r"input dtype must be float32, float16 or bfloat16, got Long"),
        (lambda d: (torch.ones(2, 6, 3, dtype=torch.bool, device=d), 3, None, None), r"got Bool"),
        (lambda d: (torch.randn(2, 6, 3, dtype=torch.float64, device=d), 3, None, None), r"got Double"),
        (lambda d: (torch.randn(2, 6, 3, dtype=torch.complex64, device=d), 3, None, None), r"got ComplexFloat"),
        (lambda d: (torch.randn(6, device=d), 3, None, None), r"at least 2 dims, got input.dim\(\)=1"),
        (lambda d: (torch.randn(2, 6, 3, dtype=torch.float16, device=d), 3, torch.ones(6, dtype=torch.bfloat16, device=d), None), r"weight dtype must match input \(Half\) or be float32, got BFloat16"),
        (lambda d: (torch.randn(2, 6, 3, device=d), 3, torch.ones(6, device=d), torch.ones(6, dtype=torch.float16, device=d)), r"bias dtype must match input"),
    ],
    ids=["C%G", "G=0", "G<0", "weight-shape", "bias-shape", "int", "bool", "double", "complex", "dim1", "weight-dtype", "bias-dtype"],
)
def test_forward_errors(device, make, pattern):
    x, g, w, b = make(device)
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.gnext.group_norm(x, g, w, b, 1e-5)


@pytest.mark.gpu
def test_mixed_devices():
    x = torch.randn(2, 6, 3, device="cuda")
    with pytest.raises(RuntimeError, match=r"weight is on cpu but input is on cuda"):
        torch.ops.gnext.group_norm(x, 3, torch.ones(6), None, 1e-5)
    with pytest.raises(RuntimeError, match=r"bias is on cpu but input is on cuda"):
        ge.group_norm(x, 3, torch.ones(6, device="cuda"), torch.ones(6))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_errors(device):
    x = torch.randn(2, 6, 3, device=device)
    out, mean, rstd = torch.ops.gnext.group_norm(x, 3, None, None, 1e-5)
    bw = torch.ops.gnext.group_norm_backward
    with pytest.raises(RuntimeError, match=r"grad_out.shape=\[2, 6, 4\] must equal input.shape=\[2, 6, 3\]"):
        bw(torch.randn(2, 6, 4, device=device), x, mean, rstd, None, 3, [True, True, True])
    with pytest.raises(RuntimeError, match=r"mean must have N\*G=6 elements"):
        bw(out, x, mean[:1], rstd, None, 3, [True, False, False])
    with pytest.raises(RuntimeError, match=r"rstd must be float32, got Half"):
        bw(out, x, mean, rstd.half(), None, 3, [True, False, False])
    with pytest.raises(RuntimeError, match=r"grad_out dtype \(Half\) must equal input dtype \(Float\)"):
        bw(out.half(), x, mean, rstd, None, 3, [True, False, False])
