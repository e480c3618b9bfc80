#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Where a real model's eager step spends its time, original vs converted (gnext), in one process.

For one row of scripts/bench/real_models.py (default: the UNet2DModel bf16 training step), eager
original vs converted, with --aten eager original with ATen's kernels vs with enable_aten_kernels()
(the same unedited model; the switch happens outside every timing), or with --compiled
torch.compile(original) without and with enable_compile_fusion():
  * wall time per step, the two variants interleaved over --rounds rounds (median [min..max]);
  * host time per step: the time until the step's Python call returns, the GPU synchronized only
    before (the GPU runs behind, so this is what the host spends enqueuing);
  * a torch.profiler trace of --steps steps per variant: the summed self-CPU time of every op and
    autograd node, the GPU kernel time, and the ops/nodes whose self-CPU time differs most between
    the variants (GroupNorm-related rows always shown);
  * the GPU time per step by kernel family (norm: GroupNorm and what Inductor fused into it; conv and
    GEMM; attention; the rest), which bounds what a faster GroupNorm can gain.
  * with --kernels: every GPU kernel of both variants by name, per step (time and launches), the
    gnext kernels and the kernels whose time differs most between the variants.
  python scripts/dev/profile_model.py [--row unet2d-train-bf16] [--rounds 7] [--steps 3] [--compiled [--baseline-without bias|cat] | --aten]
                                      [--fusion-when always] [--kernels 40]
                                      [--stacks aten::copy_,aten::empty_strided]
Diagnostic; the product table comes from scripts/bench/real_models.py."""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
import groupnorm_ext as ge  # noqa: E402
from groupnorm_ext import compile_fusion  # noqa: E402
from real_models import (TRACED_ROWS, _cast, build, compile_fusion_variant, fusion_pass, no_caches,  # noqa: E402
                         step_fn, wall_ms)

# Kernel families by name (CUDA kernels of gnext, cuDNN/CUTLASS, aten, Inductor's Triton kernels).
FAMILIES = (("norm", ("group_norm", "groupnorm", "gnext", "onepass", "welford", "var_mean")),
            ("conv/gemm", ("conv", "xmma", "cudnn", "cutlass", "gemm", "sm90_", "nvjet", "implicit", "wgrad",
                           "dgrad", "fprop")),
            ("attention", ("flash", "fmha", "attention", "softmax")))


def family(name):
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def host_ms(fn):
    """Time until one call returns, the GPU synchronized before it only (then drained)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return dt


def call_sites(prof, op, steps, top=8):
    """The Python call sites (innermost frames outside torch/) of `op`'s calls, per step, most frequent
    first: where e.g. the extra aten::copy_ of a converted model come from."""
    sites = defaultdict(int)
    for ev in prof.events():
        if ev.name != op:
            continue
        frames, p = list(ev.stack or []), ev.cpu_parent  # older torch: ev.stack; newer: Python-frame parents
        while p is not None:
            frames.append(p.name)
            p = p.cpu_parent
        py = [f for f in frames if "): " in f and "torch/" not in f][:3]
        # No Python frame of the model (the autograd engine's thread, or only torch's own frames): the
        # enclosing ops and autograd nodes name the site instead.
        ops = [f for f in frames if "): " not in f and not f.startswith("<built-in")][:3]
        sites[" <- ".join(py) if py else "ops: " + (" <- ".join(ops) or "?")] += 1
    return [(n / steps, site) for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:top]]


def profile(fn, steps, stacks=()):
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(stacks)) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    cpu, count, gpu, kern = defaultdict(float), defaultdict(int), defaultdict(float), defaultdict(float)
    launches = defaultdict(float)
    for ev in prof.key_averages():
        cpu[ev.key] += ev.self_cpu_time_total / steps
        count[ev.key] += ev.count // steps
        gpu[ev.key] += ev.self_device_time_total / steps
    for ev in prof.events():  # GPU kernels by name (key_averages also lists the CPU ops that launched them)
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            kern[ev.name] += ev.device_time_total / steps
            launches[ev.name] += 1 / steps
    for op in stacks:
        print(f"  call sites of {op} per step:")
        for n, site in call_sites(prof, op, steps):
            print(f"    {n:6.1f}  {site[:200]}")
    return cpu, count, gpu, kern, launches


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--row", default="unet2d-train-bf16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--stacks", default="", help="comma-separated ops (e.g. aten::copy_) whose Python call sites to list")
    p.add_argument("--compiled", action="store_true",
                   help="torch.compile(original) without and with enable_compile_fusion() instead of eager")
    p.add_argument("--baseline-without", choices=("bias", "cat"), default=None,
                   help="with --compiled: 'eager' is torch.compile with enable_compile_fusion() but one rule off: "
                        "bias, its convolution-bias move (input_bias); cat, its concatenation rule")
    p.add_argument("--nobias-baseline", action="store_const", dest="baseline_without", const="bias",
                   help="--baseline-without bias")
    p.add_argument("--fusion-when", choices=("auto", "always"), default="auto",
                   help="with --compiled: enable_compile_fusion(when=...); 'always' rewrites training graphs too")
    p.add_argument("--aten", action="store_true",
                   help="'gnext' = the original model with groupnorm_ext.enable_aten_kernels() instead of converted")
    p.add_argument("--kernels", type=int, default=0,
                   help="list the N GPU kernels whose per-step time differs most between the variants")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, row {args.row}")
    model32, inputs32, dtype, fmt, train = build(args.row, "cuda", False)
    inputs = _cast(inputs32, dtype, fmt)
    orig = copy.deepcopy(model32).to(dtype).to(memory_format=fmt)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(orig), return_counts=True,
                                             example_inputs=inputs if args.row in TRACED_ROWS else None)
    print(f"converted: {counts}")
    if args.compiled:
        torch._dynamo.reset()
        if args.baseline_without:
            off = {{"bias": "move_bias", "cat": "cat"}[args.baseline_without]: False}
            with fusion_pass(args.fusion_when, **off), no_caches():
                fns = {"eager": step_fn(compile_fusion_variant(copy.deepcopy(orig), None, "fx_graph_remote_cache"),
                                        inputs, train)}
                fns["eager"](), fns["eager"]()
        else:
            fns = {"eager": step_fn(torch.compile(copy.deepcopy(orig)), inputs, train)}
            fns["eager"]()
        before = compile_fusion.compile_fusion_stats["group_norm_act"]
        with fusion_pass(args.fusion_when):
            fns["gnext"] = step_fn(compile_fusion_variant(copy.deepcopy(orig)), inputs, train)
            with no_caches():
                fns["gnext"](), fns["gnext"]()
        print(f"compiled: 'eager' = torch.compile(original), 'gnext' = with enable_compile_fusion() "
              f"({compile_fusion.compile_fusion_stats['group_norm_act'] - before} rewrites)")
    elif args.aten:
        fns = {"eager": step_fn(orig, inputs, train), "gnext": step_fn(orig, inputs, train)}
        print("'eager' = original with ATen's kernels, 'gnext' = the same model with enable_aten_kernels()")
    else:
        fns = {"eager": step_fn(orig, inputs, train), "gnext": step_fn(conv, inputs, train)}
    # The kernels' switch (--aten) is made around each timing or profile, never inside one.
    ctx = {"eager": contextlib.nullcontext, "gnext": ge.aten_kernels if args.aten else contextlib.nullcontext}
    for v, f in fns.items():
        with ctx[v]():
            for _ in range(3):
                f()
    sync = torch.cuda.synchronize
    n = max(1, int(300 / max(wall_ms(fns["eager"], sync, 1), 1e-3)))
    wall, host = defaultdict(list), defaultdict(list)
    for r in range(args.rounds):
        for v in (("eager", "gnext") if r % 2 == 0 else ("gnext", "eager")):
            with ctx[v]():
                wall[v].append(wall_ms(fns[v], sync, n))
                host[v].append(host_ms(fns[v]))
    for v in fns:
        print(f"{v:6s} wall {statistics.median(wall[v]):7.2f} ms [{min(wall[v]):.2f}..{max(wall[v]):.2f}]  "
              f"host (enqueue) {statistics.median(host[v]):7.2f} ms [{min(host[v]):.2f}..{max(host[v]):.2f}]")
    stacks = [o for o in args.stacks.split(",") if o]
    prof = {}
    for v, f in fns.items():
        if stacks:
            print(f"{v}:")
        with ctx[v]():
            prof[v] = profile(f, args.steps, stacks)
    for v, (cpu, count, gpu, kern, _) in prof.items():
        fam = defaultdict(float)
        for k, t in kern.items():
            fam[family(k)] += t
        print(f"{v:6s} per step: self-CPU sum {sum(cpu.values()) / 1e3:7.2f} ms over {sum(count.values())} "
              f"events; GPU kernels {sum(kern.values()) / 1e3:7.2f} ms: "
              + ", ".join(f"{f} {t / 1e3:.2f}" for f, t in sorted(fam.items(), key=lambda kv: -kv[1])))
    for v, (_, _, _, kern, _) in prof.items():
        print(f"\n{v}: top GPU kernels per step")
        for k, t in sorted(kern.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {t:9.0f} us  [{family(k)}] {k[:110]}")
    if args.kernels:
        (ke, le), (kg, lg) = prof["eager"][3:], prof["gnext"][3:]
        names = set(ke) | set(kg)
        gn = sorted((k for k in names if "gnext" in k.lower()), key=lambda k: -kg.get(k, 0))
        diff = sorted(set(names) - set(gn), key=lambda k: -abs(kg.get(k, 0) - ke.get(k, 0)))[:args.kernels]
        print("\nGPU kernels per step: time (us) and launches, eager-side variant vs gnext-side variant "
              "(gnext kernels first, then the largest differences)")
        print(f"{'kernel':100s} {'us':>8s} {'n':>5s} {'us':>8s} {'n':>5s} {'diff':>8s}")
        for k in gn + diff:
            print(f"{k[:100]:100s} {ke.get(k, 0):8.0f} {le.get(k, 0):5.0f} {kg.get(k, 0):8.0f} "
                  f"{lg.get(k, 0):5.0f} {kg.get(k, 0) - ke.get(k, 0):+8.0f}")
    (ce, ne, ge_, _, _), (cg, ng, gg, _, _) = prof["eager"], prof["gnext"]
    keys = set(ce) | set(cg)
    gn_like = [k for k in keys if any(s in k.lower() for s in ("group_norm", "groupnorm", "gnext", "silu"))]
    diff = sorted(keys, key=lambda k: -abs(cg.get(k, 0) - ce.get(k, 0)))[:args.top]
    print(f"\n{'op / autograd node':70s} {'eager us':>9s} {'n':>5s} {'gnext us':>9s} {'n':>5s} "
          f"{'GPU eager':>9s} {'GPU gnext':>9s}")
    for k in diff + sorted(set(gn_like) - set(diff)):
        print(f"{k[:70]:70s} {ce.get(k, 0):9.0f} {ne.get(k, 0):5d} {cg.get(k, 0):9.0f} {ng.get(k, 0):5d} "
              f"{ge_.get(k, 0):9.0f} {gg.get(k, 0):9.0f}")


if __name__ == "__main__":
    main()
