#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Small driver for compute-sanitizer (scripts/dev/sanitize.sh): forward + backward of gnext's
GroupNorm on shapes that take every kernel family (one-pass NCHW/NHWC with and without inter-CTA
waits, two-pass NCHW/NHWC, the channels_last wide forward, small groups (a CTA per group too), HxW = 1), each checked against float64 so that a sanitizer run also
fails on wrong results; then group_norm_act and the fused conv op (the kernels' pointwise modes), and
group_norm_act_pad's padded passes.
Sizes are small: the sanitizers slow kernels down 10-100x."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
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
    ((32, 256, 8, 8), 32, torch.float16, None),  # many small groups: 4 CTAs per SM (forward and backward)
    ((32, 128, 7, 7), 16, torch.bfloat16, None),  # the same, ragged forward (HxW = 49, D*HxW = 392)
    ((2, 64, 33, 37), 8, torch.float16, CL),  # HxW >= 1024: the NHWC reduction's min-rows chunks (38 rows)
    ((12, 768, 7, 7), 12, torch.bfloat16, None),  # a CTA per group: 392 vectors straddling channels
    ((36, 256, 8, 8), 4, torch.float32, None),  # a CTA per group: 1024 vectors (4 per thread)
]


def set_knob(name, value):
    """One planner knob (GNEXT_* name) set over the current ones (groupnorm_ext.set_tuning)."""
    groupnorm_ext.set_tuning({**groupnorm_ext.tuning(), name: int(value)})


def pointwise_cases():
    """group_norm_act (epilogue modes, residual) and the fused ConvTranspose2d+GELU+GroupNorm op
    (prologue modes) on both kernel paths, forward and backward, vs float64."""
    import torch.nn.functional as F

    acts = {"silu": F.silu, "tanh_hardswish": lambda t: F.hardswish(torch.tanh(t))}
    bad = 0
    for onepass in ("2", "0"):  # 2: one-pass wherever it fits (NHWC too)
        set_knob("GNEXT_ONEPASS", onepass)
        for shape, G, fmt in (((4, 64, 24, 24), 8, None), ((2, 64, 12, 12), 8, CL), ((12, 768, 7, 7), 12, None)):
            g = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(shape, device="cuda", generator=g) * 3 + 2
            r = torch.randn(shape, device="cuda", generator=g)
            if fmt is not None:
                x, r = x.contiguous(memory_format=fmt), r.contiguous(memory_format=fmt)
            w = torch.rand(shape[1], device="cuda", generator=g) + 0.5
            b = torch.randn(shape[1], device="cuda", generator=g)
            dy = torch.randn(shape, device="cuda", generator=g)
            for act, fn in acts.items():
                y, mean, rstd = torch.ops.gnext.group_norm_act(x, G, w, b, 1e-5, act, r)
                dx, dw, db = torch.ops.gnext.group_norm_act_backward(dy, x, mean, rstd, w, b, G, act, [True, True, True])
                xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
                ref = fn(F.group_norm(xd, G, wd, bd, 1e-5)) + r.double()
                rg = torch.autograd.grad(ref, (xd, wd, bd), dy.double())
                err = max(((a.double() - e).norm() / e.norm()).item() for a, e in zip((y, dx, dw, db), (ref, *rg)))
                ok = err < 1e-4
                bad += not ok
                print(f"onepass={onepass} group_norm_act {act} {shape} {fmt}: max rel err {err:.1e} {'ok' if ok else 'FAIL'}")
            xc = torch.randn(2, 16, 9, 11, device="cuda", generator=g)
            wc = torch.randn(16, 32, 3, 3, device="cuda", generator=g) * 0.1
            cb = torch.randn(32, device="cuda", generator=g)
            torch.backends.cudnn.allow_tf32 = False
            out, z, m, s, _ = torch.ops.gnext.conv_transpose2d_gelu_group_norm(
                xc, wc, cb, [2, 2], [1, 1], [1, 1], [1, 1], 1, 8, None, None, 1e-5, "tanh")
            dyc = torch.randn(out.shape, device="cuda", generator=g)
            grads = torch.ops.gnext.conv_transpose2d_gelu_group_norm_backward(
                dyc, xc, wc, cb, z, m, s, None, [2, 2], [1, 1], [1, 1], [1, 1], 1, 8, "tanh", [True, True, True, False, False])
            xd, wd, cbd = (t.double().requires_grad_() for t in (xc, wc, cb))
            ref = F.group_norm(F.gelu(F.conv_transpose2d(xd, wd, cbd, 2, 1, 1), approximate="tanh"), 8)
            rg = torch.autograd.grad(ref, (xd, wd, cbd), dyc.double())
            err = max(((a.double() - e).norm() / e.norm()).item() for a, e in zip((out, *grads[:3]), (ref, *rg)))
            ok = err < 1e-4
            bad += not ok
            print(f"onepass={onepass} conv_transpose2d_gelu_group_norm: max rel err {err:.1e} {'ok' if ok else 'FAIL'}")
    return bad


def lse_cases():
    """group_norm_act_logsumexp forward and backward (all three kernel phases): NCHW, channels_last with
    vector loads, channels_last with scalar loads (C = 12 half), C above the block size, vs float64."""
    import torch.nn.functional as F

    bad = 0
    for shape, G, dtype, fmt in (((2, 64, 13, 11), 16, torch.float32, None), ((2, 64, 13, 11), 16, torch.float32, CL),
                                 ((2, 12, 7, 5), 3, torch.float16, CL), ((1, 520, 3, 5), 8, torch.float32, CL)):
        g = torch.Generator(device="cuda").manual_seed(2)
        x = (torch.randn(shape, device="cuda", generator=g) * 3 + 2).to(dtype)
        if fmt is not None:
            x = x.contiguous(memory_format=fmt)
        ib, w, b = (torch.randn(shape[1], device="cuda", generator=g).to(dtype) for _ in range(3))
        out, mean, rstd = torch.ops.gnext.group_norm_act_logsumexp(x, ib, G, w, b, 1e-5, "tanh_hardswish", True)
        dy = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
        grads = torch.ops.gnext.group_norm_act_logsumexp_backward(dy, out, x, ib, mean, rstd, w, b, G, "tanh_hardswish",
                                                                 True, [True, True, True, True])
        xd, ibd, wd, bd = (t.double().requires_grad_() for t in (x, ib, w, b))
        v = xd + ibd.view(1, -1, 1, 1)
        ref = torch.logsumexp(F.hardswish(torch.tanh(F.group_norm(v, G, wd, bd, 1e-5))) + v, 1, keepdim=True)
        rg = torch.autograd.grad(ref, (xd, ibd, wd, bd), dy.double())
        err = max(((a.double() - e).norm() / e.norm()).item() for a, e in zip((out, *grads), (ref, *rg)))
        ok = err < (1e-4 if dtype == torch.float32 else 2e-2)
        bad += not ok
        print(f"group_norm_act_logsumexp {shape} {dtype} {fmt}: max rel err {err:.1e} {'ok' if ok else 'FAIL'}")
    return bad


def pad_cases():
    """group_norm_act_pad's forward on its three padded passes (the tile kernel, the row kernel, the flat kernel),
    replicate and constant padding, vs float64 (F.pad of the activated GroupNorm)."""
    import torch.nn.functional as F

    bad = 0
    for tile, shape, pad in (("2", (1, 8, 3, 21, 256), (1, 1, 1, 1, 2, 0)), ("2", (2, 4, 2, 5, 64), (3, 2, 1, 2, 1, 1)),
                             ("0", (1, 8, 2, 7, 520), (1, 1, 1, 1, 2, 0)), ("0", (2, 4, 3, 9, 30), (1, 1, 1, 1, 2, 0))):
        set_knob("GNEXT_PAD_TILE", tile)
        g = torch.Generator(device="cuda").manual_seed(3)
        x = (torch.randn(shape, device="cuda", generator=g) * 3 + 2).half()
        w = torch.rand(shape[1], device="cuda", generator=g) + 0.5
        b = torch.randn(shape[1], device="cuda", generator=g)
        for mode, value in (("replicate", 0.0), ("constant", -0.5)):
            out = torch.ops.gnext.group_norm_act_pad(x, 4, w, b, 1e-5, "silu", list(pad), mode, value, None)[0]
            y = F.silu(F.group_norm(x.double(), 4, w.double(), b.double(), 1e-5))
            ref = F.pad(y, pad, mode=mode, value=value) if mode == "constant" else F.pad(y, pad, mode=mode)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ok = err < 2e-3
            bad += not ok
            print(f"pad_tile={tile} group_norm_act_pad {shape} {mode}: max rel err {err:.1e} {'ok' if ok else 'FAIL'}")
    set_knob("GNEXT_PAD_TILE", "-1")
    return bad


def main():
    bad = lse_cases()
    if os.environ.get("GNEXT_SANITIZE_ONLY") == "lse":  # only the group_norm_act_logsumexp kernels
        print(f"{bad} failing case(s)")
        sys.exit(1 if bad else 0)
    bad += pad_cases()
    if os.environ.get("GNEXT_SANITIZE_ONLY") == "pad":  # only group_norm_act_pad's kernels (and the statistics')
        print(f"{bad} failing case(s)")
        sys.exit(1 if bad else 0)
    # 2: one-pass wherever it fits (NHWC too); 0: two-pass; wide: the channels_last wide forward
    for onepass in ("2", "0", "wide"):
        set_knob("GNEXT_ONEPASS", "0" if onepass == "wide" else onepass)
        set_knob("GNEXT_WIDE_NHWC", "2" if onepass == "wide" else "1")
        for shape, G, dtype, fmt in CASES:
            if onepass == "wide" and fmt is None:
                continue
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
    bad += pointwise_cases()
    torch.cuda.synchronize()
    print("cases failed:", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
