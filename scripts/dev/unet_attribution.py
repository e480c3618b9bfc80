"""Issue 16: where does the converted UNet2DModel bf16 training step lose to eager? Variants that each
remove one suspected cause, timed in the same process in rounds of random order (wall time per step,
host + GPU), reported as per-round ratios to eager:

  eager        the original model
  gnext        convert_group_norm_act(model) (what real_models.py times)
  gnext_nchw   the same, with each gnext norm's input made NCHW-contiguous first: diffusers' attention
               block returns a channels_last-strided tensor (a reshape of a transpose); eager's CUDA
               GroupNorm turns it back to NCHW, gnext keeps it channels_last, so the convolutions after
               it run channels_last with NCHW weights (weight copies, gradient copies)
  gnext_plain  convert_group_norm(model): GroupNorm only, no activation fusion, no block forward
  eager_nogc / gnext_nogc   Python's garbage collector off during the step (autograd.Function
               contexts are GC-tracked Python objects; ATen's nodes are not)

    python scripts/dev/unet_attribution.py [--rounds 15] [--row unet2d-train-bf16]
Diagnostic; the product table comes from scripts/bench/real_models.py.
"""
from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
import groupnorm_ext as ge  # noqa: E402
from real_models import _cast, build, step_fn, wall_ms  # noqa: E402


def nchw_inputs(model):
    """Every gnext norm module of model makes its input contiguous (NCHW) before normalizing."""
    for m in model.modules():
        if isinstance(m, (ge.GroupNorm, ge.GroupNormAct)):
            cls_forward = type(m).forward
            m.forward = types.MethodType(lambda self, x, *a, _f=cls_forward: _f(self, x.contiguous(), *a), m)
    return model


def no_gc(fn):
    def run():
        gc.disable()
        try:
            return fn()
        finally:
            gc.enable()
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--row", default="unet2d-train-bf16")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, row {args.row}")
    model32, inputs32, dtype, fmt, train = build(args.row, "cuda", False)
    inputs = _cast(inputs32, dtype, fmt)
    orig = copy.deepcopy(model32).to(dtype).to(memory_format=fmt)
    conv = ge.convert_group_norm_act(copy.deepcopy(orig))
    fns = {"eager": step_fn(orig, inputs, train),
           "gnext": step_fn(conv, inputs, train),
           "gnext_nchw": step_fn(nchw_inputs(ge.convert_group_norm_act(copy.deepcopy(orig))), inputs, train),
           "gnext_plain": step_fn(ge.convert_group_norm(copy.deepcopy(orig)), inputs, train)}
    fns["eager_nogc"], fns["gnext_nogc"] = no_gc(fns["eager"]), no_gc(fns["gnext"])
    for f in fns.values():
        for _ in range(3):
            f()
    sync = torch.cuda.synchronize
    n = max(1, int(300 / max(wall_ms(fns["eager"], sync, 1), 1e-3)))
    rng = random.Random(0)
    times = {v: [] for v in fns}
    for r in range(args.rounds):
        order = list(fns)
        rng.shuffle(order)
        for v in order:
            times[v].append(wall_ms(fns[v], sync, n))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    print(f"{'variant':12s} {'ms/step':>8s} {'[min..max]':>16s}   eager/variant per round: median [min..max] wins")
    for v, t in times.items():
        ratios = [e / x for e, x in zip(times["eager"], t)]
        print(f"{v:12s} {statistics.median(t):8.2f} [{min(t):6.2f}..{max(t):6.2f}]   "
              f"{statistics.median(ratios):.3f} [{min(ratios):.2f}..{max(ratios):.2f}] "
              f"{sum(x > 1 for x in ratios)}/{len(ratios)}")
    base = times["gnext"]
    for v in ("gnext_nchw", "gnext_plain", "gnext_nogc"):
        ratios = [g / x for g, x in zip(base, times[v])]
        print(f"gnext/{v}: {statistics.median(ratios):.3f} [{min(ratios):.2f}..{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
