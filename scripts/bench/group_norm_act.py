#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""group_norm_act benchmark, one process: KernelBench L2#92 (Conv2d 8->64 k3 + GroupNorm(16) + tanh +
hardswish + residual + logsumexp over C, 128x8x128x128 fp32), GroupNorm + SiLU on diffusion shapes, and
SiLU(GroupNorm(x) * scale + shift) on CogVideoX's decoder maps (group_norm_act_modulate), forward and
forward+backward, gnext vs eager vs torch.compile (and the conv alone for L2#92).
    python scripts/bench/group_norm_act.py [--rows l2_92,silu,modulate] [--out DIR] [--name bench_group_norm_act]
Writes <out>/<name>.{json,md}."""
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

# SiLU(GroupNorm(x) * scale + shift), scale and shift of x's shape: CogVideoX's spatially conditioned norms at the
# decoder's two largest maps (a frame batch of 9 frames).
# (name, x's shape, scale's and shift's shape: None = x's, G, dtype); the smaller ones are upsampled by nearest
# neighbour (the op reads them in place; eager and torch.compile call F.interpolate first).
MOD_SHAPES = [
    ("GN*s+b+SiLU CogVideoX 1x128x9x512x512 fp16", (1, 128, 9, 512, 512), None, 32, torch.float16),
    ("GN*s+b+SiLU CogVideoX 1x256x9x256x256 fp16", (1, 256, 9, 256, 256), None, 32, torch.float16),
    ("GN*up(s)+up(b)+SiLU 1x128x9x512x512, s and b 64x64, fp16", (1, 128, 9, 512, 512), (1, 128, 9, 64, 64), 32,
     torch.float16),
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
    p.add_argument("--rows", default="l2_92,silu,modulate", help="comma-separated subset of l2_92,silu,modulate")
    p.add_argument("--name", default="bench_group_norm_act")
    args = p.parse_args()
    which = set(args.rows.split(","))
    timer = Timer("cuda")
    bw = copy_bandwidth("cuda", timer)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "copy_bandwidth_GBps": bw, "tf32": torch.backends.cudnn.allow_tf32,
            "timing": "median of CUDA-event-timed calls, L2 flushed before each"}
    print(f"# {meta['device']}, torch {meta['torch']}, copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    if "l2_92" in which:
        rows.append(l2_92_row(timer))
    if "silu" in which:
        rows += silu_rows(timer, bw)
    if "modulate" in which:
        rows += modulate_rows(timer, bw)
    lines = [f"Device: {meta['device']} · torch {meta['torch']} · {meta['date']} · copy bandwidth {bw:.0f} GB/s · "
             f"TF32 {'on' if meta['tf32'] else 'off'} (cuDNN conv) · {meta['timing']}", "",
             "| workload | eager fwd | compile fwd | gnext fwd | x eager | x compile | eager f+b | compile f+b | "
             "gnext f+b | x eager | x compile | reference |", "|---|" + "---:|" * 11]
    for r in rows:
        e, c, g = r["eager"], r["compile"], r["gnext"]
        if "conv alone" in r:
            extra = (f"conv alone {r['conv alone']['fwd_ms']:.3f} / {r['conv alone']['fwdbwd_ms']:.3f}; CL without "
                     f"bias {r['conv CL no bias']['fwd_ms']:.3f} / {r['conv CL no bias']['fwdbwd_ms']:.3f}")
        else:
            k = "gnext GN, then F.silu" if "gnext GN, then F.silu" in r else "gnext GN, then PyTorch"
            frac = r["floor_fwd_ms"] / g["fwd_ms"]
            extra = (f"floor fwd {r['floor_fwd_ms']:.3f} (gnext at {frac:.2f} of it); {k} {r[k]['fwd_ms']:.3f} / "
                     f"{r[k]['fwdbwd_ms']:.3f}")
        lines.append(f"| {r['name']} | {e['fwd_ms']:.3f} | {c['fwd_ms']:.3f} | {g['fwd_ms']:.3f} | "
                     f"{e['fwd_ms'] / g['fwd_ms']:.2f} | {c['fwd_ms'] / g['fwd_ms']:.2f} | {e['fwdbwd_ms']:.3f} | "
                     f"{c['fwdbwd_ms']:.3f} | {g['fwdbwd_ms']:.3f} | {e['fwdbwd_ms'] / g['fwdbwd_ms']:.2f} | "
                     f"{c['fwdbwd_ms'] / g['fwdbwd_ms']:.2f} | {extra} |")
    save_results(args.out, args.name, meta, rows, "\n".join(lines) + "\n")


def l2_92_row(timer):
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
    return row


def silu_rows(timer, bw):
    rows = []
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
    return rows


def modulate_rows(timer, bw):
    """Forward floor: x, scale and shift read once, out written (4 passes at the copy bandwidth; 2 where scale and
    shift are small)."""
    rows = []
    for name, shape, small, G, dtype in MOD_SHAPES:
        xs, w, b, _ = make_inputs(shape, dtype, None, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        sc = (torch.randn(small or shape, device="cuda", generator=gen) * 0.5 + 1).to(dtype)
        sh = torch.randn(small or shape, device="cuda", generator=gen).to(dtype)
        w.requires_grad_(), b.requires_grad_()
        up = (lambda v: F.interpolate(v, size=shape[2:], mode="nearest")) if small else (lambda v: v)
        eager = lambda t, s, h: F.silu(F.group_norm(t, G, w, b, 1e-6) * up(s) + up(h))  # noqa: E731
        torch._dynamo.reset()
        impls = {"eager": eager, "compile": torch.compile(eager),
                 "gnext": lambda t, s, h: ge.group_norm_act_modulate(t, G, s, h, w, b, 1e-6, "silu"),
                 "gnext GN, then PyTorch": lambda t, s, h: F.silu(ge.group_norm(t, G, w, b, 1e-6) * up(s) + up(h))}
        row = {"name": name, "floor_fwd_ms": (2 if small else 4) * xs.numel() * xs.element_size() / bw / 1e6}
        for k, fn in impls.items():
            row[k] = dict(zip(("fwd_ms", "fwdbwd_ms"), time_fwd_fb(timer, fn, [xs, sc, sh], [w, b])))
            print(f"  {name} {k:22s} {row[k]}", flush=True)
        rows.append(row)
        del xs, sc, sh
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
