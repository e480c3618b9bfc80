# SPDX-License-Identifier: BSD-3-Clause
"""``python -m groupnorm_ext bench``: gnext against eager PyTorch and torch.compile on a few GroupNorm shapes
of real models, forward and forward+backward, on the visible GPU (or, without one, the CPU path against
eager). Times are medians in ms: ``triton.testing.do_bench`` on the GPU (L2 flushed between calls),
``torch.utils.benchmark`` on the CPU. It takes well under a minute on an H100; the full benchmarks are
``scripts/bench`` in the source tree (docs/benchmarks.md)."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import functional as gf

# (name, (N, C, *spatial), G, dtype, channels_last, activation)
GPU_SHAPES = [
    ("SD VAE decoder", (1, 128, 1024, 1024), 32, torch.float16, False, "silu"),
    ("SD VAE, channels_last", (1, 128, 1024, 1024), 32, torch.float16, True, "silu"),
    ("SD UNet", (2, 320, 64, 64), 32, torch.float16, False, "silu"),
    ("ResNet-50-GN", (32, 256, 56, 56), 32, torch.bfloat16, False, "identity"),
    ("video VAE 5D", (1, 128, 8, 128, 128), 32, torch.bfloat16, False, "silu"),
]
CPU_SHAPES = [
    ("SD UNet", (2, 320, 32, 32), 32, torch.float32, False, "silu"),
    ("ResNet-GN", (8, 256, 28, 28), 32, torch.float32, False, "identity"),
]


def _progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed: plain lines
        print(f"{desc} ({len(items)} steps; pip install tqdm for a progress bar)")
        return items
    return tqdm(items, desc=desc, leave=False)


def _table(rows, headers):
    try:
        from tabulate import tabulate
    except ImportError:
        cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r] for r in rows]
        widths = [max(len(v) for v in col) for col in zip(headers, *cells)]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in [headers, *cells])
    return tabulate(rows, headers=headers, tablefmt="github", floatfmt=".3f")


def _timer(device):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")
    from torch.utils.benchmark import Timer

    return lambda fn: 1e3 * Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median


def _eager(x, G, w, b, act):
    y = F.group_norm(x, G, w, b, 1e-5)
    return F.silu(y) if act == "silu" else y


def _gnext(x, G, w, b, act):
    return gf.group_norm_act(x, G, w, b, 1e-5, activation=act) if act != "identity" else gf.group_norm(x, G, w, b)


def run(device: str | None = None, compile: bool | None = None) -> int:
    """Runs the table; returns 0. device: "cuda" or "cpu" (default: cuda when available)."""
    t0 = time.perf_counter()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            print("no GPU visible: timing gnext's CPU path against eager PyTorch's (CUDA is where gnext is fast)")
    compile = device == "cuda" if compile is None else compile
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    timer = _timer(device)
    impls = {"eager": _eager, "gnext": _gnext}
    if compile:
        impls["compile"] = torch.compile(_eager, dynamic=False)
    results = {}
    steps = [(s, name) for s in shapes for name in impls]
    for (label, shape, G, dtype, cl, act), name in _progress(steps, "gnext bench"):
        g = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(shape, device=device, generator=g) * 2 + 1).to(dtype)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        w = torch.randn(shape[1], device=device, dtype=dtype, generator=g)
        b = torch.randn(shape[1], device=device, dtype=dtype, generator=g)
        dy = torch.randn_like(x)
        fn = impls[name]
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))

        def fwd_bwd():
            torch.autograd.grad(fn(xg, G, wg, bg, act), (xg, wg, bg), dy)

        with torch.no_grad():
            fwd = timer(lambda: fn(x, G, w, b, act))
        results[label, name] = (fwd, timer(fwd_bwd))
    rows = []
    for label, shape, G, dtype, cl, act in shapes:
        e, n = results[label, "eager"], results[label, "gnext"]
        row = [label, "x".join(map(str, shape)) + f" G={G}", str(dtype).replace("torch.", ""),
               "GN+SiLU" if act == "silu" else "GN", n[0], e[0]]
        if compile:
            row.append(results[label, "compile"][0])
        row += [n[1], e[1]]
        if compile:
            row.append(results[label, "compile"][1])
        row += [e[0] / n[0], e[1] / n[1]]
        if compile:
            row += [results[label, "compile"][0] / n[0], results[label, "compile"][1] / n[1]]
        rows.append(row)
    headers = ["model", "shape", "dtype", "op", "gnext fwd", "eager fwd"] + (["compile fwd"] if compile else [])
    headers += ["gnext f+b", "eager f+b"] + (["compile f+b"] if compile else [])
    headers += ["fwd x eager", "f+b x eager"] + (["fwd x compile", "f+b x compile"] if compile else [])
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: median ms; 'x' = their time / gnext's "
          f"({time.perf_counter() - t0:.0f} s)")
    print(_table(rows, headers))
    return 0
