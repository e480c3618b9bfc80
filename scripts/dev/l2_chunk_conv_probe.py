"""Issue 18: does the fused ConvTranspose2d+GELU+GroupNorm get faster run a few images at a time?

GroupNorm's unit of statistics is one image's groups, and one image of L2#19's conv output z
(64x258x258 fp32, 17 MB) fits in the H100's 50 MB L2. Run the op over chunks of k images and the
statistics pass and the elementwise pass could read z from L2 rather than DRAM (forward), and the
backward's dx pass, conv-bias sum and data/weight gradients could read dz from L2. Each chunk's
launches ramp up and drain, which costs something back. This probe measures it with gnext's existing
op called once per chunk on views (outputs discarded), against one call over the whole batch, forward
(no_grad, the KernelBench timing) and backward, CUDA events with the L2 flushed before each timed call,
every variant replayed from a CUDA graph (and the forward chunk loop also launched from Python, to
show its host time), in one process. Diagnostic; no product code uses it.
    python scripts/dev/l2_chunk_conv_probe.py [--batch 128] [--chunks 1,2,4,8]
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
from timing import Timer, copy_bandwidth, cuda_graph  # noqa: E402

import groupnorm_ext  # noqa: E402,F401

fused = torch.ops.gnext.conv_transpose2d_gelu_group_norm.default
fused_bwd = torch.ops.gnext.conv_transpose2d_gelu_group_norm_backward.default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--chunks", default="1,2,4,8")
    args = ap.parse_args()
    dev = "cuda"
    timer = Timer(dev)
    bw = copy_bandwidth(dev, timer)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s, "
          f"TF32 (cuDNN) {torch.backends.cudnn.allow_tf32}")
    torch.manual_seed(0)
    N, C, H, W, K, G = args.batch, 64, 256, 256, 3, 8
    x = torch.rand(N, C, H, W, device=dev).to(memory_format=torch.channels_last)
    w = torch.randn(C, C, K, K, device=dev) * 0.05
    cb = torch.randn(C, device=dev) * 0.1
    gw = torch.randn(C, device=dev) + 1
    gb = torch.randn(C, device=dev)
    conv_args = ([1, 1], [0, 0], [0, 0], [1, 1], 1)

    def fwd_on(s):
        return fused(x[s], w, cb, *conv_args, G, gw, gb, 1e-5, "none")

    with torch.no_grad():
        out, z, mean, rstd, _ = fwd_on(slice(0, N))
    dy = torch.randn_like(out)
    mask = [True] * 5

    def bwd_on(s):
        return fused_bwd(dy[s], x[s], w, cb, z[s], mean[s], rstd[s], gw, *conv_args, G, "none", mask)

    def conv_on(s):
        return F.conv_transpose2d(x[s], w)

    def graphed(fn):
        with torch.no_grad():
            return cuda_graph(fn).replay

    def loop(fn, k):
        def run():
            for n0 in range(0, N, k):
                fn(slice(n0, n0 + k))
        return run

    whole = slice(0, N)
    zbytes = z.numel() * 4
    print(f"== L2#19 {N}x{C}x{H}x{W} fp32 channels_last, z {zbytes / 1e9:.2f} GB ({zbytes / N / 1e6:.1f} MB "
          f"per image); floor fwd (read x + write out) {(x.numel() * 4 + zbytes) / bw / 1e6:.3f} ms")
    with torch.no_grad():
        base = (timer(graphed(lambda: conv_on(whole))), timer(graphed(lambda: fwd_on(whole))),
                timer(lambda: fwd_on(whole)))
    bbase = timer(graphed(lambda: bwd_on(whole)))
    print(f"   {'whole batch':24s} conv {base[0]:7.3f}  fwd graph {base[1]:7.3f}  fwd eager {base[2]:7.3f}  "
          f"bwd graph {bbase:7.3f} ms")
    for k in (int(c) for c in args.chunks.split(",")):
        with torch.no_grad():
            t = (timer(graphed(loop(conv_on, k))), timer(graphed(loop(fwd_on, k))), timer(loop(fwd_on, k)))
        tb = timer(graphed(loop(bwd_on, k)))
        print(f"   {f'chunks of {k} image(s)':24s} conv {t[0]:7.3f}  fwd graph {t[1]:7.3f}  fwd eager {t[2]:7.3f}  "
              f"bwd graph {tb:7.3f} ms   (x whole: fwd {base[1] / t[1]:.2f}, bwd {bbase / tb:.2f})")


if __name__ == "__main__":
    main()
