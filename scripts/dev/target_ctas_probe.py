"""How many CTAs the two-pass GroupNorm kernels should aim for (GNEXT_TARGET_CTAS, default 4 per SM)
on the large tensors where they run: the NCHW maps whose groups are too large for the one-pass plan
(SDXL VAE 1x256x1024² bf16, the 2048² bf16 map: 0.93x of torch.compile in the sweep) and large
channels_last ones. N*C long rows split into K chunks give N*C*K CTAs. Forward and backward op times
(CUDA events, L2 flushed before each call) for several targets in one process, torch.compile's
F.group_norm beside them; --align sets GNEXT_CHUNK_ALIGN (chunk starts, in vectors). On the H100 the
times followed whether chunks started on a cache line, not the number of waves (docs/kernels.md).
Diagnostic for target_ctas() and nchw_row_split() in group_norm_heuristics.h.
    python scripts/dev/target_ctas_probe.py [--targets 264,396,528,792,1056,1584] [--align 64] [--cases 0,1]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
from timing import Timer, copy_bandwidth, with_env  # noqa: E402

import groupnorm_ext  # noqa: E402,F401

ops = torch.ops.gnext
# (N, C, H, W), G, dtype, channels_last
CASES = [
    ((1, 128, 2048, 2048), 32, torch.bfloat16, False),
    ((1, 256, 1024, 1024), 32, torch.bfloat16, False),
    ((112, 64, 512, 512), 8, torch.float32, False),  # L1#35 (one-pass forward by default)
    ((1, 128, 1024, 1024), 32, torch.float16, True),
    ((16, 512, 128, 128), 32, torch.bfloat16, True),
    ((8, 512, 4096), 32, torch.float32, False),  # audio 1-D
    # more NCHW maps whose N*C rows are split (N*C < 4 CTAs per SM)
    ((1, 512, 256, 256), 32, torch.float32, False),
    ((1, 128, 1024, 1024), 32, torch.float16, False),
    ((4, 32, 512, 512), 8, torch.float32, False),
    ((2, 64, 16, 64, 64), 8, torch.bfloat16, False),
    ((1, 128, 20, 256, 256), 32, torch.float32, False),
    ((1, 256, 512, 512), 32, torch.bfloat16, False),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--targets", default="264,396,528,792,1056,1584")
    ap.add_argument("--align", default="", help="GNEXT_CHUNK_ALIGN (vectors) for every column (default: the build's)")
    ap.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile column")
    args = ap.parse_args()
    env = {"GNEXT_CHUNK_ALIGN": args.align} if args.align else {}
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    targets = args.targets.split(",")
    timer = Timer("cuda")
    bw = copy_bandwidth("cuda", timer)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s; ms, "
          f"GNEXT_ONEPASS as by default; columns: GNEXT_TARGET_CTAS; {env or 'default chunk alignment'}")
    print(f"{'shape':24s} {'pass':4s} " + " ".join(f"{t:>7s}" for t in targets) + f" {'compile':>8s} {'floor':>7s}")
    for shape, G, dtype, cl in cases:
        torch.manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=dtype) + 2
        if cl:
            x = x.to(memory_format=torch.channels_last)
        w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
        dy = torch.randn_like(x)
        _, mean, rstd = ops.group_norm(x, G, w, w, 1e-5)
        nbytes = x.numel() * x.element_size()
        t_comp = float("nan")
        if not args.no_compile:
            comp = torch.compile(lambda t: F.group_norm(t, G, w, w, 1e-5))
            t_comp = timer(lambda: comp(x))
        row_f, row_b = [], []
        for t in targets:
            row_f.append(with_env(lambda: timer(lambda: ops.group_norm(x, G, w, w, 1e-5)),
                                  GNEXT_TARGET_CTAS=t, **env)())
            row_b.append(with_env(lambda: timer(lambda: ops.group_norm_backward(dy, x, mean, rstd, w, G,
                                                                                [True, True, True])),
                                  GNEXT_TARGET_CTAS=t, **env)())
        name = "x".join(map(str, shape)) + (" CL" if cl else "")
        print(f"{name:24s} fwd  " + " ".join(f"{v:7.3f}" for v in row_f) + f" {t_comp:8.3f} {2 * nbytes / bw / 1e6:7.3f}")
        print(f"{'':24s} bwd  " + " ".join(f"{v:7.3f}" for v in row_b) + f" {'':8s} {4 * nbytes / bw / 1e6:7.3f}",
              flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
