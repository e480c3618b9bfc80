"""Why does gnext lose forward+backward to eager on small shapes in the sweep? Per shape, gnext vs
F.group_norm, one process, three views of the same `torch.autograd.grad(gn(x), (x, w, b), dy)` call:
  * host:  wall us per call with the GPU synchronized only after 100 calls (host enqueue bound);
  * event: the sweep's Timer (CUDA events around one call, the L2 flushed before it);
  * gpu:   summed kernel time per call from torch.profiler, with the kernel count.
  python scripts/dev/fb_small_probe.py [--shape N,C,H,W:G:dtype[:cl]] ..."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import groupnorm_ext as ge  # noqa: E402
from host_overhead import host_us  # noqa: E402
from timing import Timer, make_inputs  # noqa: E402

DEFAULT = ["2,1280,8,8:32:float16", "2,640,32,32:32:float16:cl", "5,60,31,29:15:float16",
           "2,320,8,32,32:32:float16", "64,512,1,1:32:float16:cl", "16,4096,4,4:64:float16",
           "4,100,10,10:10:float16", "2,320,64,64:32:float16", "1024,512,4,4:32:float16",
           "256,256,7,7:32:float32", "256,1024,1,1:32:bfloat16"]


def parse(s):
    parts = s.split(":")
    shape = tuple(int(v) for v in parts[0].split(","))
    fmt = None
    if len(parts) > 3 and parts[3] == "cl":
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    return shape, int(parts[1]), getattr(torch, parts[2]), fmt


def gpu_us(fn, reps=20):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = sorted({e.name[:60] for e in evs})
    return sum(e.device_time for e in evs) / reps, len(evs) / reps, names


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", action="append", default=None)
    p.add_argument("--names", action="store_true", help="print the kernel names")
    args = p.parse_args()
    timer = Timer("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; us per f+b call")
    print(f"{'shape':34s} {'host gnext':>10s} {'host eager':>10s} {'event gnext':>11s} {'event eager':>11s} "
          f"{'gpu gnext (k)':>14s} {'gpu eager (k)':>14s}")
    for s in args.shape or DEFAULT:
        shape, G, dtype, fmt = parse(s)
        x, w, b, dy = make_inputs(shape, dtype, fmt, "cuda")
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
        fns = {k: (lambda f=f: torch.autograd.grad(f(xg, G, wg, bg, 1e-5), (xg, wg, bg), dy))
               for k, f in (("gnext", ge.group_norm), ("eager", F.group_norm))}
        h = host_us(fns, 100, sync_inside=False)
        ev = {k: statistics.median(timer(f, budget_s=0.1) for _ in range(5)) * 1e3 for k, f in fns.items()}
        g = {k: gpu_us(f) for k, f in fns.items()}
        print(f"{s:34s} {h['gnext']:10.1f} {h['eager']:10.1f} {ev['gnext']:11.1f} {ev['eager']:11.1f} "
              f"{g['gnext'][0]:9.1f} ({g['gnext'][1]:.0f}) {g['eager'][0]:9.1f} ({g['eager'][1]:.0f})")
        if args.names:
            for k in g:
                print(f"    {k}: " + " | ".join(g[k][2]))


if __name__ == "__main__":
    main()
