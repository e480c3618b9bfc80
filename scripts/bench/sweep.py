#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Randomized GroupNorm shape sweep: shapes from real models, each with a dtype and a layout drawn with a
fixed seed, timed for gnext vs eager F.group_norm vs torch.compile(F.group_norm), forward and
forward+backward, in one process; with --act also GroupNorm+SiLU forward (inference) against eager,
torch.compile and the Triton kernels of sglang and vllm-omni (scripts/bench/peers.py, where .peers/ holds
them). The worst gnext ratio is printed last.

    python scripts/bench sweep [--shard 0/2] [--no-compile] [--act] [--out bench_results]
    python scripts/bench sweep --smoke      (CPU, 3 small shapes: checks the script)

Timing: timing.Timer (CUDA events, L2 flushed before each call, median), every variant of a shape once per
round in a random order, median over --rounds rounds (default 5). Ratios are peer time / gnext
time (> 1: gnext faster), taken per round and their median reported: a round where the host stalls moves
every variant timed in it, and one such round in a few shifts a ratio of medians (host-bound rows).
Shapes (N, C, spatial..., G) come from: SD-1.5 and SDXL UNets at their latent
sizes (batch 2 for classifier-free guidance), the SD / SDXL VAE decoders, ResNet-50-GN at batch 32,
video UNets (5-D), audio/sequence models (3-D), a DiT-style wide C with 4x4 pixels, N from 1 to 64, and
odd C/G."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import random
import statistics
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import groupnorm_ext as ge  # noqa: E402
from timing import Timer, make_inputs, save_results  # noqa: E402

# (source, shape, G)
POOL = [
    ("SD1.5 UNet", (2, 320, 64, 64), 32), ("SD1.5 UNet", (2, 640, 32, 32), 32),
    ("SD1.5 UNet", (2, 1280, 16, 16), 32), ("SD1.5 UNet", (2, 1280, 8, 8), 32),
    ("SD1.5 UNet", (2, 960, 64, 64), 32), ("SD1.5 UNet", (2, 1920, 32, 32), 32),
    ("SDXL UNet", (2, 320, 128, 128), 32), ("SDXL UNet", (2, 640, 64, 64), 32),
    ("SDXL UNet", (2, 1280, 32, 32), 32), ("SDXL UNet", (2, 2560, 32, 32), 32),
    ("SD VAE dec", (1, 512, 64, 64), 32), ("SD VAE dec", (1, 512, 128, 128), 32),
    ("SD VAE dec", (1, 512, 256, 256), 32), ("SD VAE dec", (1, 256, 512, 512), 32),
    ("SD VAE dec", (1, 128, 512, 512), 32), ("SDXL VAE dec", (1, 128, 1024, 1024), 32),
    ("SDXL VAE dec", (1, 256, 1024, 1024), 32), ("VAE 2048² map", (1, 128, 2048, 2048), 32),
    ("ResNet-50-GN", (32, 64, 112, 112), 32), ("ResNet-50-GN", (32, 256, 56, 56), 32),
    ("ResNet-50-GN", (32, 512, 28, 28), 32), ("ResNet-50-GN", (32, 1024, 14, 14), 32),
    ("ResNet-50-GN", (32, 2048, 7, 7), 32), ("BiT batch 8", (8, 256, 56, 56), 32),
    ("video UNet 5-D", (1, 128, 16, 64, 64), 32), ("video UNet 5-D", (2, 320, 8, 32, 32), 32),
    ("video VAE 5-D", (1, 128, 20, 256, 256), 32), ("video 5-D small", (2, 64, 16, 64, 64), 8),
    ("audio 1-D", (8, 512, 4096), 32), ("audio 1-D", (16, 256, 16000), 16), ("seq 1-D", (4, 1024, 1024), 32),
    ("DiT wide C", (8, 2048, 4, 4), 32), ("wide C 4x4", (16, 4096, 4, 4), 64),
    ("N=64", (64, 64, 32, 32), 32), ("N=1 large G", (1, 512, 32, 32), 512), ("N=16 G=1", (16, 128, 32, 32), 1),
    ("odd C/G", (3, 96, 33, 33), 6), ("odd C/G", (1, 120, 17, 19), 5), ("odd C/G", (4, 100, 10, 10), 10),
    ("odd C/G", (2, 48, 7, 7), 3), ("odd C/G", (5, 60, 31, 29), 15), ("HxW=1", (64, 512, 1, 1), 32),
    ("UNet 1280 CL", (2, 1280, 16, 16), 32), ("SD UNet batch 8", (8, 320, 64, 64), 32),
]
SMOKE_POOL = [("smoke", (2, 32, 8, 8), 8), ("smoke", (1, 12, 5, 3), 3), ("smoke 5-D", (2, 16, 2, 4, 4), 4)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def draw(pool, seed=0):
    """Each pool shape with a dtype and a layout drawn with a fixed seed (channels_last only for 4-D/5-D;
    float32 only for tensors under 1 GiB)."""
    rnd = random.Random(seed)
    out = []
    for src, shape, G in pool:
        dtype = rnd.choice(DTYPES)
        if dtype == torch.float32 and math.prod(shape) * 4 > 2**30:
            dtype = torch.bfloat16
        fmt = None
        if len(shape) in (4, 5) and rnd.random() < 0.4:
            fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        if "CL" in src:
            fmt = torch.channels_last
        out.append((src, shape, G, dtype, fmt))
    return out


def name(src, shape, G, dtype, fmt):
    d = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return f"{src} {'x'.join(map(str, shape))} G={G} {d}{' CL' if fmt is not None else ''}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard", default="0/1", help="i/n: the i-th of n interleaved slices of the sweep")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per shape (random order each)")
    p.add_argument("--act", action="store_true", help="also GroupNorm+SiLU forward vs eager, compile and the peers")
    p.add_argument("--out", default=str(ROOT / "bench_out"))
    p.add_argument("--smoke", action="store_true", help="CPU, 3 small shapes")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="no run: one table from the JSON of shards")
    p.add_argument("--match", default="", help="only cases whose name contains this (e.g. 'ResNet'); tag 'sweep_match'")
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    dev = "cpu" if args.smoke else "cuda"
    i, n = (int(v) for v in args.shard.split("/"))
    cases = [c for c in draw(SMOKE_POOL if args.smoke else POOL)[i::n] if args.match in name(*c)]
    if not cases:
        raise SystemExit(f"sweep: no case matches {args.match!r} in shard {args.shard}")
    timer = Timer(dev)
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "shard": args.shard, "rounds": args.rounds,
            "timing": f"median over {args.rounds} interleaved rounds (random order) of the median of CUDA-event-timed "
                      "calls, L2 flushed before each"}
    rng = random.Random(0)
    tag = "sweep" + (f"_{i}of{n}" if n > 1 else "") + ("_match" if args.match else "") + ("_smoke" if args.smoke else "")
    peers = {}
    if args.act and not args.smoke:
        from peers import load

        peers = load()
    meta["peers"] = sorted(peers)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    rows = []
    for src, shape, G, dtype, fmt in (tqdm(cases) if tqdm else cases):
        x, w, b, dy = make_inputs(shape, dtype, fmt, dev)
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
        impls = {"gnext": ge.group_norm, "eager": F.group_norm}
        if not args.no_compile:
            torch._dynamo.reset()
            impls["compile"] = torch.compile(F.group_norm, dynamic=False)
        row = {"case": name(src, shape, G, dtype, fmt), "shape": list(shape), "G": G, "dtype": str(dtype)[6:],
               "layout": "channels_last" if fmt is not None else "contiguous", "MB": x.numel() * x.element_size() / 1e6}
        fns = {}  # key -> (fn, no_grad)
        for k, fn in impls.items():
            fns[f"{k} fwd"] = (lambda fn=fn: fn(x, G, w, b, 1e-5), True)
            fns[f"{k} f+b"] = (lambda fn=fn: torch.autograd.grad(fn(xg, G, wg, bg, 1e-5), (xg, wg, bg), dy), False)
        if args.act:
            acts = {"gnext act": lambda: ge.group_norm_act(x, G, w, b, 1e-5, "silu"),
                    "eager act": lambda: F.silu(F.group_norm(x, G, w, b, 1e-5))}
            if not args.no_compile:
                cgs = torch.compile(lambda t: F.silu(F.group_norm(t, G, w, b, 1e-5)), dynamic=False)
                acts["compile act"] = lambda: cgs(x)
            for pname, pfn in peers.items():
                acts[f"{pname} act"] = (lambda f=pfn: f(x, w, b, G, 1e-5))
            fns.update({f"{k} fwd": (fn, True) for k, fn in acts.items()})
        row.update(time_interleaved(timer, fns, args.rounds, rng, tolerant={f"{p} act fwd" for p in peers}))
        rows.append(row)
        fns.clear()  # frees the inputs the closures hold before the next shape allocates its own
        report(rows, meta, args.act, args.out, tag, quiet=True)  # after every shape: a time limit loses one
    report(rows, meta, args.act, args.out, tag)


def time_interleaved(timer, fns, rounds, rng, tolerant=()):
    """{key: median ms} of every fn, and {'<key> rounds': [ms per round]}, timed in `rounds` rounds that each time
    every fn once (timer's median of CUDA-event-timed calls) in a fresh random order, so that a slow phase of the
    shared host hits all variants alike. A `tolerant` fn that raises (a peer rejecting the input) gets None and
    '<key> error'; any other error propagates."""
    times, out = {k: [] for k in fns}, {}
    for _ in range(rounds):
        for k in rng.sample(sorted(fns), len(fns)):
            if f"{k} error" in out:
                continue
            fn, no_grad = fns[k]
            try:
                with torch.set_grad_enabled(not no_grad):
                    times[k].append(timer(fn, budget_s=0.4 / rounds))
            except Exception as e:  # noqa: BLE001  (a peer's rejection is recorded, not fatal)
                if k not in tolerant:
                    raise
                out[f"{k} error"] = f"{type(e).__name__}: {str(e)[:120]}"
    for k, v in times.items():
        ok = v and f"{k} error" not in out
        out[k] = statistics.median(v) if ok else None
        if ok:
            out[f"{k} rounds"] = v
    return out


def ratio(row, other, mine):
    """other's time over mine: the median of the per-round ratios where the row has both rounds' times (the
    rounds interleave the variants), else (results of an older sweep) the ratio of the medians."""
    a, b = row.get(f"{other} rounds"), row.get(f"{mine} rounds")
    if a and b and len(a) == len(b):
        return statistics.median(x / y for x, y in zip(a, b))
    return row[other] / row[mine]


def report(rows, meta, act, out, tag, quiet=False):
    """Ratios (peer time / gnext time), the markdown table with its worst-case summary, <out>/<tag>.json,
    .md and (where matplotlib is installed) .png."""
    cols = [c for c in ("eager", "compile") if f"{c} fwd" in rows[0]]
    for r in rows:
        for c in cols:
            r[f"x {c} fwd"] = ratio(r, f"{c} fwd", "gnext fwd")
            r[f"x {c} f+b"] = ratio(r, f"{c} f+b", "gnext f+b")
        if act:  # the peers' GN+SiLU times: keys '<peer> act fwd', not gnext's and not a ratio
            peers = [k for k, v in r.items() if k.endswith(" act fwd") and not k.startswith(("gnext", "x ")) and v]
            r["x best act fwd"] = min(ratio(r, k, "gnext act fwd") for k in peers)
    head = "| case | MB | gnext fwd | " + " | ".join(f"x {c} fwd" for c in cols) + " | gnext f+b | " + \
        " | ".join(f"x {c} f+b" for c in cols) + (" | GN+SiLU gnext fwd | x best peer |" if act else " |")
    lines = [f"{meta['device']} · torch {meta['torch']} · {meta['date']} · shard {meta['shard']} · {meta['timing']}",
             "", head, "|---|" + "---:|" * (head.count("|") - 2)]
    for r in rows:
        cells = [r["case"], f"{r['MB']:.1f}", f"{r['gnext fwd']:.3f}"] + [f"{r[f'x {c} fwd']:.2f}" for c in cols] + \
                [f"{r['gnext f+b']:.3f}"] + [f"{r[f'x {c} f+b']:.2f}" for c in cols]
        if act:
            cells += [f"{r['gnext act fwd']:.3f}", f"{r['x best act fwd']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    summary = []
    for c in cols:
        for kind in ("fwd", "f+b"):
            vals = [r[f"x {c} {kind}"] for r in rows]
            worst = min(rows, key=lambda r: r[f"x {c} {kind}"])
            gm = math.exp(sum(math.log(v) for v in vals) / len(vals))
            losses = sum(v < 1.0 for v in vals)
            summary.append(f"vs {c} {kind}: geomean {gm:.2f}x, {losses} of {len(vals)} shapes slower, "
                           f"worst {worst[f'x {c} {kind}']:.2f}x ({worst['case']})")
    if act:
        worst = min(rows, key=lambda r: r["x best act fwd"])
        losses = sum(r["x best act fwd"] < 1.0 for r in rows)
        summary.append(f"GN+SiLU fwd vs the best of eager/compile/peers: {losses} of {len(rows)} shapes slower, "
                       f"worst {worst['x best act fwd']:.2f}x ({worst['case']})")
    lines += ["", "Ratios: other time / gnext time (> 1: gnext faster), the median of the per-round ratios; times in "
              "ms, medians over rounds."] + [f"- {s}" for s in summary]
    save_results(out, tag, meta, rows, "\n".join(lines) + "\n", quiet=quiet)
    if not quiet:  # the plot once, with the final table (not after every shape)
        plot(rows, cols, act, meta, pathlib.Path(out) / f"{tag}.png")


def plot(rows, cols, act, meta, path):
    """Horizontal bars per shape: gnext's speed-up over the faster of eager and torch.compile, forward and
    forward+backward, and GN+SiLU forward over the best peer; log scale, 1.0 marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    series = {"GN fwd vs best of " + "/".join(cols): [min(r[f"x {c} fwd"] for c in cols) for r in rows],
              "GN f+b vs best of " + "/".join(cols): [min(r[f"x {c} f+b"] for c in cols) for r in rows]}
    if act:
        series["GN+SiLU fwd vs best peer"] = [r["x best act fwd"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.24 * len(rows) * len(series) / 2 + 1.5))
    h = 0.8 / len(series)
    for j, (label, vals) in enumerate(series.items()):
        ax.barh([k + (j - (len(series) - 1) / 2) * h for k in range(len(rows))], vals, h, label=label)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [r["case"] for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of gnext (other time / gnext time)")
    ax.set_title(f"{meta['device']}, torch {meta['torch']}, {meta['date']}", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(files, out, tag="sweep"):
    """One table from the JSON of several shards (rows in the sweep's order); report() recomputes the
    ratios from the times."""
    data = [json.loads(pathlib.Path(f).read_text()) for f in files]
    order = {name(*c): k for k, c in enumerate(draw(POOL))}
    rows = sorted((r for d in data for r in d["rows"]), key=lambda r: order.get(r["case"], len(order)))
    meta = dict(data[0]["meta"], shard=" + ".join(d["meta"]["shard"] for d in data),
                date=" / ".join(d["meta"]["date"] for d in data))
    report(rows, meta, any("gnext act fwd" in r for r in rows), out, tag)


if __name__ == "__main__":
    main()
