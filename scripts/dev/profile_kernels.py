#!/usr/bin/env python3
"""Per-kernel CUDA times of gnext's GroupNorm forward and backward (torch.profiler), and the
host time of one op call, for a few shapes. Diagnostic tool; speed claims come from bench.py."""
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__) + "/../..")
import groupnorm_ext  # noqa: E402,F401

SHAPES = [
    ((112, 64, 512, 512), 8, torch.float32, None),
    ((1, 128, 1024, 1024), 32, torch.float16, None),
    ((1, 128, 1024, 1024), 32, torch.float16, torch.channels_last),
    ((16, 512, 128, 128), 32, torch.bfloat16, torch.channels_last),
    ((2, 320, 64, 64), 32, torch.float16, None),
]


def main():
    for shape, G, dtype, fmt in SHAPES:
        x = (torch.randn(shape, device="cuda", dtype=dtype) * 3 + 2)
        if fmt is not None:
            x = x.contiguous(memory_format=fmt)
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        op, bw = torch.ops.gnext.group_norm, torch.ops.gnext.group_norm_backward
        out, mean, rstd = op(x, G, w, w, 1e-5)
        for _ in range(3):
            bw(dy, x, mean, rstd, w, G, [True, True, True])
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                op(x, G, w, w, 1e-5)
                bw(dy, x, mean, rstd, w, G, [True, True, True])
            torch.cuda.synchronize()
        print(f"== {shape} {dtype} {'CL' if fmt else 'NCHW'} ({x.numel() * x.element_size() / 1e6:.0f} MB)")
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                print(f"   {ev.device_time_total / ev.count:9.1f} us  x{ev.count:<3d} {ev.key[:110]}")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            op(x, G, w, w, 1e-5)
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        print(f"   host time per forward call (async, incl. queueing): {host:.1f} us")


if __name__ == "__main__":
    main()
