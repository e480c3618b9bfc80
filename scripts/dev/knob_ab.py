#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Same-process A/B of one of gnext's GNEXT_* environment knobs on op time: per shape, the forward op
(gnext.group_norm, and gnext.group_norm_act with --act, default SiLU, unless --no-act) and the backward op
(gnext.group_norm_backward / group_norm_act_backward, all three gradients) timed with CUDA events, the L2
flushed before each call (scripts/bench/timing.Timer), every knob value once per round, rounds in a fresh
random order, median and min-max over rounds. --graph N times N back-to-back calls replayed from one CUDA
graph instead (GPU time per call in a chain of ops, launch boundaries included, no host time). Diagnostic
for a kernel or launch change behind a knob; speed claims come from scripts/bench.
    python scripts/dev/knob_ab.py --env GNEXT_PDL=0,1 --shape 1,128,1024,1024:32:float16:cl [--rounds 7] [--graph 50]
--col compares settings of several knobs instead, one column each (NAME=V, joined by '+'):
    python scripts/dev/knob_ab.py --col GNEXT_ONEPASS=0 --col GNEXT_ONEPASS=2+GNEXT_ONEPASS_NBUF=4 --shape ...
--conv: the fused ConvTranspose2d(C -> C, 3x3)+GELU+GroupNorm (L2#19's op) on an input of each shape instead,
forward and backward (inputs without requires_grad: no autograd graph is kept).
--pad 1,1,1,1,2,0: group_norm_act_pad's forward (replicate padding, F.pad's order) instead, beside the unpadded
group_norm_act forward and a copy of the padded output's size (the same under every knob: the reference rows).
--peers: with the SiLU forward, the Triton GN+SiLU kernels of sglang and vllm-omni (scripts/bench/peers.py, loaded
from .peers/) as reference rows in the same rounds.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "scripts" / "dev"))
sys.path.insert(0, str(ROOT))
from profile_kernels import parse_shape  # noqa: E402
from timing import Timer, cuda_graph, make_inputs, with_tuning  # noqa: E402

import groupnorm_ext  # noqa: E402,F401

ops = torch.ops.gnext


def conv_cases(shape, G, dtype, fmt):
    """(name, fn) of the fused ConvTranspose2d+GELU+GroupNorm op, forward and backward, for one input shape."""
    x, w, b, _ = make_inputs(shape, dtype, fmt, "cuda")
    C = shape[1]
    cw = torch.randn(C, C, 3, 3, device="cuda", dtype=dtype) * 0.05
    conv = ([1, 1], [0, 0], [0, 0], [1, 1], 1)
    fwd = lambda: ops.conv_transpose2d_gelu_group_norm(x, cw, b, *conv, G, w, b, 1e-5, "none")  # noqa: E731
    y, z, mean, rstd, _ = fwd()
    dy = torch.randn_like(y)
    return [("conv fwd", fwd),
            ("conv bwd", lambda: ops.conv_transpose2d_gelu_group_norm_backward(dy, x, cw, b, z, mean, rstd, w, *conv,
                                                                               G, "none", [True] * 5))]


def cases(shape, G, dtype, fmt, act, peers=None):
    """(name, fn) of the ops timed for one shape (act: the group_norm_act activation, or None; peers: name ->
    GN+SiLU function, timed after gnext's SiLU forward, under no_grad: with grad on they fall back to eager)."""
    x, w, b, dy = make_inputs(shape, dtype, fmt, "cuda")
    y, mean, rstd = ops.group_norm(x, G, w, b, 1e-5)
    out = [("gn fwd", lambda: ops.group_norm(x, G, w, b, 1e-5)),
           ("gn bwd", lambda: ops.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True]))]
    if act:
        ya, mean_a, rstd_a = ops.group_norm_act(x, G, w, b, 1e-5, act, None)
        out += [(f"{act} fwd", lambda: ops.group_norm_act(x, G, w, b, 1e-5, act, None)),
                (f"{act} bwd", lambda: ops.group_norm_act_backward(dy, x, mean_a, rstd_a, w, b, G, act,
                                                                 [True, True, True]))]
        if act == "silu":
            for name, fn in (peers or {}).items():
                out.insert(len(out) - 1, (f"{name} fwd", torch.no_grad()(lambda fn=fn: fn(x, w, b, G, 1e-5))))
    return out


def pad_cases(shape, G, dtype, fmt, act, pad):
    """(name, fn) of the padded forward for one shape, then the unpadded forward and a copy of the padded size."""
    x, w, b, _ = make_inputs(shape, dtype, fmt, "cuda")
    fwd = lambda: ops.group_norm_act_pad(x, G, w, b, 1e-5, act, pad, "replicate", 0.0, None)  # noqa: E731
    y = fwd()[0]
    src = torch.empty_like(y)
    return [("pad fwd", fwd),
            (f"{act} fwd", lambda: ops.group_norm_act(x, G, w, b, 1e-5, act, None)),
            ("copy fwd", lambda: y.copy_(src))]


def chain(fn, n, knobs):
    """A function returning the µs per call of n calls of fn captured in one CUDA graph (with the knobs set at
    capture), median of 20 replays."""
    graph = with_tuning(lambda: cuda_graph(fn, n), **knobs)()

    def run():
        graph.replay()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
        for a, b in events:
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(a.elapsed_time(b) for a, b in events) / n
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", metavar="NAME=V1,V2", help="the knob and its values")
    ap.add_argument("--col", action="append", metavar="NAME=V[+NAME=V...]",
                    help="a column of knob settings (repeat; instead of --env)")
    ap.add_argument("--shape", action="append", required=True, metavar="N,C,H[,W[,D]]:G:DTYPE[:cl]")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-act", action="store_true", help="GroupNorm only")
    ap.add_argument("--act", default="silu", help="activation of the group_norm_act rows")
    ap.add_argument("--conv", action="store_true", help="the fused ConvTranspose2d+GELU+GroupNorm op instead")
    ap.add_argument("--pad", metavar="P0,P1,...", help="group_norm_act_pad's forward with this replicate padding instead")
    ap.add_argument("--fwd", action="store_true", help="forward ops only")
    ap.add_argument("--bwd", action="store_true", help="backward ops only")
    ap.add_argument("--peers", action="store_true", help="sglang's and vllm-omni's GN+SiLU beside the SiLU forward")
    ap.add_argument("--graph", type=int, default=0, metavar="N",
                    help="time N back-to-back calls captured in one CUDA graph (per call; no L2 flush: the GPU "
                         "time of a chain of ops, as in a compiled model) instead of single calls")
    args = ap.parse_args()
    if (args.env is None) == (args.col is None):
        ap.error("give --env or --col")
    if args.env:
        knob, _, vals = args.env.partition("=")
        values = vals.split(",")
        settings = {v: {knob: v} for v in values}
    else:
        values = [f"c{i}" for i in range(len(args.col))]
        settings = {v: dict(kv.split("=", 1) for kv in c.split("+")) for v, c in zip(values, args.col)}
        knob = "; ".join(f"{v} = {c}" for v, c in zip(values, args.col))
    timer = Timer("cuda")
    rng = random.Random(0)
    peers = {}
    if args.peers:
        from peers import load
        peers = load()
    how = f"{args.graph} calls in a CUDA graph, per call" if args.graph else "CUDA events, L2 flushed"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us per op call ({how}), "
          f"median [min-max] of {args.rounds} rounds; columns: {knob}")
    print(f"{'shape':34s} {'op':9s} " + " ".join(f"{v:>22s}" for v in values) + "  last/first")
    for spec in args.shape:
        shape, G, dtype, fmt = parse_shape(spec)
        if args.pad:
            todo = pad_cases(shape, G, dtype, fmt, args.act, [int(p) for p in args.pad.split(",")])
        elif args.conv:
            todo = conv_cases(shape, G, dtype, fmt)
        else:
            todo = cases(shape, G, dtype, fmt, None if args.no_act else args.act, peers)
        for name, fn in todo:
            if (args.fwd and not name.endswith("fwd")) or (args.bwd and not name.endswith("bwd")):
                continue
            times = {v: [] for v in values}
            runs = {v: (chain(fn, args.graph, settings[v]) if args.graph
                        else with_tuning(lambda: 1e3 * timer(fn, min_reps=10, max_reps=50, budget_s=0.1), **settings[v]))
                    for v in values}
            for _ in range(args.rounds):
                order = values[:]
                rng.shuffle(order)
                for v in order:
                    times[v].append(runs[v]())
            cells = [f"{statistics.median(t):8.1f} [{min(t):6.1f}-{max(t):6.1f}]" for t in times.values()]
            ratio = statistics.median(times[values[-1]]) / statistics.median(times[values[0]])
            print(f"{spec:34s} {name:9s} " + " ".join(f"{c:>22s}" for c in cells) + f"  {ratio:9.3f}", flush=True)


if __name__ == "__main__":
    main()
