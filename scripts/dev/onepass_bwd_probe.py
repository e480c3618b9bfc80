"""Where the one-pass GroupNorm backward beats the two-pass kernels: the backward op's time with the
heuristic (GNEXT_ONEPASS=1) against two-pass (GNEXT_ONEPASS=0) over NCHW maps, 1-D sequences and 5-D
video of several group sizes ("group_stage_KB": x and dy bytes of one group), CUDA events with the L2
flushed, one process. Diagnostic for the backward rule in onepass_geometry (group_norm_heuristics.h).
    python scripts/dev/onepass_bwd_probe.py [--big]
--big: tensors of 100 MB to 7.5 GB (L2#19's GroupNorm, L1#35, audio, UNet/VAE maps), also with the one-pass
kernels forced (GNEXT_ONEPASS=2).
"""
from __future__ import annotations

import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
from timing import Timer, with_env  # noqa: E402

import groupnorm_ext  # noqa: E402,F401

CASES = [((4, 32, 512, 512), 8, torch.float32), ((2, 320, 64, 64), 32, torch.float16),
         ((1, 128, 1024, 1024), 32, torch.float16), ((16, 64, 96, 96), 8, torch.float32),
         ((2, 64, 16, 64, 64), 8, torch.bfloat16), ((8, 512, 4096), 32, torch.float16),
         ((4, 128, 16384), 32, torch.float32), ((2, 640, 64, 64), 32, torch.float16),
         ((8, 64, 40, 40), 4, torch.float32), ((2, 16, 256, 256), 4, torch.float32),
         ((16, 256, 64, 64), 32, torch.bfloat16), ((8, 128, 128, 128), 32, torch.float16),
         ((8, 512, 4096), 32, torch.float32), ((16, 256, 16000), 16, torch.bfloat16),
         ((32, 128, 8000), 32, torch.bfloat16), ((4, 512, 2048), 32, torch.float32),
         ((32, 256, 56, 56), 32, torch.bfloat16), ((32, 512, 28, 28), 32, torch.float32),
         ((8, 256, 56, 56), 32, torch.bfloat16), ((32, 1024, 14, 14), 32, torch.float16)]


BIG = [((128, 64, 258, 258), 8, torch.float32), ((32, 64, 258, 258), 8, torch.float32),
       ((112, 64, 512, 512), 8, torch.float32), ((16, 64, 256, 256), 8, torch.float32),
       ((16, 256, 16000), 16, torch.bfloat16), ((64, 256, 64, 64), 32, torch.float16),
       ((8, 128, 256, 256), 32, torch.bfloat16), ((32, 128, 128, 128), 32, torch.bfloat16),
       ((4, 256, 256, 256), 32, torch.float16)]


def main():
    big = "--big" in sys.argv
    t = Timer("cuda")
    ops = torch.ops.gnext
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    modes = ("2", "1", "0") if big else ("1", "0")
    print(f"shape G dtype group_stage_KB | GN bwd onepass={' / '.join(modes)} (ms) ratio {modes[0]}/0")
    for shape, G, dt in BIG if big else CASES:
        x = torch.randn(shape, device="cuda", dtype=dt) + 2
        w = torch.rand(shape[1], device="cuda", dtype=dt) + 0.5
        dy = torch.randn_like(x)
        _, m, r = ops.group_norm(x, G, w, w, 1e-5)

        def f():
            ops.group_norm_backward(dy, x, m, r, w, G, [True, True, True])
        ms = [with_env(lambda: t(f), GNEXT_ONEPASS=k)() for k in modes]
        kb = x.numel() // (shape[0] * G) * x.element_size() * 2 / 1024
        print("x".join(map(str, shape)), G, str(dt)[6:], f"{kb:.0f}", " ".join(f"{v:.4f}" for v in ms),
              f"{ms[0] / ms[-1]:.3f}", flush=True)
        del x, dy, m, r
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
