#!/usr/bin/env python3
"""Forward+backward per-call time on small and mid shapes, interleaved, with the host floor.

Times (bench.py's Timer: CUDA events, L2 flushed, median) of forward+backward for gnext (one-pass
and GNEXT_ONEPASS=0), eager F.group_norm and, as the harness floor, an autograd step of the
cheapest differentiable op (`x * 2`: one forward and one backward elementwise kernel through the
same torch.autograd.grad call). Each implementation is timed in `--rounds` interleaved rounds so
the spread between rounds is visible. Also prints the per-kernel device times of one gnext
forward+backward (torch.profiler). Diagnostic; the product table comes from bench.py."""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__) + "/../bench")
sys.path.insert(0, os.path.dirname(__file__) + "/../..")
import groupnorm_ext as ge  # noqa: E402
from timing import Timer, make_inputs  # noqa: E402

SHAPES = [
    ("ResNet 32x256x56x56 bf16", (32, 256, 56, 56), 32, torch.bfloat16),
    ("SD 2x320x64x64 fp16", (2, 320, 64, 64), 32, torch.float16),
    ("seq 8x512x4096 fp16", (8, 512, 4096), 32, torch.float16),
]
# The GroupNorm layers of real_models.py's UNet2DModel training row (batch 8, 64x64, bf16).
UNET_SHAPES = [(f"UNet2D 8x{c}x{s}x{s} bf16", (8, c, s, s), 32, torch.bfloat16)
               for c, s in ((128, 64), (256, 32), (256, 16), (512, 8))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--unet", action="store_true", help="the UNet2DModel training shapes instead")
    args = p.parse_args()
    timer = Timer("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, shape, G, dtype in UNET_SHAPES if args.unet else SHAPES:
        x, w, b, dy = make_inputs(shape, dtype, None, "cuda")
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))

        def step(fn):
            def run():
                y = fn(xg)
                torch.autograd.grad(y, (xg, wg, bg) if fn is not times2 else (xg,), dy)
            return run

        def times2(t):
            return t * 2

        impls = {
            "gnext": lambda t: ge.group_norm(t, G, wg, bg, 1e-5),
            "gnext_2pass": lambda t: ge.group_norm(t, G, wg, bg, 1e-5),
            "eager": lambda t: F.group_norm(t, G, wg, bg, 1e-5),
            "x*2 (floor)": times2,
        }
        res = {k: [] for k in impls}
        for _ in range(args.rounds):
            for k, fn in impls.items():
                if k == "gnext_2pass":
                    os.environ["GNEXT_ONEPASS"] = "0"
                res[k].append(timer(step(fn)))
                os.environ.pop("GNEXT_ONEPASS", None)
        print(f"== {name}: f+b ms, median of rounds [min..max]")
        for k, v in res.items():
            print(f"   {k:12s} {statistics.median(v):.3f} [{min(v):.3f}..{max(v):.3f}]")
        run = step(impls["gnext"])
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                print(f"   {ev.device_time_total / ev.count:8.1f} us x{ev.count:<3d} {ev.key[:90]}")


if __name__ == "__main__":
    main()
