#!/usr/bin/env python3
"""Where a real model's eager step spends its time, original vs converted (gnext), in one process.

For one row of scripts/bench/real_models.py (default: the UNet2DModel bf16 training step):
  * wall time per step, the two variants interleaved over --rounds rounds (median [min..max]);
  * host time per step: the time until the step's Python call returns, the GPU synchronized only
    before (the GPU runs behind, so this is what the host spends enqueuing);
  * a torch.profiler trace of --steps steps per variant: the summed self-CPU time of every op and
    autograd node, the GPU kernel time, and the ops/nodes whose self-CPU time differs most between
    the variants (GroupNorm-related rows always shown).
  python scripts/dev/profile_model.py [--row unet2d-train-bf16] [--rounds 7] [--steps 3]
Diagnostic; the product table comes from scripts/bench/real_models.py."""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
import groupnorm_ext as ge  # noqa: E402
from real_models import _cast, build, step_fn, wall_ms  # noqa: E402


def host_ms(fn):
    """Time until one call returns, the GPU synchronized before it only (then drained)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return dt


def profile(fn, steps):
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    cpu, count, gpu = defaultdict(float), defaultdict(int), defaultdict(float)
    for ev in prof.key_averages():
        cpu[ev.key] += ev.self_cpu_time_total / steps
        count[ev.key] += ev.count // steps
        gpu[ev.key] += ev.self_device_time_total / steps
    return cpu, count, gpu


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--row", default="unet2d-train-bf16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, row {args.row}")
    model32, inputs32, dtype, fmt, train = build(args.row, "cuda", False)
    inputs = _cast(inputs32, dtype, fmt)
    orig = copy.deepcopy(model32).to(dtype).to(memory_format=fmt)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(orig), return_counts=True)
    print(f"converted: {counts}")
    fns = {"eager": step_fn(orig, inputs, train), "gnext": step_fn(conv, inputs, train)}
    for f in fns.values():
        for _ in range(3):
            f()
    sync = torch.cuda.synchronize
    n = max(1, int(300 / max(wall_ms(fns["eager"], sync, 1), 1e-3)))
    wall, host = defaultdict(list), defaultdict(list)
    for r in range(args.rounds):
        for v in (("eager", "gnext") if r % 2 == 0 else ("gnext", "eager")):
            wall[v].append(wall_ms(fns[v], sync, n))
            host[v].append(host_ms(fns[v]))
    for v in fns:
        print(f"{v:6s} wall {statistics.median(wall[v]):7.2f} ms [{min(wall[v]):.2f}..{max(wall[v]):.2f}]  "
              f"host (enqueue) {statistics.median(host[v]):7.2f} ms [{min(host[v]):.2f}..{max(host[v]):.2f}]")
    prof = {v: profile(f, args.steps) for v, f in fns.items()}
    for v, (cpu, count, gpu) in prof.items():
        print(f"{v:6s} per step: self-CPU sum {sum(cpu.values()) / 1e3:7.2f} ms over {sum(count.values())} "
              f"events; GPU time {sum(gpu.values()) / 1e3:7.2f} ms")
    (ce, ne, ge_), (cg, ng, gg) = prof["eager"], prof["gnext"]
    keys = set(ce) | set(cg)
    gn_like = [k for k in keys if any(s in k.lower() for s in ("group_norm", "groupnorm", "gnext", "silu"))]
    diff = sorted(keys, key=lambda k: -abs(cg.get(k, 0) - ce.get(k, 0)))[:args.top]
    print(f"\n{'op / autograd node':70s} {'eager us':>9s} {'n':>5s} {'gnext us':>9s} {'n':>5s} "
          f"{'GPU eager':>9s} {'GPU gnext':>9s}")
    for k in diff + sorted(set(gn_like) - set(diff)):
        print(f"{k[:70]:70s} {ce.get(k, 0):9.0f} {ne.get(k, 0):5d} {cg.get(k, 0):9.0f} {ng.get(k, 0):5d} "
              f"{ge_.get(k, 0):9.0f} {gg.get(k, 0):9.0f}")


if __name__ == "__main__":
    main()
