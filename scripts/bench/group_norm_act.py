#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""group_norm_act benchmark, one process: KernelBench L2#92 (Conv2d 8->64 k3 + GroupNorm(16) + tanh +
hardswish + residual + logsumexp over C, 128x8x128x128 fp32) and GroupNorm + SiLU on diffusion shapes,
forward and forward+backward, gnext vs eager vs torch.compile (and the conv alone for L2#92).
Writes <out>/bench_group_norm_act.{json,md}."""
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
import groupnorm_ext as ge  # noqa: E402
from timing import Timer, copy_bandwidth, make_inputs, save_results  # noqa: E402
import level2_92_conv_groupnorm_tanh_hardswish_residual_logsumexp as kb  # noqa: E402

SILU_SHAPES = [
    ("GN+SiLU VAE 1x128x1024x1024 fp16", (1, 128, 1024, 1024), 32, torch.float16, None),
    ("GN+SiLU UNet 16x512x128x128 bf16 CL", (16, 512, 128, 128), 32, torch.bfloat16, torch.channels_last),
    ("GN+SiLU SD 2x320x64x64 fp16", (2, 320, 64, 64), 32, torch.float16, None),
]


def time_fwd_fb(timer, fn, inputs, params):
    with torch.no_grad():
        t_f = timer(lambda: fn(*inputs), min_reps=5, budget_s=0.4)
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = fn(*leaves)
    dy = torch.randn_like(y)

    def fb():
        torch.autograd.grad(fn(*leaves), leaves + params, dy, allow_unused=True)

    return t_f, timer(fb, min_reps=5, budget_s=0.4)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(ROOT / "bench_out"))
    args = p.parse_args()
    timer = Timer("cuda")
    bw = copy_bandwidth("cuda", timer)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "copy_bandwidth_GBps": bw, "tf32": torch.backends.cudnn.allow_tf32,
            "timing": "median of CUDA-event-timed calls, L2 flushed before each"}
    print(f"# {meta['device']}, torch {meta['torch']}, copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    # L2#92
    torch.manual_seed(0)
    model = kb.Model(*kb.get_init_inputs()).cuda()
    new = kb.ModelNew(*kb.get_init_inputs()).cuda()
    new.load_state_dict(model.state_dict())
    x = kb.get_inputs()[0].cuda()
    torch._dynamo.reset()
    w_cl = model.conv.weight.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    impls = {"eager": model, "compile": torch.compile(model), "gnext": new,
             "conv alone": lambda t: F.conv2d(t, model.conv.weight, model.conv.bias),
             "conv CL no bias": lambda t: F.conv2d(t.contiguous(memory_format=torch.channels_last), w_cl)}
    row = {"name": "L2#92 128x8x128x128 fp32"}
    for k, fn in impls.items():
        params = list(new.parameters()) if k == "gnext" else [w_cl] if k == "conv CL no bias" else list(model.parameters())
        row[k] = dict(zip(("fwd_ms", "fwdbwd_ms"), time_fwd_fb(timer, fn, [x], params)))
        print(f"  {row['name']} {k:10s} {row[k]}", flush=True)
    rows.append(row)
    # GroupNorm + SiLU
    for name, shape, G, dtype, fmt in SILU_SHAPES:
        xs, w, b, _ = make_inputs(shape, dtype, fmt, "cuda")
        w.requires_grad_(), b.requires_grad_()
        eager = lambda t: F.silu(F.group_norm(t, G, w, b, 1e-5))  # noqa: E731
        torch._dynamo.reset()
        impls = {"eager": eager, "compile": torch.compile(eager),
                 "gnext": lambda t: ge.group_norm_act(t, G, w, b, 1e-5, "silu"),
                 "gnext GN, then F.silu": lambda t: F.silu(ge.group_norm(t, G, w, b, 1e-5))}
        row = {"name": name, "floor_fwd_ms": 2 * xs.numel() * xs.element_size() / bw / 1e6}
        for k, fn in impls.items():
            row[k] = dict(zip(("fwd_ms", "fwdbwd_ms"), time_fwd_fb(timer, fn, [xs], [w, b])))
            print(f"  {name} {k:22s} {row[k]}", flush=True)
        rows.append(row)
        del xs
        torch.cuda.empty_cache()
    lines = [f"Device: {meta['device']} · torch {meta['torch']} · {meta['date']} · copy bandwidth {bw:.0f} GB/s · "
             f"TF32 {'on' if meta['tf32'] else 'off'} (cuDNN conv) · {meta['timing']}", "",
             "| workload | eager fwd | compile fwd | gnext fwd | x eager | x compile | eager f+b | compile f+b | "
             "gnext f+b | x eager | x compile | reference |", "|---|" + "---:|" * 11]
    for r in rows:
        e, c, g = r["eager"], r["compile"], r["gnext"]
        extra = (f"conv alone {r['conv alone']['fwd_ms']:.3f} / {r['conv alone']['fwdbwd_ms']:.3f}; CL without bias "
                 f"{r['conv CL no bias']['fwd_ms']:.3f} / {r['conv CL no bias']['fwdbwd_ms']:.3f}" if "conv alone" in r
                 else f"floor fwd {r['floor_fwd_ms']:.3f}; GN then F.silu {r['gnext GN, then F.silu']['fwd_ms']:.3f}"
                      f" / {r['gnext GN, then F.silu']['fwdbwd_ms']:.3f}")
        lines.append(f"| {r['name']} | {e['fwd_ms']:.3f} | {c['fwd_ms']:.3f} | {g['fwd_ms']:.3f} | "
                     f"{e['fwd_ms'] / g['fwd_ms']:.2f} | {c['fwd_ms'] / g['fwd_ms']:.2f} | {e['fwdbwd_ms']:.3f} | "
                     f"{c['fwdbwd_ms']:.3f} | {g['fwdbwd_ms']:.3f} | {e['fwdbwd_ms'] / g['fwdbwd_ms']:.2f} | "
                     f"{c['fwdbwd_ms'] / g['fwdbwd_ms']:.2f} | {extra} |")
    save_results(args.out, "bench_group_norm_act", meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
