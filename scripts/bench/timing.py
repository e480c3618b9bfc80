# SPDX-License-Identifier: BSD-3-Clause
"""Timing and input helpers shared by the benchmarks (scripts/bench/*) and the developer tools
(scripts/dev/*): CUDA-event timing with the L2 flushed, the copy-bandwidth floor, GroupNorm inputs,
writing a result table (JSON + markdown), running a call under gnext's environment knobs, and capturing
calls in a CUDA graph."""
from __future__ import annotations

import json
import pathlib
import statistics
import time

import torch


class Timer:
    """Median time of fn() in ms: CUDA events around each call with the L2 flushed before it,
    or perf_counter on the CPU."""

    def __init__(self, device):
        self.device = device
        self.flush = torch.empty(128 * 2**20, dtype=torch.uint8, device=device) if device == "cuda" else None

    def __call__(self, fn, min_reps=5, max_reps=100, budget_s=0.4):
        for _ in range(2):
            fn()
        if self.device != "cuda":
            times = []
            t_end = time.perf_counter() + budget_s
            while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < max_reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = time.perf_counter() - t0
        reps = int(min(max_reps, max(min_reps, budget_s / max(est, 1e-6))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth(device, timer):
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = (1 << 30) if device == "cuda" else (1 << 27)
    a = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a), min_reps=10)
    del a, b
    return 2 * n / (ms * 1e-3) / 1e9


def make_inputs(shape, dtype, fmt, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 3 + 2).to(dtype)
    if fmt is not None:
        x = x.contiguous(memory_format=fmt)
    C = shape[1]
    w = (torch.randn(C, generator=g, device=device) * 0.5 + 1).to(dtype)
    b = (torch.randn(C, generator=g, device=device) * 0.5).to(dtype)
    dy = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    if fmt is not None:
        dy = dy.contiguous(memory_format=fmt)
    return x, w, b, dy


def save_results(out_dir, name, meta, rows, md, quiet=False):
    """Writes <out_dir>/<name>.json ({"meta": meta, "rows": rows}) and <out_dir>/<name>.md, prints the
    markdown (unless quiet) and returns it."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(md)
    if not quiet:
        print()
        print(md)
    return md


def with_tuning(fn, **knobs):
    """fn run with gnext's planner knobs set (GNEXT_* names, groupnorm_ext.set_tuning over the current
    ones), restored afterwards."""
    def run(*a):
        import groupnorm_ext as ge

        previous = ge.tuning()
        ge.set_tuning({**previous, **{k: int(v) for k, v in knobs.items()}})
        try:
            return fn(*a)
        finally:
            ge.set_tuning(previous)
    return run


def cuda_graph(fn, n=1):
    """A CUDA graph of n back-to-back calls of fn (one warm-up call on a side stream first), for timing
    chains of calls without host time: returns the torch.cuda.CUDAGraph (replay() runs it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return g


def event_ms(fn, reps: int, across_ranks: bool = False) -> float:
    """Median CUDA-event time of fn in ms over reps calls. across_ranks: a barrier before each call and the
    slowest rank's median (all ranks of the default process group call it): a layer of a split model takes as
    long as its slowest rank."""
    import torch.distributed as dist

    ts = []
    for _ in range(reps):
        if across_ranks:
            dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    if not across_ranks:
        return statistics.median(ts)
    m = torch.tensor([statistics.median(ts)], device="cuda")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return float(m)
