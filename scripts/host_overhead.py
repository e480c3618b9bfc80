"""Host (CPU) time per call of gnext's ops at a tiny shape, where the GPU work is negligible, next to
PyTorch's own GroupNorm: the launch overhead that decides small-tensor (host-bound) timings.
  python scripts/host_overhead.py [--json out.json]
Times are the median over 5 rounds of (wall time of 500 calls) / 500, the GPU synchronized before
and after each round, so they include the host path and any wait on the GPU."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import groupnorm_ext as ge  # noqa: E402


def per_call_us(fn, n=500, rounds=5):
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    x = torch.randn(2, 32, 8, 8, device="cuda")
    w = torch.randn(32, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    rows = {}
    with torch.no_grad():
        rows["forward, no grad: gnext"] = per_call_us(lambda: ge.group_norm(x, 8, w, b))
        rows["forward, no grad: F.group_norm"] = per_call_us(lambda: F.group_norm(x, 8, w, b))
        rows["forward, no grad: raw op"] = per_call_us(lambda: torch.ops.gnext.group_norm(x, 8, w, b, 1e-5))
    rows["forward+backward: gnext"] = per_call_us(lambda: ge.group_norm(xg, 8, w, b).backward(g))
    rows["forward+backward: F.group_norm"] = per_call_us(lambda: F.group_norm(xg, 8, w, b).backward(g))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} shape 2x32x8x8 fp32 G=8 (us per call)")
    for k, v in rows.items():
        print(f"  {k:34s} {v:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "us_per_call": rows}, indent=1))


if __name__ == "__main__":
    main()
