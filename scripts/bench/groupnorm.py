#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""gnext GroupNorm benchmark: gnext vs eager F.group_norm vs torch.compile, against the
copy-bandwidth floor.

For each suite shape it checks gnext against a float64 reference (forward, dx, dweight, dbias),
then times forward and forward+backward (CUDA events around each call, L2 flushed before each,
warm-up, median) of every implementation, all in this one process. The floor is the bytes that
must move (forward: read x + write y; forward+backward: that plus read x, dy + write dx) over the
device-to-device copy bandwidth measured here. Writes <out>/bench_<tag>.json, .md and a plot of
fraction-of-floor per shape. Without a GPU it runs a small CPU suite (no torch.compile).

    python scripts/bench groupnorm [--suite small] [--cpu]   (or bash scripts/run.sh bench)
"""
from __future__ import annotations

import argparse
import datetime
import math
import pathlib
import platform
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import groupnorm_ext as ge  # noqa: E402
from timing import Timer, copy_bandwidth, make_inputs, save_results  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None

CL, CL3 = torch.channels_last, torch.channels_last_3d
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

# name: (shape, G, dtype, memory_format)
SUITES = {
    "default": [
        ("L1#35 112x64x512x512 fp32", (112, 64, 512, 512), 8, f32, None),
        ("L2#19 GN 128x64x258x258 fp32", (128, 64, 258, 258), 8, f32, None),
        ("VAE 1x128x1024x1024 fp16", (1, 128, 1024, 1024), 32, f16, None),
        ("VAE 1x128x1024x1024 fp16 CL", (1, 128, 1024, 1024), 32, f16, CL),
        ("UNet 16x512x128x128 bf16 CL", (16, 512, 128, 128), 32, bf16, CL),
        ("ResNet 32x256x56x56 bf16", (32, 256, 56, 56), 32, bf16, None),
        ("video 2x64x16x64x64 bf16 5D", (2, 64, 16, 64, 64), 8, bf16, None),
        ("seq 8x512x4096 fp16 3D", (8, 512, 4096), 32, f16, None),
        ("SD 2x320x64x64 fp16", (2, 320, 64, 64), 32, f16, None),
    ],
    "small": [
        ("SD 2x320x64x64 fp16", (2, 320, 64, 64), 32, f16, None),
        ("UNet 4x512x64x64 bf16 CL", (4, 512, 64, 64), 32, bf16, CL),
    ],
    "cpu": [
        ("8x64x64x64 fp32", (8, 64, 64, 64), 8, f32, None),
        ("8x64x64x64 fp32 CL", (8, 64, 64, 64), 8, f32, CL),
        ("4x128x32x32 bf16", (4, 128, 32, 32), 32, bf16, None),
    ],
}


def fmt_name(fmt):
    return {None: "contiguous", CL: "channels_last", CL3: "channels_last_3d"}[fmt]


def check_correctness(x, G, w, b, dy, eps=1e-5):
    """Relative errors ||gnext - ref|| / ||ref|| of out, dx, dw, db vs float64 F.group_norm,
    computed in batch slices to bound memory."""
    xg = x.detach().requires_grad_()
    wg, bg = w.detach().requires_grad_(), b.detach().requires_grad_()
    out = ge.group_norm(xg, G, wg, bg, eps)
    dx, dw, db = torch.autograd.grad(out, (xg, wg, bg), dy)
    sq = {k: [0.0, 0.0] for k in ("out", "dx")}
    dw_ref = torch.zeros(w.shape, dtype=torch.float64, device=x.device)
    db_ref = torch.zeros_like(dw_ref)
    step = max(1, int(2**28 // max(1, x[0].numel())))
    for s in range(0, x.shape[0], step):
        xs = x[s:s + step].double().requires_grad_()
        wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
        ref = F.group_norm(xs, G, wd, bd, eps)
        rdx, rdw, rdb = torch.autograd.grad(ref, (xs, wd, bd), dy[s:s + step].double())
        for k, mine, r in (("out", out[s:s + step], ref), ("dx", dx[s:s + step], rdx)):
            sq[k][0] += (mine.double() - r).pow(2).sum().item()
            sq[k][1] += r.pow(2).sum().item()
        dw_ref += rdw
        db_ref += rdb
        del xs, ref, rdx
    errs = {k: math.sqrt(a / max(bb, 1e-300)) for k, (a, bb) in sq.items()}
    errs["dw"] = ((dw.double() - dw_ref).norm() / dw_ref.norm()).item()
    errs["db"] = ((db.double() - db_ref).norm() / db_ref.norm()).item()
    errs["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(dx).all())
    return errs


def run(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    suite = SUITES["cpu" if device == "cpu" and args.suite == "default" else args.suite]
    timer = Timer(device)
    bw = copy_bandwidth(device, timer)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    meta = {
        "device": dev_name,
        "kind": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gnext": ge.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth_GBps": bw,
        "timing": "median of CUDA-event-timed calls, L2 flushed before each" if device == "cuda" else "median perf_counter",
    }
    print(f"# {dev_name}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s (read+write)", flush=True)
    impls = {
        "gnext": lambda x, G, w, b: ge.group_norm(x, G, w, b, 1e-5),
        "eager": lambda x, G, w, b: F.group_norm(x, G, w, b, 1e-5),
    }
    use_compile = device == "cuda" and not args.no_compile
    if use_compile:
        impls["compile"] = None  # made per shape below
    if device == "cuda":  # gnext's two-pass kernels (the one-pass kernel switched off), for comparison
        impls["gnext_2pass"] = impls["gnext"]
    rows = []
    it = tqdm(suite, desc="bench", file=sys.stdout) if tqdm else suite
    for name, shape, G, dtype, fmt in it:
        if not tqdm:
            print(f"[bench] {name}", flush=True)
        x, w, b, dy = make_inputs(shape, dtype, fmt, device)
        nbytes = x.numel() * x.element_size()
        floor_fwd = 2 * nbytes / (bw * 1e9) * 1e3
        floor_fb = 5 * nbytes / (bw * 1e9) * 1e3
        row = {"name": name, "shape": list(shape), "G": G, "dtype": str(dtype).replace("torch.", ""),
               "layout": fmt_name(fmt), "MB": nbytes / 1e6, "floor_fwd_ms": floor_fwd, "floor_fwdbwd_ms": floor_fb}
        row["check"] = check_correctness(x, G, w, b, dy)
        for impl in impls:
            if impl == "compile":
                torch._dynamo.reset()
                fn = torch.compile(lambda x, G, w, b: F.group_norm(x, G, w, b, 1e-5), fullgraph=True, dynamic=False)
            else:
                fn = impls[impl]
            if impl == "gnext_2pass":
                ge.set_tuning({"GNEXT_ONEPASS": 0, "GNEXT_BULK": 0, "GNEXT_BULK_BWD": 0})
            with torch.no_grad():
                t_fwd = timer(lambda: fn(x, G, w, b))
            xg, wg, bg = x.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_()

            def fwd_bwd():
                y = fn(xg, G, wg, bg)
                torch.autograd.grad(y, (xg, wg, bg), dy)

            t_fb = timer(fwd_bwd)
            ge.set_tuning(None)
            row[impl] = {"fwd_ms": t_fwd, "fwdbwd_ms": t_fb,
                         "fwd_frac_floor": floor_fwd / t_fwd, "fwdbwd_frac_floor": floor_fb / t_fb}
            del xg, wg, bg
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        del x, w, b, dy
        if device == "cuda":
            torch.cuda.empty_cache()
    return meta, rows, list(impls)


def to_markdown(meta, rows, impls):
    lines = [
        f"Device: {meta['device']} · torch {meta['torch']} (CUDA {meta['cuda']}) · {meta['date']} · "
        f"copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s (read+write) · {meta['timing']}",
        "",
        "Times in ms; `frac` = floor / time (1.0 = at the copy-bandwidth floor); `x eager`, `x compile` = their time / gnext's; "
        "`2-pass` = gnext with its one-pass and bulk kernels switched off (GNEXT_ONEPASS=0, GNEXT_BULK=0, GNEXT_BULK_BWD=0).",
        "",
    ]
    # (header, cell of a row, shown): one list, so the header and the cells cannot drift apart.
    comp, two = "compile" in impls, "gnext_2pass" in impls
    ms = lambda impl, k: lambda r: f"{r[impl][k]:.3f}"  # noqa: E731
    frac = lambda impl, k: lambda r: f"{r[impl][k]:.2f}"  # noqa: E731
    ratio = lambda impl, k: lambda r: f"{r[impl][k] / r['gnext'][k]:.2f}"  # noqa: E731

    def max_err(r):
        chk = r["check"]
        return f"{max(chk['out'], chk['dx'], chk['dw'], chk['db']):.1e}" + ("" if chk["finite"] else " NaN!")

    columns = [
        ("shape", lambda r: r["name"], True), ("MB", lambda r: f"{r['MB']:.0f}", True),
        ("floor fwd", lambda r: f"{r['floor_fwd_ms']:.3f}", True),
        ("gnext fwd", ms("gnext", "fwd_ms"), True), ("frac", frac("gnext", "fwd_frac_floor"), True),
        ("eager fwd", ms("eager", "fwd_ms"), True), ("frac", frac("eager", "fwd_frac_floor"), True),
        ("compile fwd", ms("compile", "fwd_ms"), comp), ("frac", frac("compile", "fwd_frac_floor"), comp),
        ("gnext f+b", ms("gnext", "fwdbwd_ms"), True), ("frac", frac("gnext", "fwdbwd_frac_floor"), True),
        ("eager f+b", ms("eager", "fwdbwd_ms"), True), ("compile f+b", ms("compile", "fwdbwd_ms"), comp),
        ("fwd x eager", ratio("eager", "fwd_ms"), True), ("f+b x eager", ratio("eager", "fwdbwd_ms"), True),
        ("fwd x compile", ratio("compile", "fwd_ms"), comp), ("f+b x compile", ratio("compile", "fwdbwd_ms"), comp),
        ("2-pass fwd", ms("gnext_2pass", "fwd_ms"), two), ("2-pass f+b", ms("gnext_2pass", "fwdbwd_ms"), two),
        ("max rel err", max_err, True),
    ]
    columns = [(h, cell) for h, cell, shown in columns if shown]
    lines += ["| " + " | ".join(h for h, _ in columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for r in rows:
        cells = [cell(r) for _, cell in columns]
        lines.append("| " + " | ".join(cells) + " |")
    gm = lambda vals: math.exp(sum(math.log(v) for v in vals) / len(vals))  # noqa: E731
    lines.append("")
    summary = [f"geomean speedup vs eager: fwd {gm([r['eager']['fwd_ms'] / r['gnext']['fwd_ms'] for r in rows]):.2f}x, "
               f"f+b {gm([r['eager']['fwdbwd_ms'] / r['gnext']['fwdbwd_ms'] for r in rows]):.2f}x"]
    if "compile" in impls:
        summary.append(f"vs torch.compile: fwd {gm([r['compile']['fwd_ms'] / r['gnext']['fwd_ms'] for r in rows]):.2f}x, "
                       f"f+b {gm([r['compile']['fwdbwd_ms'] / r['gnext']['fwdbwd_ms'] for r in rows]):.2f}x")
    lines.append("; ".join(summary))
    return "\n".join(lines) + "\n"


def plot(meta, rows, impls, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    names = [r["name"] for r in rows]
    width = 0.8 / len(impls)
    for ax, key, title in ((axes[0], "fwd_frac_floor", "forward"), (axes[1], "fwdbwd_frac_floor", "forward + backward")):
        for i, impl in enumerate(impls):
            ax.bar([j + i * width for j in range(len(rows))], [r[impl][key] for r in rows], width, label=impl)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(rows))])
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"GroupNorm {title}: fraction of copy-bandwidth floor")
    axes[0].set_ylabel("floor time / measured time")
    axes[0].legend()
    fig.suptitle(f"{meta['device']} · torch {meta['torch']} · {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="default", choices=sorted(SUITES))
    p.add_argument("--out", default=str(ROOT / "bench_out"), help="results folder")
    p.add_argument("--tag", default=None, help="file name tag (default: device kind)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    args = p.parse_args()
    meta, rows, impls = run(args)
    tag = args.tag or meta["kind"]
    save_results(args.out, f"bench_{tag}", meta, rows, to_markdown(meta, rows, impls))
    plot(meta, rows, impls, pathlib.Path(args.out) / f"bench_{tag}.png")


if __name__ == "__main__":
    main()
