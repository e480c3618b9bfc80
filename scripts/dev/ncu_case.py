#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Run one gnext GroupNorm op a few times for Nsight Compute (scripts/dev/ncu_gaps.sh).
    python scripts/dev/ncu_case.py N,C,H,W G dtype {nchw,cl} {fwd,bwd,convfwd} [--two-pass] [--act silu]
--act: group_norm_act's forward with that activation instead of group_norm's (fwd only).
convfwd: the fused ConvTranspose2d(C -> C, 3x3)+GELU+GroupNorm forward on an input of that shape (L2#19's
op; its GroupNorm runs on the (N, C, H+2, W+2) conv output)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__) + "/../..")
import groupnorm_ext  # noqa: E402,F401

shape = tuple(int(s) for s in sys.argv[1].split(","))
G, dtype, fmt, direction = int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4], sys.argv[5]
if "--two-pass" in sys.argv:
    groupnorm_ext.set_tuning({"GNEXT_ONEPASS": 0})
x = (torch.randn(shape, device="cuda") * 3 + 2).to(dtype)
if fmt == "cl":
    x = x.contiguous(memory_format=torch.channels_last)
w = torch.randn(shape[1], device="cuda", dtype=dtype)
dy = torch.randn_like(x)
out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
cw = torch.randn(shape[1], shape[1], 3, 3, device="cuda", dtype=dtype) * 0.05
for _ in range(2):
    if direction == "convfwd":
        torch.ops.gnext.conv_transpose2d_gelu_group_norm(x, cw, w, [1, 1], [0, 0], [0, 0], [1, 1], 1, G, w, w,
                                                         1e-5, "none")
    elif direction == "fwd" and "--act" in sys.argv:
        torch.ops.gnext.group_norm_act(x, G, w, w, 1e-5, sys.argv[sys.argv.index("--act") + 1], None)
    elif direction == "fwd":
        torch.ops.gnext.group_norm(x, G, w, w, 1e-5)
    else:
        torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])
torch.cuda.synchronize()
