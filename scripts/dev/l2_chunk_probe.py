"""Issue 17: does running the two-pass GroupNorm one L2-sized chunk at a time read x from DRAM once?

The two-pass forward reads x twice (statistics, then normalize) and writes y once. If the statistics
pass and the normalize pass run over one chunk of whole groups (NCHW: k consecutive groups of one
sample, a contiguous slab; NHWC: m whole samples) before the next chunk starts, and a chunk fits in the
50 MB L2, the second read could come from L2. This probe measures that with gnext's existing ops,
called once per chunk on views (outputs discarded), against one call over the whole tensor (its own
plan, and two-pass forced with GNEXT_ONEPASS=0), forward and backward, CUDA events with the L2 flushed
before each timed call, every variant replayed from a CUDA graph (the chunk loop's host time would
hide the GPU's), in one process. Diagnostic for the host-side chunk loop; no product code uses it.
    python scripts/dev/l2_chunk_probe.py
"""
from __future__ import annotations

import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
from timing import Timer, copy_bandwidth, cuda_graph, with_env  # noqa: E402

import groupnorm_ext  # noqa: E402,F401

gn, gn_bwd = torch.ops.gnext.group_norm.default, torch.ops.gnext.group_norm_backward.default

# (N, C, H, W), G, dtype, channels_last, chunk sizes (NCHW: groups per chunk; NHWC: samples per chunk)
CASES = [
    ((1, 128, 2048, 2048), 32, torch.bfloat16, False, (1, 2)),
    ((1, 256, 1024, 1024), 32, torch.bfloat16, False, (1, 2, 4)),
    ((1, 128, 1024, 1024), 32, torch.float16, False, (1, 2, 4)),
    ((112, 64, 512, 512), 8, torch.float32, False, (1, 2, 4)),
    ((16, 512, 128, 128), 32, torch.bfloat16, True, (1, 2)),
    ((8, 512, 256, 256), 32, torch.float16, True, (1,)),
]


def graphed(fn):
    """fn captured in a CUDA graph: the chunk loop's dozens of calls would otherwise be host-bound."""
    return cuda_graph(fn).replay


def nchw_slabs(t, G, k):
    """k consecutive groups of one sample as (1, k*D, HxW) views, with their channel offset."""
    N, C = t.shape[:2]
    D = C // G
    v = t.reshape(N, G // k, k * D, -1)
    return [(v[n, j].unsqueeze(0), j * k * D) for n in range(N) for j in range(G // k)]


def main():
    dev = "cuda"
    timer = Timer(dev)

    def two_pass(fn):
        """Median ms of fn replayed from a CUDA graph captured with GNEXT_ONEPASS=0."""
        return with_env(lambda: timer(graphed(fn)), GNEXT_ONEPASS="0")()
    bw = copy_bandwidth(dev, timer)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s")
    for shape, G, dtype, cl, chunks in CASES:
        torch.manual_seed(0)
        x = (torch.randn(shape, device=dev, dtype=dtype) + 3)
        if cl:
            x = x.to(memory_format=torch.channels_last)
        C = shape[1]
        w = torch.randn(C, device=dev, dtype=dtype)
        b = torch.randn(C, device=dev, dtype=dtype)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        fwd_floor = 2 * nbytes / bw / 1e6  # ms: read x + write y
        bwd_floor = 3 * nbytes / bw / 1e6  # read x, dy + write dx
        _, mean0, rstd0 = gn(x, G, w, b, 1e-5)
        name = f"{'x'.join(map(str, shape))} G={G} {str(dtype)[6:]}{' CL' if cl else ''} ({nbytes / 1e6:.0f} MB)"
        fwd_all = lambda: gn(x, G, w, b, 1e-5)  # noqa: E731
        bwd_all = lambda: gn_bwd(dy, x, mean0, rstd0, w, G, [True, True, True])  # noqa: E731
        rows = [("whole, own plan", timer(graphed(fwd_all)), timer(graphed(bwd_all))),
                ("whole, two-pass", two_pass(fwd_all), two_pass(bwd_all))]
        for k in chunks:
            if cl:
                N = shape[0]
                parts = [(slice(n, n + k), None) for n in range(0, N, k)]

                def fwd(parts=parts):
                    for s, _ in parts:
                        gn(x[s], G, w, b, 1e-5)

                def bwd(parts=parts):
                    for s, _ in parts:
                        gn_bwd(dy[s], x[s], mean0[s], rstd0[s], w, G, [True, True, True])
                label = f"chunks of {k} sample(s) ({nbytes * k / shape[0] / 1e6:.1f} MB)"
            else:
                xs, dys = nchw_slabs(x, G, k), nchw_slabs(dy, G, k)
                D = C // G
                ms, rs = mean0.reshape(-1, k), rstd0.reshape(-1, k)

                def fwd(xs=xs, k=k, D=D):
                    for s, c0 in xs:
                        gn(s, k, w[c0:c0 + k * D], b[c0:c0 + k * D], 1e-5)

                def bwd(xs=xs, dys=dys, ms=ms, rs=rs, k=k, D=D):
                    for i, ((s, c0), (d, _)) in enumerate(zip(xs, dys)):
                        gn_bwd(d, s, ms[i:i + 1], rs[i:i + 1], w[c0:c0 + k * D], k, [True, True, True])
                label = f"chunks of {k} group(s) ({nbytes * k / (shape[0] * G) / 1e6:.1f} MB)"
            rows.append((label, two_pass(fwd), two_pass(bwd)))
        print(f"== {name}: floor fwd {fwd_floor:.3f} ms (1R+1W), f+b-part bwd {bwd_floor:.3f} ms (2R+1W)")
        for label, f, bk in rows:
            print(f"   {label:38s} fwd {f:8.3f} ms ({fwd_floor / f:.2f} of floor)   bwd {bk:8.3f} ms "
                  f"({bwd_floor / bk:.2f} of floor)")
        x = dy = None  # free before the next case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
