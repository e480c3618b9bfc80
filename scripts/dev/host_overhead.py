# SPDX-License-Identifier: BSD-3-Clause
"""Host (CPU) time per call of gnext's GroupNorm and GroupNorm+SiLU next to PyTorch's F.group_norm and
F.silu(F.group_norm(...)), forward without grad and forward+backward, in one process.
  python scripts/dev/host_overhead.py [--json out.json]
Two measurements per row:
  * tiny shape (2x32x8x8 fp32, G=8), where the GPU work is negligible: wall time of 300 calls / 300 with
    the GPU synchronized before and after (host-bound, so this is the host path);
  * the issue's shape (2x320x64x64 fp16, G=32): host time to enqueue 30 calls / 30 (the GPU runs behind
    and is synchronized only after the clock stops), so GPU time does not hide or inflate it.
Each is the median of 9 rounds, the variants interleaved within each round. Then PyTorch's own calls with
ATen's CUDA kernels and with gnext's behind them (enable_aten_kernels), the two alternating round by round."""
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


def host_us(fns, n, sync_inside, rounds=9):
    """Median host us per call of each callable in fns, timed in interleaved rounds (each round runs every
    callable n times, in a rotating order), so a slow moment of the shared host hits all of them."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fns[k]()
            if sync_inside:
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t) / n * 1e6)
            torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in times.items()}


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


def host_us_aten(fns, n, sync_inside, rounds=9):
    """Host us per call of each callable with ATen's kernels and with gnext's behind aten::native_group_norm
    (groupnorm_ext.enable_aten_kernels), the two settings alternating round by round (switched outside the
    clock); median over rounds per setting."""
    res = {"aten": {k: [] for k in fns}, "gnext": {k: [] for k in fns}}
    for r in range(2 * rounds):
        setting = ("aten", "gnext")[r % 2]
        with ge.aten_kernels(setting == "gnext"):
            for k, t in host_us(fns, n, sync_inside, rounds=1).items():
                res[setting][k].append(t)
    return {s: {k: statistics.median(v) for k, v in d.items()} for s, d in res.items()}


def op_calls(shape, dtype, G):
    """(gnext, aten) callables per layer: the forward op through its Autograd kernel in no-grad mode, its twin of
    no Autograd kernel (gnext::group_norm_no_autograd, what compiled graphs and the eager entry call; ATen's op in
    no-grad mode beside it), the forward op below autograd, and the backward op below autograd."""
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3 + 1
    w, b = torch.randn(shape[1], device="cuda", dtype=dtype), torch.randn(shape[1], device="cuda", dtype=dtype)
    N, C, HxW = shape[0], shape[1], x[0, 0].numel()
    dy = torch.randn_like(x)
    g, a = torch.ops.gnext, torch.ops.aten
    _, mean, rstd = g.group_norm.default(x, G, w, b, 1e-5)
    _, amean, arstd = a.native_group_norm.default(x, w, b, N, C, HxW, G, 1e-5)
    below = torch._C._AutoDispatchBelowAutograd

    def under(f):
        def run():
            with below():
                f()
        return run

    fwd = (lambda: g.group_norm.default(x, G, w, b, 1e-5),
           lambda: a.native_group_norm.default(x, w, b, N, C, HxW, G, 1e-5))
    bwd = (lambda: g.group_norm_backward.default(dy, x, mean, rstd, w, G, [True, True, True]),
           lambda: a.native_group_norm_backward.default(dy, x, amean, arstd, w, N, C, HxW, G, [True, True, True]))

    def no_grad(f):
        def run():
            with torch.no_grad():
                f()
        return run

    twin = lambda: g.group_norm_no_autograd.default(x, G, w, b, 1e-5)  # noqa: E731
    return {"forward op, Autograd key, no grad": tuple(no_grad(f) for f in fwd),
            "forward op's twin, no Autograd kernel": (twin, no_grad(fwd[1])),
            "forward op below autograd": tuple(under(f) for f in fwd),
            "backward op below autograd": tuple(under(f) for f in bwd),
            "empty context (below autograd, no op)": (under(lambda: None), under(lambda: None))}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's CPU-time table of 20 forward+backward calls of each, 2x320x64x64")
    p.add_argument("--ops", action="store_true",
                   help="also time the ops themselves (torch.ops.gnext.* vs aten.native_group_norm*), with and "
                        "without the Autograd dispatch key, to split the host time between layers")
    args = p.parse_args()
    res = {}
    for label, shape, dtype, G, n, sync_inside in (("2x32x8x8 fp32 G=8 (wall/call)", (2, 32, 8, 8), torch.float32, 8,
                                                    300, True),
                                                   ("2x320x64x64 fp16 G=32 (enqueue/call)", (2, 320, 64, 64),
                                                    torch.float16, 32, 30, False)):
        fwd, fb = cases(shape, dtype, G)
        rows = {}
        with torch.no_grad():
            rows.update({f"forward, no grad | {k}": v for k, v in host_us(fwd, n, sync_inside).items()})
        rows.update({f"forward+backward | {k}": v for k, v in host_us(fb, n, sync_inside).items()})
        res[label] = rows
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
          "(host us per call, median of 9 interleaved rounds)")
    for label, rows in res.items():
        print(label)
        keys = list(rows)
        for i in range(0, len(keys), 2):  # gnext row, then its PyTorch counterpart
            a, b = rows[keys[i]], rows[keys[i + 1]]
            print(f"  {keys[i]:52s} {a:8.1f}   vs {keys[i + 1].split('| ')[1]:28s} {b:8.1f}   ratio {a / b:5.2f}")
    print("PyTorch's own calls (F.group_norm, F.silu(F.group_norm)) with ATen's kernels vs with gnext's behind "
          "aten::native_group_norm (enable_aten_kernels), host us per call, median of 9 rounds each, alternating")
    for label, shape, dtype, G, n, sync_inside in (("2x32x8x8 fp32 G=8 (wall/call)", (2, 32, 8, 8), torch.float32, 8,
                                                    300, True),
                                                   ("2x320x64x64 fp16 G=32 (enqueue/call)", (2, 320, 64, 64),
                                                    torch.float16, 32, 30, False),
                                                   ("8x256x32x32 bf16 G=32 (enqueue/call)", (8, 256, 32, 32),
                                                    torch.bfloat16, 32, 30, False)):
        fwd, fb = cases(shape, dtype, G)
        torch_calls = lambda d: {k: v for k, v in d.items() if "F." in k}  # noqa: E731
        with torch.no_grad():
            t_fwd = host_us_aten(torch_calls(fwd), n, sync_inside)
        t_fb = host_us_aten(torch_calls(fb), n, sync_inside)
        print(label)
        rows = {}
        for what, t in (("forward, no grad", t_fwd), ("forward+backward", t_fb)):
            for k in t["aten"]:
                a, g = t["aten"][k], t["gnext"][k]
                rows[f"{what} | {k}"] = {"aten kernels": a, "gnext kernels (enable_aten_kernels)": g}
                print(f"  {what:17s} {k.split(': ')[1]:22s} ATen kernels {a:8.1f}   gnext kernels {g:8.1f}"
                      f"   ratio {g / a:5.2f}")
        res[f"{label} | enable_aten_kernels"] = rows
    if args.ops:
        print("op calls, host us per call (2x32x8x8 fp32 G=8, wall with the GPU synchronized; "
              "median of 9 interleaved rounds)")
        for label, (a, b) in op_calls((2, 32, 8, 8), torch.float32, 8).items():
            t = host_us({"gnext": a, "aten": b}, 300, True)
            ta, tb = t["gnext"], t["aten"]
            print(f"  {label:44s} gnext {ta:7.1f}   aten {tb:7.1f}   ratio {ta / tb:5.2f}")
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
