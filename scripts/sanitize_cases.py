#!/usr/bin/env python3
"""Small driver for compute-sanitizer (scripts/sanitize.sh): forward + backward of gnext's
GroupNorm on shapes that take every kernel family (one-pass NCHW/NHWC with and without inter-CTA
waits, two-pass NCHW/NHWC, HxW = 1), each checked against float64 so that a sanitizer run also
fails on wrong results. Sizes are small: the sanitizers slow kernels down 10-100x."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import groupnorm_ext  # noqa: E402,F401

CL, CL3 = torch.channels_last, torch.channels_last_3d
CASES = [  # shape, G, dtype, memory format
    ((2, 16, 64, 64), 4, torch.float32, None),
    ((8, 64, 40, 40), 4, torch.float16, None),
    ((40, 64, 16, 16), 8, torch.bfloat16, None),
    ((64, 512, 4, 4), 1, torch.float32, None),
    ((2, 6, 7, 9), 3, torch.float32, None),  # unaligned rows: two-pass
    ((2, 320, 16, 16), 32, torch.float16, CL),
    ((1, 128, 64, 64), 32, torch.float16, CL),
    ((3, 96, 7, 9), 3, torch.bfloat16, CL),
    ((2, 64, 4, 8, 8), 8, torch.float32, CL3),
    ((6, 64), 8, torch.float32, None),
]


def main():
    bad = 0
    for onepass in ("1", "0"):
        os.environ["GNEXT_ONEPASS"] = onepass
        for shape, G, dtype, fmt in CASES:
            g = torch.Generator(device="cuda").manual_seed(0)
            x = (torch.randn(shape, device="cuda", generator=g) * 3 + 2).to(dtype)
            if fmt is not None:
                x = x.contiguous(memory_format=fmt)
            w = torch.rand(shape[1], device="cuda", generator=g) + 0.5
            b = torch.randn(shape[1], device="cuda", generator=g)
            dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
            out, mean, rstd = torch.ops.gnext.group_norm(x, G, w, b, 1e-5)
            dx, dw, db = torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])
            xd = x.double().requires_grad_()
            wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
            ref = torch.nn.functional.group_norm(xd, G, wd, bd, 1e-5)
            rdx, rdw, rdb = torch.autograd.grad(ref, (xd, wd, bd), dy.double())
            errs = [((a.double() - r).norm() / r.norm()).item() for a, r in ((out, ref), (dx, rdx), (dw, rdw), (db, rdb))]
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            ok = max(errs) < tol
            bad += not ok
            print(f"onepass={onepass} {shape} G={G} {dtype} {fmt}: max rel err {max(errs):.1e} {'ok' if ok else 'FAIL'}")
    torch.cuda.synchronize()
    print("cases failed:", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
