#!/usr/bin/env python3
"""Run one gnext GroupNorm op a few times for Nsight Compute (scripts/dev/ncu_gaps.sh).
    python scripts/dev/ncu_case.py N,C,H,W G dtype {nchw,cl} {fwd,bwd} [--two-pass]"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__) + "/../..")
import groupnorm_ext  # noqa: E402,F401

shape = tuple(int(s) for s in sys.argv[1].split(","))
G, dtype, fmt, direction = int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4], sys.argv[5]
if "--two-pass" in sys.argv:
    os.environ["GNEXT_ONEPASS"] = "0"
x = (torch.randn(shape, device="cuda") * 3 + 2).to(dtype)
if fmt == "cl":
    x = x.contiguous(memory_format=torch.channels_last)
w = torch.randn(shape[1], device="cuda", dtype=dtype)
dy = torch.randn_like(x)
out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
for _ in range(2):
    if direction == "fwd":
        torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
    else:
        torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])
torch.cuda.synchronize()
