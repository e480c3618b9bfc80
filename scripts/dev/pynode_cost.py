#!/usr/bin/env python3
"""Issue 16: what one Python autograd node costs on the host, against ATen's C++ node, in a chain of
GroupNorm layers (the UNet2DModel step has 51). Variants, each a chain of --layers layers on one
tensor, forward then backward, host time per layer (tiny tensors, so the GPU runs behind):

  cpp         F.group_norm (ATen kernels, C++ node NativeGroupNormBackward0)
  py_saved    ATen's kernels behind a Python autograd.Function (save_for_backward)
  py_attr     the same, tensors kept as ctx attributes (no SavedVariable unpack)
  py_noop     a Python node whose backward returns dy (the node's floor, no kernel)
  gnext       groupnorm_ext.group_norm (the functional API's eager entry)
  gnext_act   groupnorm_ext.group_norm_act(..., "silu") against cpp_silu, F.group_norm + F.silu
  gnext_act_pyapply   the same through torch.autograd.Function.apply's Python layer (torch < 2.14),
              which the eager entry skips (groupnorm_ext._autograd._c_apply)

Rounds interleave the variants; median and min-max per layer. Diagnostic only.
    python scripts/dev/pynode_cost.py [--device cuda] [--layers 51] [--rounds 30]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import groupnorm_ext as ge  # noqa: E402

G = 8


def native(x, g, w, b, eps):
    n, c = x.shape[:2]
    return torch.ops.aten.native_group_norm(x, w, b, n, c, x.numel() // (n * c), g, eps)


def native_bwd(dy, x, w, m, r, g, need):
    n, c = x.shape[:2]
    return torch.ops.aten.native_group_norm_backward(dy.contiguous(), x, m, r, w, n, c, x.numel() // (n * c), g,
                                                     [need[0], need[2], need[3]])


class PyNodeGroupNorm(torch.autograd.Function):
    """F.group_norm(x, g, w, b, eps) through ATen's kernels with a Python backward node (py_saved here,
    eager_pynode in unet_attribution.py)."""

    @staticmethod
    def forward(ctx, x, g, w, b, eps):
        out, m, r = native(x, g, w, b, eps)
        ctx.save_for_backward(x, w, m, r)
        ctx.g = g
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w, m, r = ctx.saved_tensors
        dx, dw, db = native_bwd(dy, x, w, m, r, ctx.g, ctx.needs_input_grad)
        return dx, None, dw, db, None


class Attr(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, w, b, eps):
        out, m, r = native(x, g, w, b, eps)
        ctx.t = (x, w, m, r)
        ctx.g = g
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w, m, r = ctx.t
        dx, dw, db = native_bwd(dy, x, w, m, r, ctx.g, ctx.needs_input_grad)
        return dx, None, dw, db, None


class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, w, b, eps):
        return native(x, g, w, b, eps)[0]

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None, None, None


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=51)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--shape", default="2,32,4,4")
    a = p.parse_args()
    dev = a.device
    shape = tuple(int(s) for s in a.shape.split(","))
    x0 = torch.randn(shape, device=dev) + 1
    w = torch.randn(shape[1], device=dev, requires_grad=True)
    b = torch.randn(shape[1], device=dev, requires_grad=True)
    ag = ge._autograd
    c_apply, ag._c_apply = ag._c_apply, (lambda cls: cls.apply)
    act_pyapply = ag._eager("group_norm_act", *ag._OPS["group_norm_act"])
    ag._c_apply = c_apply
    variants = {
        "cpp": lambda x: F.group_norm(x, G, w, b),
        "py_saved": lambda x: PyNodeGroupNorm.apply(x, G, w, b, 1e-5),
        "py_attr": lambda x: Attr.apply(x, G, w, b, 1e-5),
        "py_noop": lambda x: Noop.apply(x, G, w, b, 1e-5),
        "gnext": lambda x: ge.group_norm(x, G, w, b),
        "cpp_silu": lambda x: F.silu(F.group_norm(x, G, w, b)),
        "gnext_act": lambda x: ge.group_norm_act(x, G, w, b, activation="silu"),
        "gnext_act_pyapply": lambda x: act_pyapply(x, G, w, b, 1e-5, "silu", None),
    }
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def run(f):
        x = x0.clone().requires_grad_()
        sync()
        t0 = time.perf_counter()
        y = x
        for _ in range(a.layers):
            y = f(y)
        loss = y.sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        return (t1 - t0) / a.layers * 1e6, (t2 - t1) / a.layers * 1e6, (t3 - t0) / a.layers * 1e6

    for f in variants.values():
        for _ in range(3):
            run(f)
    res = {k: ([], [], []) for k in variants}
    for _ in range(a.rounds):
        for k, f in variants.items():
            for lst, v in zip(res[k], run(f)):
                lst.append(v)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {dev}, x {shape} G={G}, {a.layers} layers, {a.rounds} rounds")
    print(f"{'variant':18s} {'fwd us/layer':>22s} {'backward() us/layer':>22s} {'total+sync us/layer':>22s}")
    for k, (fw, bw, tot) in res.items():
        cells = [f"{statistics.median(v):7.1f} [{min(v):5.1f}-{max(v):5.1f}]" for v in (fw, bw, tot)]
        print(f"{k:18s} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
