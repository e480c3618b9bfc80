"""Issue 16: where does the converted UNet2DModel bf16 training step lose to eager? Variants that each
remove one suspected cause, timed in the same process in rounds of random order (wall time per step,
host + GPU), reported as per-round ratios to eager:

  eager        the original model
  gnext        convert_group_norm_act(model) (what real_models.py times)
  gnext_nchw   the same, with each gnext norm's input made NCHW-contiguous first: diffusers' attention
               block returns a channels_last-strided tensor (a reshape of a transpose); eager's CUDA
               GroupNorm turns it back to NCHW, gnext keeps it channels_last, so the convolutions after
               it run channels_last with NCHW weights (weight copies, gradient copies)
  gnext_plain  convert_group_norm(model): GroupNorm only, no activation fusion, no block forward
  eager_nogc / gnext_nogc   Python's garbage collector off during the step (autograd.Function
               contexts are GC-tracked Python objects; ATen's nodes are not)
  gnext_pyapply  gnext with its eager entry calling torch.autograd.Function.apply's Python layer
               (torch < 2.14), as before groupnorm_ext._autograd._c_apply
  aten_gnext   the original model with ATen's CUDA kernels of aten::native_group_norm and its backward
               replaced (torch.library, Python kernels) by gnext's ops: ATen's C++ autograd node, gnext's
               kernels, no activation fusion; on only while this variant is timed
  eager_pynode eager's own kernels (aten::native_group_norm and its backward) behind a Python
               autograd.Function per nn.GroupNorm, as gnext's nodes are (the stable ABI has no C++
               autograd): what a Python backward node costs in this step, without gnext's kernels

Besides wall time, the process CPU time per step (time.process_time: every thread, the autograd
engine's included) is reported: host work that the machine's run-to-run noise in wall time hides.

    python scripts/dev/unet_attribution.py [--rounds 15] [--row unet2d-train-bf16]
Diagnostic; the product table comes from scripts/bench/real_models.py.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import random
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
import groupnorm_ext as ge  # noqa: E402
from real_models import _cast, build, step_fn, wall_ms  # noqa: E402

from pynode_cost import PyNodeGroupNorm  # noqa: E402  (this folder, first on sys.path when run as a script)


def nchw_inputs(model):
    """Every gnext norm module of model makes its input contiguous (NCHW) before normalizing."""
    for m in model.modules():
        if isinstance(m, (ge.GroupNorm, ge.GroupNormAct)):
            cls_forward = type(m).forward
            m.forward = types.MethodType(lambda self, x, *a, _f=cls_forward: _f(self, x.contiguous(), *a), m)
    return model


def py_nodes(model):
    """Every nn.GroupNorm of model runs PyNodeGroupNorm (ATen's kernels, a Python autograd node)."""
    for m in model.modules():
        if type(m) is torch.nn.GroupNorm:
            m.forward = types.MethodType(
                lambda self, x: PyNodeGroupNorm.apply(x.contiguous(), self.num_groups, self.weight, self.bias,
                                                      self.eps), m)
    return model


def py_apply(fn):
    """fn with the functional API's eager entries built on torch.autograd.Function.apply (Python layer)."""
    from groupnorm_ext import _autograd as ag, functional
    c_apply, ag._c_apply = ag._c_apply, (lambda cls: cls.apply)
    entries = {op: ag._eager(op, *ag._OPS[op]) for op in ("group_norm", "group_norm_act")}
    ag._c_apply = c_apply

    def run():
        saved = functional._group_norm, functional._group_norm_act
        functional._group_norm, functional._group_norm_act = entries["group_norm"], entries["group_norm_act"]
        try:
            return fn()
        finally:
            functional._group_norm, functional._group_norm_act = saved
    return run


class AtenGnext:
    """aten::native_group_norm / native_group_norm_backward on CUDA run gnext's ops while entered. Mean and
    rstd are returned in ATen's dtype (input's, or float32 when weight's dtype differs)."""

    def __enter__(self):
        self.lib = torch.library.Library("aten", "IMPL")
        gn, gnb = torch.ops.gnext.group_norm.default, torch.ops.gnext.group_norm_backward.default

        def fwd(x, w, b, N, C, HxW, group, eps):
            y, mean, rstd = gn(x, group, w, b, eps)
            dt = x.dtype if w is None or w.dtype == x.dtype else torch.float32
            if dt != torch.float32:
                mean, rstd = mean.to(dt), rstd.to(dt)
            return y, mean, rstd

        def bwd(dy, x, mean, rstd, w, N, C, HxW, group, mask):
            return gnb(dy, x, mean.float(), rstd.float(), w, group, mask)

        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lib.impl("native_group_norm", fwd, "CUDA")
            self.lib.impl("native_group_norm_backward", bwd, "CUDA")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()


def no_gc(fn):
    def run():
        gc.disable()
        try:
            return fn()
        finally:
            gc.enable()
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--row", default="unet2d-train-bf16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--variants", default="", help="comma-separated subset (eager always kept)")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, row {args.row}")
    # aten_gnext gives eager's results: a bf16 GroupNorm forward + backward with and without it
    xs = (torch.randn(4, 64, 16, 16, device="cuda") * 2 + 1).bfloat16().requires_grad_()
    ws = (torch.rand(64, device="cuda") + 0.5).bfloat16().requires_grad_()
    bs = torch.randn(64, device="cuda").bfloat16().requires_grad_()
    dys = torch.randn(4, 64, 16, 16, device="cuda").bfloat16()
    res = []
    for ctx in (contextlib.nullcontext, AtenGnext):
        with ctx():
            ys = torch.nn.functional.group_norm(xs, 16, ws, bs)
            res.append([ys.float(), *(g.float() for g in torch.autograd.grad(ys, (xs, ws, bs), dys))])
    print("aten_gnext vs eager, max |diff| / max |eager| (y, dx, dw, db):",
          " ".join(f"{((a - b).abs().max() / b.abs().max()).item():.1e}" for a, b in zip(res[1], res[0])))
    model32, inputs32, dtype, fmt, train = build(args.row, "cuda", False)
    inputs = _cast(inputs32, dtype, fmt)
    orig = copy.deepcopy(model32).to(dtype).to(memory_format=fmt)
    conv = ge.convert_group_norm_act(copy.deepcopy(orig))
    fns = {"eager": step_fn(orig, inputs, train),
           "gnext": step_fn(conv, inputs, train),
           "gnext_nchw": step_fn(nchw_inputs(ge.convert_group_norm_act(copy.deepcopy(orig))), inputs, train),
           "gnext_plain": step_fn(ge.convert_group_norm(copy.deepcopy(orig)), inputs, train)}
    fns["eager_nogc"], fns["gnext_nogc"] = no_gc(fns["eager"]), no_gc(fns["gnext"])
    fns["eager_pynode"] = step_fn(py_nodes(copy.deepcopy(orig)), inputs, train)
    fns["gnext_pyapply"] = py_apply(step_fn(ge.convert_group_norm_act(copy.deepcopy(orig)), inputs, train))
    fns["aten_gnext"] = step_fn(copy.deepcopy(orig), inputs, train)
    around = {v: contextlib.nullcontext for v in fns}
    around["aten_gnext"] = AtenGnext
    if args.variants:
        keep = ["eager", *[v for v in args.variants.split(",") if v != "eager"]]
        fns = {v: fns[v] for v in keep}
    for v, f in fns.items():
        with around[v]():
            for _ in range(3):
                f()
    sync = torch.cuda.synchronize
    n = max(1, int(300 / max(wall_ms(fns["eager"], sync, 1), 1e-3)))
    rng = random.Random(0)
    times = {v: [] for v in fns}
    cpu = {v: [] for v in fns}
    for r in range(args.rounds):
        order = list(fns)
        rng.shuffle(order)
        for v in order:
            with around[v]():
                c0 = time.process_time()
                times[v].append(wall_ms(fns[v], sync, n))
                cpu[v].append((time.process_time() - c0) / n * 1e3)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    for name, t_all in (("wall", times), ("process CPU", cpu)):
        print(f"\n{name} time per step")
        print(f"{'variant':12s} {'ms/step':>8s} {'[min..max]':>16s}   eager/variant per round: median [min..max] wins")
        for v, t in t_all.items():
            ratios = [e / x for e, x in zip(t_all["eager"], t)]
            print(f"{v:12s} {statistics.median(t):8.2f} [{min(t):6.2f}..{max(t):6.2f}]   "
                  f"{statistics.median(ratios):.3f} [{min(ratios):.2f}..{max(ratios):.2f}] "
                  f"{sum(x > 1 for x in ratios)}/{len(ratios)}")
        if "gnext" not in t_all:
            continue
        base = t_all["gnext"]
        for v in [v for v in fns if v.startswith("gnext_") or v == "aten_gnext"]:
            ratios = [g / x for g, x in zip(base, t_all[v])]
            print(f"gnext/{v}: {statistics.median(ratios):.3f} [{min(ratios):.2f}..{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
