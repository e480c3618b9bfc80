"""Host (CPU) time per call of gnext's GroupNorm and GroupNorm+SiLU next to PyTorch's F.group_norm and
F.silu(F.group_norm(...)), forward without grad and forward+backward, in one process.
  python scripts/dev/host_overhead.py [--json out.json]
Two measurements per row:
  * tiny shape (2x32x8x8 fp32, G=8), where the GPU work is negligible: wall time of 300 calls / 300 with
    the GPU synchronized before and after (host-bound, so this is the host path);
  * the issue's shape (2x320x64x64 fp16, G=32): host time to enqueue 30 calls / 30 (the GPU runs behind
    and is synchronized only after the clock stops), so GPU time does not hide or inflate it.
Each is the median of 7 rounds."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import groupnorm_ext as ge  # noqa: E402


def host_us(fn, n, sync_inside, rounds=7):
    for _ in range(10):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if sync_inside:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def cases(shape, dtype, G):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3 + 1
    w = torch.randn(shape[1], device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(shape[1], device="cuda", dtype=dtype, requires_grad=True)
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    fwd = {"group_norm: gnext": lambda: ge.group_norm(x, G, w, b),
           "group_norm: F.group_norm": lambda: F.group_norm(x, G, w, b),
           "GN+SiLU: gnext group_norm_act": lambda: ge.group_norm_act(x, G, w, b, activation="silu"),
           "GN+SiLU: F.silu(F.group_norm)": lambda: F.silu(F.group_norm(x, G, w, b))}
    fb = {"group_norm: gnext": lambda: ge.group_norm(xg, G, w, b).backward(g),
          "group_norm: F.group_norm": lambda: F.group_norm(xg, G, w, b).backward(g),
          "GN+SiLU: gnext group_norm_act": lambda: ge.group_norm_act(xg, G, w, b, activation="silu").backward(g),
          "GN+SiLU: F.silu(F.group_norm)": lambda: F.silu(F.group_norm(xg, G, w, b)).backward(g)}
    return fwd, fb


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's CPU-time table of 20 forward+backward calls of each, 2x320x64x64")
    args = p.parse_args()
    res = {}
    for label, shape, dtype, G, n, sync_inside in (("2x32x8x8 fp32 G=8 (wall/call)", (2, 32, 8, 8), torch.float32, 8,
                                                    300, True),
                                                   ("2x320x64x64 fp16 G=32 (enqueue/call)", (2, 320, 64, 64),
                                                    torch.float16, 32, 30, False)):
        fwd, fb = cases(shape, dtype, G)
        rows = {}
        with torch.no_grad():
            for k, fn in fwd.items():
                rows[f"forward, no grad | {k}"] = host_us(fn, n, sync_inside)
        for k, fn in fb.items():
            rows[f"forward+backward | {k}"] = host_us(fn, n, sync_inside)
        res[label] = rows
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} (host us per call, median of 7 rounds)")
    for label, rows in res.items():
        print(label)
        keys = list(rows)
        for i in range(0, len(keys), 2):  # gnext row, then its PyTorch counterpart
            a, b = rows[keys[i]], rows[keys[i + 1]]
            print(f"  {keys[i]:52s} {a:8.1f}   vs {keys[i + 1].split('| ')[1]:28s} {b:8.1f}   ratio {a / b:5.2f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        _, fb = cases((2, 320, 64, 64), torch.float16, 32)
        for k in ("group_norm: gnext", "group_norm: F.group_norm"):
            for _ in range(5):
                fb[k]()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    fb[k]()
                torch.cuda.synchronize()
            print(f"--- profile, forward+backward x20: {k}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "us_per_call": res}, indent=1))


if __name__ == "__main__":
    main()
