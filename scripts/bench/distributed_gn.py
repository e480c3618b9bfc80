# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm(+SiLU) of one activation split along H over the GPUs of this host (NCCL, one process per GPU),
per layer, forward (and forward + backward): gnext's groupnorm_ext.distributed.group_norm against the all-gather approach (gather the
whole activation to every rank, GroupNorm it, keep this rank's rows: sglang's parallel VAE, written here from its
description), eager GroupNorm of the shard alone (wrong statistics: what the shard's pass costs) and gnext's op
on the shard alone; max abs difference of each rank's shard from nn.GroupNorm of the whole tensor (float32 on
rank 0). Median of CUDA-event times over reps, barrier before each.
    python scripts/bench/distributed_gn.py [--shape 1,128,4096,4096] [--gpus N] [--dtype float16]"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402


def _worker(rank, world, init, args, q):
    import groupnorm_ext as ge
    from groupnorm_ext import distributed as gd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    N, C, H, W = args.shape
    G = 32
    rows = [H // world] * world
    rows[-1] += H - sum(rows)
    lo = sum(rows[:rank])
    g = torch.Generator(device="cuda").manual_seed(0)  # the same tensor and parameters on every rank
    full = (torch.randn(N, C, H, W, device="cuda", generator=g) * 2 + 1).to(dtype)
    w = (torch.rand(C, device="cuda", generator=g) + 0.5).to(dtype)
    b = torch.randn(C, device="cuda", generator=g).to(dtype)
    shard = full[:, :, lo:lo + rows[rank]].contiguous()
    if rank != 0:
        del full
        full = None

    def allgather_gn():
        parts = [torch.empty(N, C, r, W, device="cuda", dtype=dtype) for r in rows]
        dist.all_gather(parts, shard)
        y = F.silu(F.group_norm(torch.cat(parts, dim=2), G, w, b, 1e-5))
        return y[:, :, lo:lo + rows[rank]]

    variants = {
        "gnext distributed": lambda: gd.group_norm(shard, G, w, b, 1e-5, activation="silu", dim=2, check=False),
        "gnext distributed, check=True": lambda: gd.group_norm(shard, G, w, b, 1e-5, activation="silu", dim=2),
        "all-gather + GroupNorm": allgather_gn,
        "eager GroupNorm of the shard alone (wrong stats)": lambda: F.silu(F.group_norm(shard, G, w, b, 1e-5)),
        "gnext op on the shard alone (wrong stats)": lambda: ge.group_norm_act(shard, G, w, b, 1e-5, activation="silu"),
    }
    dy = torch.randn(shard.shape, device="cuda", generator=g, dtype=dtype)
    xg = shard.detach().requires_grad_()
    wg, bg = w.detach().requires_grad_(), b.detach().requires_grad_()

    def train(fn):  # forward + backward of x, weight and bias
        def step():
            fn(xg, wg, bg).backward(dy)
            xg.grad = wg.grad = bg.grad = None
        return step

    train_variants = {
        "gnext distributed, fwd+bwd": train(lambda x, w_, b_: gd.group_norm(x, G, w_, b_, 1e-5, activation="silu",
                                                                            dim=2, check=False)),
        "gnext op on the shard alone, fwd+bwd": train(lambda x, w_, b_: ge.group_norm_act(x, G, w_, b_, 1e-5,
                                                                                          activation="silu")),
        "eager on the shard alone, fwd+bwd": train(lambda x, w_, b_: F.silu(F.group_norm(x, G, w_, b_, 1e-5))),
    }
    def measure(fn):  # two warm-up calls, then the slowest rank's median and this rank's extra peak memory
        for _ in range(2):
            fn()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = event_ms(fn, args.reps, across_ranks=True)
        return {"ms": ms, "peak_extra_MB": (torch.cuda.max_memory_allocated() - base) / 1e6}

    out = {name: measure(fn) for name, fn in train_variants.items()}
    with torch.no_grad():
        out.update({name: measure(fn) for name, fn in variants.items()})
        if args.profile and rank == 0:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    variants["gnext distributed"]()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
        elif args.profile:
            for _ in range(5):
                variants["gnext distributed"]()
        got = variants["gnext distributed"]()
        parts = [torch.empty(N, C, r, W, device="cuda", dtype=dtype) for r in rows]
        dist.all_gather(parts, got.contiguous())
        if rank == 0:
            ref = F.silu(F.group_norm(full.float(), G, w.float(), b.float(), 1e-5))
            diffs = [(p.float() - r).abs().max().item() for p, r in zip(parts, ref.split(rows, dim=2))]
            diff = max(diffs)
            q.put({"variants": out, "world": world, "shape": args.shape, "dtype": args.dtype, "rows": rows,
                   "max_abs_diff_vs_fp32_whole": diff, "per_rank_diff": diffs,
                   "bytes_per_layer_gnext": world * N * G * 3 * 8,
                   "bytes_per_layer_allgather": N * C * H * W * torch.finfo(dtype).bits // 8,
                   "bytes_per_layer_gnext_backward": N * C * 2 * 4,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__})
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="1,128,4096,4096")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--dtype", default="float16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--profile", action="store_true", help="rank 0's torch.profiler table of 5 forward calls")
    args = p.parse_args()
    args.shape = [int(v) for v in args.shape.split(",")]
    if not 1 <= args.gpus <= torch.cuda.device_count():
        raise SystemExit(f"distributed_gn: --gpus {args.gpus} with {torch.cuda.device_count()} visible GPU(s); it needs "
                         "1 <= --gpus <= the visible GPUs")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.gpus, f"file://{tmp}/store", args, q), nprocs=args.gpus,
                           join=True, start_method="spawn")
    r = q.get()
    if args.json:
        import datetime
        import json

        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.json, "w") as f:
            json.dump({"meta": {"device": f"{r['device']} x{r['world']}", "torch": r["torch"], "date": date}, **r},
                      f, indent=1)
    print(f"{r['device']} x{r['world']}, torch {r['torch']}, {r['shape']} {r['dtype']} split along H as {r['rows']}:")
    print("| variant | ms per layer (slowest rank) | peak extra MB (rank 0) |\n|---|---:|---:|")
    for name, v in r["variants"].items():
        print(f"| {name} | {v['ms']:.3f} | {v['peak_extra_MB']:.0f} |")
    fw, one = r["variants"]["gnext distributed"]["ms"], r["variants"]["gnext op on the shard alone (wrong stats)"]["ms"]
    ag = r["variants"]["all-gather + GroupNorm"]["ms"]
    tr = r["variants"]["gnext distributed, fwd+bwd"]["ms"] / r["variants"]["gnext op on the shard alone, fwd+bwd"]["ms"]
    print(f"gnext distributed: {ag / fw:.1f}x faster than the all-gather approach; {fw / one:.2f}x the single-GPU op "
          f"on the same shard (forward), {tr:.2f}x (forward + backward)")
    print(f"bytes exchanged per layer: gnext {r['bytes_per_layer_gnext']} (statistics) + backward "
          f"{r['bytes_per_layer_gnext_backward']}, all-gather approach "
          f"{r['bytes_per_layer_allgather'] / 1e9:.2f} GB (the activation); gnext vs fp32 whole-tensor GroupNorm: "
          f"max abs diff {r['max_abs_diff_vs_fp32_whole']:.2e} (per rank {r['per_rank_diff']})")


if __name__ == "__main__":
    main()
