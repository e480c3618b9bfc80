#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""KernelBench L2#19 benchmark: ConvTranspose2d(64->64, k3, s1) + GELU + GroupNorm(8) on 128x64x256x256
float32, forward and forward+backward (training), in one process:

  eager     the reference Model (cuDNN conv with bias, GELU, F.group_norm)
  compile   torch.compile(Model)
  gnext     ModelNew: torch.ops.gnext.conv_transpose2d_gelu_group_norm: the conv in ATen/cuDNN without
            bias, then bias + GELU + GroupNorm in gnext's kernels (statistics pass + elementwise pass;
            backward: fused GN+GELU backward, then the conv's gradients through ATen)
  gnext, dy copied   the same with GNEXT_DY_NCHW=0: an NCHW upstream gradient copied to channels_last
            before the backward (the default reads it in place)
  conv      cuDNN's conv alone (no bias), for reference

each for NCHW input and for channels_last input (x and the weights in channels_last), forward+backward
with the upstream gradient in each layout (NCHW, channels_last). TF32 follows
PyTorch's default for cuDNN convs (allow_tf32=True) unless --no-tf32. The floor column is the bytes
the GN part must move at the measured copy bandwidth (read z + write y; f+b adds read z, dy + write dz);
the op floor is the whole op's forward minimum (read x, write y). --profile adds per-kernel GPU times of
gnext's forward and forward+backward (torch.profiler). Writes <out>/bench_l2_19.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "scripts" / "kernelbench"))
from timing import Timer, copy_bandwidth, save_results, with_tuning  # noqa: E402
import level2_19_convtranspose_gelu_groupnorm as kb  # noqa: E402


def kernel_times(fn, reps=3):
    """GPU time per call of each kernel fn launches (ms, mean over reps), largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] = tot.get(e.name, 0.0) + e.device_time_total / 1e3 / reps
    return sorted(tot.items(), key=lambda kv: -kv[1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench_out"))
    p.add_argument("--batch", type=int, default=kb.batch_size)
    p.add_argument("--no-tf32", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU times of gnext's fwd and f+b")
    args = p.parse_args()
    torch.backends.cudnn.allow_tf32 = not args.no_tf32
    dev = "cuda"
    timer = Timer(dev)
    bw = copy_bandwidth(dev, timer)
    torch.manual_seed(0)
    model = kb.Model(*kb.get_init_inputs()).to(dev)
    new = kb.ModelNew(*kb.get_init_inputs()).to(dev)
    new.load_state_dict(model.state_dict())
    x0 = torch.rand(args.batch, kb.in_channels, kb.height, kb.width, device=dev)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "copy_bandwidth_GBps": bw, "tf32": torch.backends.cudnn.allow_tf32,
            "shape": [args.batch, kb.in_channels, kb.height, kb.width],
            "timing": "median of CUDA-event-timed calls, L2 flushed before each"}
    print(f"# {meta['device']}, torch {meta['torch']}, copy bandwidth {bw:.0f} GB/s, tf32={meta['tf32']}", flush=True)
    rows = []
    for layout in ("nchw", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = x0.contiguous(memory_format=fmt)
        for m in (model, new):
            m.to(memory_format=fmt)
        impls = {"eager": model, "gnext": new, "gnext, dy copied": with_tuning(new, GNEXT_DY_NCHW="0")}
        if not args.no_compile:
            torch._dynamo.reset()
            impls["compile"] = torch.compile(model)
        c = model.conv_transpose
        impls["conv (no bias)"] = lambda t: F.conv_transpose2d(t, c.weight, None, c.stride, c.padding)
        with torch.no_grad():
            zbytes = impls["gnext"](x).numel() * 4
        row = {"layout": layout, "floor_gn_fwd_ms": 2 * zbytes / bw / 1e6, "floor_gn_fb_ms": 5 * zbytes / bw / 1e6,
               "floor_op_fwd_ms": (x.numel() * 4 + zbytes) / bw / 1e6}
        for name, fn in impls.items():
            with torch.no_grad():
                t_f = timer(lambda: fn(x), min_reps=5, budget_s=0.5)
            row[name] = {"fwd_ms": t_f, "out_channels_last": fn(x).is_contiguous(memory_format=torch.channels_last)}
            line = f"  {layout:13s} {name:15s} fwd {t_f:8.3f} ms"
            xg = x.detach().requires_grad_()
            params = list(new.parameters() if name.startswith("gnext") else model.parameters())
            for glayout, gfmt in (("nchw", torch.contiguous_format), ("channels_last", torch.channels_last)):
                if name == "conv (no bias)":
                    break
                # The upstream gradient in a fixed layout, whatever the layout of the output: a loss or
                # a following op decides it, not the op.
                dy = torch.randn_like(fn(x).detach()).contiguous(memory_format=gfmt)

                def fb():
                    y = fn(xg)
                    torch.autograd.grad(y, [xg] + params, dy)

                if name == "gnext, dy copied":  # the knob is read by the backward op: set it around both
                    fb = with_tuning(fb, GNEXT_DY_NCHW="0")
                row[name][f"fwdbwd_ms_dy_{glayout}"] = t_fb = timer(fb, min_reps=5, budget_s=0.5)
                line += f"  f+b (dy {glayout}) {t_fb:8.3f} ms"
                if args.profile and name == "gnext":
                    row[f"profile {name} dy {glayout}"] = kernel_times(fb)
            print(line, flush=True)
            if args.profile and name == "gnext":
                row[f"profile {name} fwd"] = kernel_times(lambda: fn(x))
                for k in [k for k in row if k.startswith(f"profile {name} ")]:
                    print(f"    {k}: " + "; ".join(f"{n[:60]} {ms:.3f}" for n, ms in row[k]), flush=True)
            xg = dy = None  # freed before the next variant
            torch.cuda.empty_cache()
        rows.append(row)
    nan = {"fwd_ms": float("nan"), "fwdbwd_ms_dy_nchw": float("nan"), "fwdbwd_ms_dy_channels_last": float("nan")}
    lines = [f"Device: {meta['device']} · torch {meta['torch']} (CUDA {meta['cuda']}) · {meta['date']} · "
             f"copy bandwidth {bw:.0f} GB/s · TF32 {'on' if meta['tf32'] else 'off'} (cuDNN conv) · "
             f"input {'x'.join(map(str, meta['shape']))} fp32 · {meta['timing']}", "",
             "Forward, ms:", "",
             "| input layout | eager | compile | gnext | conv alone | gnext x eager | x compile "
             "| gnext output | op floor | GN floor |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        e, g, cv = r["eager"], r["gnext"], r["conv (no bias)"]
        cm = r.get("compile", nan)
        lines.append(
            f"| {r['layout']} | {e['fwd_ms']:.2f} | {cm['fwd_ms']:.2f} | {g['fwd_ms']:.2f} | "
            f"{cv['fwd_ms']:.2f} | {e['fwd_ms'] / g['fwd_ms']:.2f} | {cm['fwd_ms'] / g['fwd_ms']:.2f} | "
            f"{'channels_last' if g['out_channels_last'] else 'nchw'} | {r['floor_op_fwd_ms']:.2f} | "
            f"{r['floor_gn_fwd_ms']:.2f} |")
    lines += ["", "Forward + backward (`autograd.grad` of x and the parameters), ms, by the layout of the input "
              "and of the upstream gradient dy:", "",
              "| input layout | dy layout | eager | compile | gnext | gnext x eager | x compile | GN floor |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e, g = r["eager"], r["gnext"]
        cm = r.get("compile", nan)
        for gl in ("nchw", "channels_last"):
            k = f"fwdbwd_ms_dy_{gl}"
            lines.append(f"| {r['layout']} | {gl} | {e[k]:.2f} | {cm[k]:.2f} | {g[k]:.2f} | "
                         f"{e[k] / g[k]:.2f} | {cm[k] / g[k]:.2f} | {r['floor_gn_fb_ms']:.2f} |")
    lines += ["", "gnext with an NCHW dy copied into channels_last before the backward (GNEXT_DY_NCHW=0; the "
              "default reads it in place), forward+backward ms: "
              + "; ".join(f"{r['layout']} input, dy {gl}: {r['gnext, dy copied'][f'fwdbwd_ms_dy_{gl}']:.2f}"
                          for r in rows for gl in ("nchw", "channels_last"))]
    if args.profile:
        lines += ["", "gnext's kernels (ms per call, torch.profiler), the five longest:", ""]
        for r in rows:
            for k in [k for k in r if k.startswith("profile gnext ")]:
                lines.append(f"- {r['layout']} input, {k[len('profile gnext '):]}: "
                             + "; ".join(f"`{n[:50]}` {ms:.3f}" for n, ms in r[k][:5]))
    save_results(args.out, "bench_l2_19", meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
