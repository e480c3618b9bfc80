#!/usr/bin/env python3
"""Tuning sweep of the one-pass kernel (group_norm_onepass.cuh): forward and backward op times
for CTAs per SM x shared-memory stages (GNEXT_ONEPASS_CTAS / GNEXT_ONEPASS_NBUF), next to the
two-pass kernels (GNEXT_ONEPASS=0), all in one process. Diagnostic; speed claims come from bench.py.

    python scripts/dev/onepass_sweep.py [--json out.json]
"""
import argparse
import json
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from timing import Timer, copy_bandwidth, make_inputs  # noqa: E402

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
CL = torch.channels_last
SHAPES = [
    ("L1#35 112x64x512x512 fp32", (112, 64, 512, 512), 8, f32, None),
    ("128x64x258x258 fp32", (128, 64, 258, 258), 8, f32, None),
    ("VAE 1x128x1024x1024 fp16", (1, 128, 1024, 1024), 32, f16, None),
    ("UNet 16x512x128x128 bf16 CL", (16, 512, 128, 128), 32, bf16, CL),
    ("SD 2x640x64x64 fp16 CL", (2, 640, 64, 64), 32, f16, CL),
    ("ResNet 32x256x56x56 bf16", (32, 256, 56, 56), 32, bf16, None),
    ("seq 8x512x4096 fp16", (8, 512, 4096), 32, f16, None),
]
CONFIGS = [("2-pass", {"GNEXT_ONEPASS": "0"})] + [
    (f"ctas={c} nbuf={b}", {"GNEXT_ONEPASS_CTAS": str(c), "GNEXT_ONEPASS_NBUF": str(b)})
    for c, b in [(1, 2), (2, 2), (2, 3), (3, 2), (4, 2)]
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    timer = Timer("cuda")
    bw = copy_bandwidth("cuda", timer)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw:.0f} GB/s; "
          "fraction of floor (fwd: 2|x|, bwd: 3|x|)")
    results = []
    for name, shape, G, dtype, fmt in SHAPES:
        x, w, b, dy = make_inputs(shape, dtype, fmt, "cuda")
        nbytes = x.numel() * x.element_size()
        out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, b, 1e-5)
        for cname, env in CONFIGS:
            os.environ.update(env)
            try:
                t_f = timer(lambda: torch.ops.gnext.group_norm(x, G, w, b, 1e-5))
                t_b = timer(lambda: torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True]))
            except RuntimeError as e:
                print(f"{name:28s} {cname:16s} failed: {str(e).splitlines()[0]}", flush=True)
                continue
            finally:
                for k in env:
                    os.environ.pop(k)
            ff, fb = 2 * nbytes / bw / 1e6 / t_f, 3 * nbytes / bw / 1e6 / t_b
            results.append({"shape": name, "config": cname, "fwd_ms": t_f, "bwd_ms": t_b, "fwd_frac": ff, "bwd_frac": fb})
            print(f"{name:28s} {cname:16s} fwd {t_f:8.3f} ms ({ff:.2f})  bwd {t_b:8.3f} ms ({fb:.2f})", flush=True)
        del x, w, b, dy, out
        torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                       "torch": torch.__version__, "copy_GBps": bw,
                                                       "results": results}, indent=1))


if __name__ == "__main__":
    main()
