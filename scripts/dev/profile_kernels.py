#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Per-kernel CUDA times (torch.profiler) of gnext's GroupNorm and GroupNorm+activation, forward and
backward, one-pass allowed and forced off (GNEXT_ONEPASS=0), on the shapes where issue 17 measured
gaps; with the host time of one forward call. Diagnostic tool: which kernels run and what each costs.
Speed claims come from scripts/bench."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) + "/../..")
import groupnorm_ext  # noqa: E402,F401

SHAPES = [
    ((112, 64, 512, 512), 8, torch.float32, None),
    ((1, 128, 1024, 1024), 32, torch.float16, None),
    ((1, 128, 20, 256, 256), 32, torch.bfloat16, None),
    ((1, 128, 20, 256, 256), 32, torch.bfloat16, torch.channels_last_3d),
    ((1, 128, 1024, 1024), 32, torch.float16, torch.channels_last),
    ((16, 512, 128, 128), 32, torch.bfloat16, torch.channels_last),
    ((2, 1280, 16, 16), 32, torch.float16, torch.channels_last),
    ((2, 320, 64, 64), 32, torch.float16, None),
    ((1, 512, 64, 64), 32, torch.float16, torch.channels_last),  # the VAE's NHWC finalize
    ((32, 2048, 7, 7), 32, torch.bfloat16, None),  # ResNet-GN: HxW not a multiple of the vector
    ((32, 1024, 14, 14), 32, torch.float16, None),
    ((1, 512, 32, 32), 512, torch.bfloat16, torch.channels_last),  # the sweep's worst forward
]


def set_knob(name, value):
    """One planner knob (GNEXT_* name) set over the current ones (groupnorm_ext.set_tuning)."""
    groupnorm_ext.set_tuning({**groupnorm_ext.tuning(), name: int(value)})


def parse_shape(text):
    """'2,1280,16,16:32:float16:cl' -> ((2, 1280, 16, 16), 32, torch.float16, torch.channels_last)."""
    dims, G, dtype, *cl = text.split(":")
    shape = tuple(int(d) for d in dims.split(","))
    fmt = ({4: torch.channels_last, 5: torch.channels_last_3d}[len(shape)]) if cl else None
    return shape, int(G), getattr(torch, dtype), fmt


FLUSH = None  # --flush: a 256 MB buffer overwritten before every timed call (the L2 holds none of the inputs)


def kernel_us(fn, reps):
    """Summed CUDA kernel time of one fn() call (µs), from the profiler over `reps` calls (with --flush, the
    buffer fill before each call is left out of the sum)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if FLUSH is not None:
                FLUSH.fill_(1)
            fn()
        torch.cuda.synchronize()
    return sum(ev.device_time_total for ev in prof.key_averages() if "FillFunctor" not in ev.key) / reps


def warm_up(fwd, bwd):
    """Two forward+backward calls after a first forward; returns that forward's (mean, rstd)."""
    _, m, r = fwd()
    for _ in range(2):
        fwd(), bwd(m, r)
    return m, r


def summary(title, mb, variants, reps, settings, env=""):
    """One line: forward and backward kernel time (µs) of every variant under each GNEXT_ONEPASS setting
    (and each value of the knob in env, 'NAME=V1,V2')."""
    knob, values = env.split("=") if env else ("", "")
    cells = []
    for name, (fwd, bwd) in variants.items():
        for onepass in settings:
            for value in values.split(","):
                set_knob("GNEXT_ONEPASS", onepass)
                if knob:
                    set_knob(knob, value)
                m, r = warm_up(fwd, bwd)
                label = f"{name}/{onepass}" + (f"/{value}" if knob else "")
                cells.append(f"{label} {kernel_us(fwd, reps):7.1f} {kernel_us(lambda: bwd(m, r), reps):7.1f}")
    groupnorm_ext.set_tuning(None)
    if knob:
        groupnorm_ext.set_tuning(None)
    print(f"{title:<44s} {mb:7.1f} MB | fwd bwd us: " + " | ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--act", default="silu", help="activation of the group_norm_act rows ('' = none)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--match", default="", help="only shapes whose printed name contains this")
    ap.add_argument("--shape", action="append", default=[], metavar="N,C,H[,W[,D]]:G:DTYPE[:cl]",
                    help="profile these shapes instead of the built-in list (repeatable), e.g. 2,1280,16,16:32:float16:cl")
    ap.add_argument("--summary", action="store_true",
                    help="one line per shape: summed kernel time of a forward and of a backward call per variant")
    ap.add_argument("--onepass", default="1,0",
                    help="GNEXT_ONEPASS settings to compare (2: NHWC one-pass even where the heuristic skips it)")
    ap.add_argument("--env", default="", metavar="NAME=V1,V2",
                    help="also compare these values of one more environment knob "
                         "(e.g. GNEXT_NHWC_MIN_ROWS=0,16,32)")
    ap.add_argument("--flush", action="store_true",
                    help="--summary: overwrite 256 MB before each timed call, so that inputs come from DRAM "
                         "(without it, back-to-back calls find inputs of up to ~25 MB in the L2)")
    args = ap.parse_args()
    if args.flush:
        global FLUSH
        FLUSH = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
    ops = torch.ops.gnext
    for shape, G, dtype, fmt in [parse_shape(s) for s in args.shape] or SHAPES:
        title = f"{tuple(shape)} G={G} {str(dtype)[6:]} {'CL' if fmt else 'contiguous'}"
        if args.match not in title:
            continue
        x = torch.randn(shape, device="cuda", dtype=dtype) * 3 + 2
        if fmt is not None:
            x = x.contiguous(memory_format=fmt)
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        mb = x.numel() * x.element_size() / 1e6
        variants = {"gn": (lambda: ops.group_norm(x, G, w, w, 1e-5),
                           lambda m, r: ops.group_norm_backward(dy, x, m, r, w, G, [True, True, True]))}
        if args.act:
            variants[args.act] = (
                lambda: ops.group_norm_act(x, G, w, w, 1e-5, args.act, None),
                lambda m, r: ops.group_norm_act_backward(dy, x, m, r, w, w, G, args.act, [True, True, True]))
        if args.summary:
            summary(title, mb, variants, args.reps, args.onepass.split(","), args.env)
            continue
        print(f"== {title} ({mb:.0f} MB; "
              f"fwd floor {2 * mb / 3000:.3f} ms at 3 TB/s)")
        knob, _, values = args.env.partition("=")
        for onepass in args.onepass.split(","):
            set_knob("GNEXT_ONEPASS", onepass)
            for value in values.split(",") if knob else [None]:
                if knob:
                    set_knob(knob, value)
                for name, (fwd, bwd) in variants.items():
                    m, r = warm_up(fwd, bwd)
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.reps):
                            fwd()
                            bwd(m, r)
                        torch.cuda.synchronize()
                    print(f"  [{name}, GNEXT_ONEPASS={onepass}{f', {knob}={value}' if knob else ''}]")
                    for ev in prof.key_averages():
                        if ev.device_time_total > 0:
                            print(f"   {ev.device_time_total / ev.count:9.1f} us  x{ev.count:<3d} {ev.key[:100]}")
            if knob:
                groupnorm_ext.set_tuning(None)
        groupnorm_ext.set_tuning(None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            ops.group_norm(x, G, w, w, 1e-5)
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        print(f"   host time per forward call (async, incl. queueing): {host:.1f} us")


if __name__ == "__main__":
    main()
