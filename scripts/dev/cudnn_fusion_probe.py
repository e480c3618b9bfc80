#!/usr/bin/env python3
"""Issue 18, lead 1: can cuDNN's runtime-fusion engines give GroupNorm its statistics from the conv itself?

Builds cuDNN frontend graphs (Python API, pip `nvidia-cudnn-frontend`) for the conv of KernelBench L2#19
(ConvTranspose2d 64 -> 64, 3x3, stride 1, on 128x64x256x256 fp32, channels_last) with epilogues of
growing length, asks cuDNN which it supports on this GPU, checks the supported ones against PyTorch and
times them next to PyTorch's own F.conv_transpose2d (cuDNN, channels_last), all in one process:

  dgrad               the transposed conv as cuDNN sees it: the data gradient of a conv
  dgrad+bias+gelu     a = GELU(z + b) written out (the tensor GroupNorm normalizes)
  ... +genstats       plus BatchNorm-style per-channel sums over N, H, W ([1, C, 1, 1]: not what GN needs)
  ... +reduce(n,c)    plus per-(n, c) sums of a and a^2 ([N, C, 1, 1]: what GN needs)
  fprop-form ...      the same epilogues on conv_fprop with the flipped, transposed weight and padding k-1
                      (equal to the stride-1 transposed conv), where cuDNN's fusion engines are broadest

Each row prints whether cuDNN took the graph (and its error otherwise), the engine, the max relative
error of every output against PyTorch (float64 sums), and the median time (CUDA events) against
F.conv_transpose2d + bias. Diagnostic for docs/kernels.md and the issue's closing note; no product code
depends on it.
    python scripts/dev/cudnn_fusion_probe.py [--batch 128] [--reps 10]
Needs a GPU and `import cudnn`: the frontend's wheel for this Python with cuda-bindings and
cuda-pathfinder (`pip download --no-deps nvidia-cudnn-frontend cuda-bindings cuda-pathfinder
--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d .probe`; on the GPU machine
`pip install --no-deps --target /tmp/probe .probe/*.whl` and PYTHONPATH=/tmp/probe for this script only).
Checked on the CPU machine only up to graph construction (validate needs a driver)."""
from __future__ import annotations

import argparse
import statistics
import traceback

import torch
import torch.nn.functional as F


def timed(fn, reps):
    """Median ms of fn() over reps calls (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def rel_err(got, ref):
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def build(cudnn, handle, x, w, form, epilogue, out_hw):
    """A cuDNN graph for one probe row; returns (graph, {name: graph tensor}) or raises. w: the weight in
    the form's layout (dgrad: ConvTranspose2d's [Cin, C, R, S]; fprop: flipped and transposed, [C, Cin, R, S])."""
    FLOAT = cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=FLOAT, intermediate_data_type=FLOAT, compute_data_type=FLOAT, handle=handle)
    N = x.shape[0]
    C = w.shape[1] if form == "dgrad" else w.shape[0]
    k = w.shape[2]
    H, W = out_hw
    X = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=FLOAT)
    Wt = g.tensor(name="w", dim=list(w.shape), stride=list(w.stride()), data_type=FLOAT)
    if form == "dgrad":  # z = conv_dgrad(loss=x, filter=w): the transposed conv, w as [K=Cin, C, R, S]
        Z = g.conv_dgrad(loss=X, filter=Wt, padding=[0, 0], stride=[1, 1], dilation=[1, 1], compute_data_type=FLOAT)
        Z.set_dim([N, C, H, W]).set_stride([C * H * W, 1, W * C, C])
    else:  # fprop with w' = flip(w).transpose(0, 1), padding k - 1
        Z = g.conv_fprop(image=X, weight=Wt, padding=[k - 1, k - 1], stride=[1, 1], dilation=[1, 1],
                         compute_data_type=FLOAT)
    t = {"x": X, "w": Wt}
    if epilogue == "none":
        Z.set_output(True).set_data_type(FLOAT)
        t["a"] = Z
    else:
        add_epilogue(cudnn, g, t, Z, epilogue, N, C)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t


def add_epilogue(cudnn, g, t, Z, epilogue, N, C):
    """a = GELU(z + b) as an output, then the statistics the epilogue asks for."""
    FLOAT = cudnn.data_type.FLOAT
    B = g.tensor(name="b", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=FLOAT)
    t["b"] = B
    A = g.gelu(input=g.bias(input=Z, bias=B, compute_data_type=FLOAT), compute_data_type=FLOAT)
    A.set_output(True).set_data_type(FLOAT)
    t["a"] = A
    if epilogue == "genstats":
        S, SQ = g.genstats(input=A, compute_data_type=FLOAT)
        S.set_output(True).set_data_type(FLOAT)
        SQ.set_output(True).set_data_type(FLOAT)
        t["sum_c"], t["sq_c"] = S, SQ
    elif epilogue == "reduce_nc":
        S = g.reduction(input=A, mode=cudnn.reduction_mode.ADD, compute_data_type=FLOAT)
        S.set_output(True).set_dim([N, C, 1, 1]).set_stride([C, 1, C, C]).set_data_type(FLOAT)
        SQ = g.reduction(input=g.mul(a=A, b=A, compute_data_type=FLOAT), mode=cudnn.reduction_mode.ADD,
                         compute_data_type=FLOAT)
        SQ.set_output(True).set_dim([N, C, 1, 1]).set_stride([C, 1, C, C]).set_data_type(FLOAT)
        t["sum_nc"], t["sq_nc"] = S, SQ


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import cudnn

    torch.manual_seed(0)
    dev = "cuda"
    N, Cin, C, k, HW = args.batch, 64, 64, 3, 256
    cl = torch.channels_last
    x = torch.rand(N, Cin, HW, HW, device=dev).contiguous(memory_format=cl)
    w = (torch.randn(Cin, C, k, k, device=dev) / (Cin * k * k) ** 0.5).contiguous(memory_format=cl)
    b = torch.randn(C, device=dev) * 0.1
    H = W = HW + k - 1
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · cuDNN backend {cudnn.backend_version_string()}"
          f" · TF32 for cuDNN conv: {torch.backends.cudnn.allow_tf32}")
    print(f"x {tuple(x.shape)} fp32 channels_last, ConvTranspose2d {Cin}->{C} {k}x{k} stride 1 -> {N}x{C}x{H}x{W}")

    # References (PyTorch: cuDNN through ATen, channels_last).
    with torch.no_grad():
        z_ref = F.conv_transpose2d(x, w, b)
        a_ref = F.gelu(z_ref)
        a64 = a_ref.double()
        sums = {"sum_nc": a64.sum((2, 3)), "sq_nc": (a64 * a64).sum((2, 3)),
                "sum_c": a64.sum((0, 2, 3)), "sq_c": (a64 * a64).sum((0, 2, 3))}
        del a64
    t_conv = timed(lambda: F.conv_transpose2d(x, w, None), args.reps)
    t_conv_b = timed(lambda: F.conv_transpose2d(x, w, b), args.reps)
    t_conv_gelu = timed(lambda: F.gelu(F.conv_transpose2d(x, w, b)), args.reps)
    print(f"PyTorch F.conv_transpose2d: {t_conv:.3f} ms (no bias), {t_conv_b:.3f} ms (bias), "
          f"+ GELU {t_conv_gelu:.3f} ms")

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rows = []
    weights = {"dgrad": w, "fprop": w.flip(2, 3).transpose(0, 1).contiguous(memory_format=cl)}
    for form, wt in weights.items():
        for epi in ("none", "gelu", "genstats", "reduce_nc"):
            name = f"{form}+{epi}"
            try:
                g, t = build(cudnn, handle, x, wt, form, epi, (H, W))
            except Exception as e:  # noqa: BLE001  (an unsupported graph is the result of this probe)
                msg = " ".join(str(e).split())[:300] or type(e).__name__
                rows.append((name, "not supported", msg))
                print(f"{name:22s} not supported: {msg}")
                continue
            outs = {k2: torch.empty(N if "nc" in k2 else 1, C, 1, 1, device=dev).contiguous(memory_format=cl)
                    for k2 in t if k2 in sums}
            a = torch.empty(N, C, H, W, device=dev).contiguous(memory_format=cl)
            pack = {t["x"]: x, t["w"]: wt, t["a"]: a}
            if "b" in t:
                pack[t["b"]] = b.view(1, C, 1, 1)
            for k2, v in outs.items():
                pack[t[k2]] = v
            ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)

            def run():
                for v in outs.values():
                    v.zero_()  # reductions may accumulate into their outputs
                g.execute(pack, ws, handle=handle)
            try:
                ms = timed(run, args.reps)
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                msg = traceback.format_exc().splitlines()[-1][:300]
                rows.append((name, "failed to run", msg))
                print(f"{name:22s} built but failed to run: {msg}")
                continue
            ref_a = z_ref - b.view(1, C, 1, 1) if epi == "none" else a_ref
            errs = [f"a {rel_err(a, ref_a):.1e}"] + [f"{k2} {rel_err(v.view(sums[k2].shape), sums[k2]):.1e}"
                                                     for k2, v in outs.items()]
            try:
                engine = g.get_plan_name_at_index(0)
            except Exception:  # noqa: BLE001
                engine = "?"
            base = t_conv if epi == "none" else t_conv_gelu
            rows.append((name, f"{ms:.3f} ms", f"{ms / t_conv:.2f}x bare conv; {ms / base:.2f}x PyTorch same work; "
                                               f"engine {engine}; rel err {', '.join(errs)}"))
            print(f"{name:22s} {ms:8.3f} ms  {rows[-1][2]}")
    print("\n| graph | result | notes |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
