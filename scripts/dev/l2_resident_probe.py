"""Issue 17: does an L2-resident GroupNorm forward (one persistent launch, a grid-wide wait per group,
the second read of each group from shared memory and L2) beat the two-pass kernels on NCHW groups too
large for the one-pass plan? Times the probe kernel of l2_resident_probe.cu (built here with nvcc into
.probe/, or taken prebuilt from there) in the VARIANTS below (L2 cache hints, one group of lookahead,
CTAs per SM, shared memory kept per CTA) against gnext's own plan, gnext two-pass (GNEXT_ONEPASS=0,
GNEXT_WIDE=0), gnext's wide kernel (the product version of the probe, group_norm_wide.cuh, forced with
GNEXT_WIDE=2), GroupNorm+SiLU, torch.compile and the copy-bandwidth floor, in one process, CUDA events
with the L2 flushed before each call; checks the probe's output against F.group_norm first.
    python scripts/dev/l2_resident_probe.py [--so .probe/l2res.so] [--cases 0,1] [--no-probe] [--bwd]
    python scripts/dev/l2_resident_probe.py --ncu CASE MODE PER_SM STAGE_KB   (one probe launch, for ncu)
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import subprocess
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
from timing import Timer, copy_bandwidth, make_inputs, with_env  # noqa: E402

import groupnorm_ext as ge  # noqa: E402

CASES = [  # (N, C, H, W), G, dtype
    ((1, 128, 2048, 2048), 32, torch.bfloat16),
    ((1, 96, 2048, 2048), 32, torch.bfloat16),
    ((1, 256, 1024, 1024), 32, torch.bfloat16),
    ((1, 128, 1024, 1024), 32, torch.float16),
    ((112, 64, 512, 512), 8, torch.float32),
    ((4, 256, 512, 512), 32, torch.bfloat16),
    ((8, 256, 1024, 1024), 32, torch.bfloat16),
]
# (mode: bit 0 L2 cache hints, bit 1 one group of lookahead; CTAs per SM; KB of each CTA's slice kept in
# shared memory between the two reads, without lookahead)
VARIANTS = [(0, 2, 0), (1, 2, 0), (3, 2, 0), (3, 1, 0), (1, 2, 64), (1, 2, 110), (1, 1, 200), (0, 2, 110)]
DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def build(so):
    if so.exists():
        return
    so.parent.mkdir(exist_ok=True)
    inc = pathlib.Path(torch.__file__).parent / "include"
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
                    "-gencode=arch=compute_90a,code=sm_90a", f"-I{inc}",
                    str(ROOT / "scripts/dev/l2_resident_probe.cu"), "-o", str(so)], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--so", default=str(ROOT / ".probe" / "l2res.so"))
    ap.add_argument("--cases", default=",".join(map(str, range(len(CASES)))), help="indices into CASES")
    ap.add_argument("--no-probe", action="store_true", help="gnext and torch.compile only (not the probe kernel)")
    ap.add_argument("--bwd", action="store_true", help="also the backward op: own plan, two-pass, wide kernel")
    ap.add_argument("--ncu", nargs=4, type=int, metavar=("CASE", "MODE", "PER_SM", "STAGE_KB"),
                    help="run only the probe of CASES[CASE] in MODE at PER_SM CTAs per SM, twice, untimed "
                         "(for ncu: the second launch has warm counters)")
    args = ap.parse_args()
    so = pathlib.Path(args.so)
    build(so)
    lib = ctypes.CDLL(str(so))
    lib.l2res_forward.restype = ctypes.c_int
    lib.l2res_forward.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + \
        [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    if args.ncu:
        case, mode, per_sm, stage_kb = args.ncu
        shape, G, dtype = CASES[case]
        x, w, b, _ = make_inputs(shape, dtype, None, "cuda")
        y = torch.empty_like(x)
        N, C, HxW = shape[0], shape[1], shape[2] * shape[3]
        ws = torch.zeros(N * G * 4096 * 12 + N * G * 4, dtype=torch.uint8, device="cuda")
        wf, bf = w.float(), b.float()
        for _ in range(2):
            lib.l2res_forward(DTYPE[dtype], mode, x.data_ptr(), y.data_ptr(), wf.data_ptr(), bf.data_ptr(),
                              ws.data_ptr(), N, C, G, HxW, 1e-5, per_sm, stage_kb,
                              torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return
    timer = Timer("cuda")
    bw = copy_bandwidth("cuda", timer)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s", flush=True)
    for shape, G, dtype in [CASES[int(i)] for i in args.cases.split(",")]:
        N, C = shape[:2]
        HxW = shape[2] * shape[3]
        x, w, b, dy = make_inputs(shape, dtype, None, "cuda")
        wf, bf = w.float(), b.float()
        y = torch.empty_like(x)
        ws = torch.zeros(N * G * 4096 * 12 + N * G * 4, dtype=torch.uint8, device="cuda")
        counters = ws[N * G * 4096 * 12:].view(torch.int32)
        stream = torch.cuda.current_stream().cuda_stream

        def probe(mode, per_sm, stage_kb):
            def run():
                r = lib.l2res_forward(DTYPE[dtype], mode, x.data_ptr(), y.data_ptr(), wf.data_ptr(), bf.data_ptr(),
                                      ws.data_ptr(), N, C, G, HxW, 1e-5, per_sm, stage_kb, stream)
                if r < 0:
                    raise RuntimeError(f"launch failed: cudaError {-r}")
                return r
            return run

        ref = F.group_norm(x.float(), G, wf, bf)
        mb = x.numel() * x.element_size() / 1e6
        floor = 2 * x.numel() * x.element_size() / bw / 1e6
        print(f"== {'x'.join(map(str, shape))} G={G} {str(dtype)[6:]} ({mb:.0f} MB, "
              f"{mb / N / G:.1f} MB per group): floor {floor:.3f} ms (1R+1W)", flush=True)
        rows = {}
        for mode, per_sm, stage_kb in [] if args.no_probe else VARIANTS:
            if True:
                fn = probe(mode, per_sm, stage_kb)
                y.fill_(float("nan"))
                grid = fn()
                torch.cuda.synchronize()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                left = int(counters.abs().sum())
                name = f"probe hints={mode & 1} look={mode >> 1 & 1} smem={stage_kb}K {per_sm}/SM (grid {grid})"
                rows[name] = (timer(fn), f"max rel err {err:.1e}{'' if left == 0 else f' COUNTERS LEFT {left}'}")
        rows["gnext own plan"] = (timer(lambda: ge.group_norm(x, G, w, b)), "")
        rows["gnext two-pass"] = (timer(with_env(lambda: ge.group_norm(x, G, w, b), GNEXT_ONEPASS="0",
                                                 GNEXT_WIDE="0")), "")
        rows["gnext wide kernel (GNEXT_WIDE=2)"] = (
            timer(with_env(lambda: ge.group_norm(x, G, w, b), GNEXT_ONEPASS="0", GNEXT_WIDE="2")), "")
        for ahead in ("1", "0"):
            got = with_env(lambda: ge.group_norm(x, G, w, b), GNEXT_ONEPASS="0", GNEXT_WIDE="2", GNEXT_WIDE_AHEAD=ahead)()
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            rows[f"gnext wide ahead={ahead}: max rel err vs F.group_norm(fp32)"] = (0.0, f"{err:.1e}")
        rows["gnext wide, no look-ahead (GNEXT_WIDE_AHEAD=0)"] = (
            timer(with_env(lambda: ge.group_norm(x, G, w, b), GNEXT_ONEPASS="0", GNEXT_WIDE="2",
                           GNEXT_WIDE_AHEAD="0")), "")
        gn_silu = lambda: ge.group_norm_act(x, G, w, b, activation="silu")  # noqa: E731
        rows["gnext GroupNorm+SiLU, own plan"] = (timer(gn_silu), "")
        rows["gnext GroupNorm+SiLU, two-pass"] = (timer(with_env(gn_silu, GNEXT_ONEPASS="0", GNEXT_WIDE="0")), "")
        rows["gnext GroupNorm+SiLU, wide"] = (timer(with_env(gn_silu, GNEXT_ONEPASS="0", GNEXT_WIDE="2")), "")
        rows["gnext GroupNorm+SiLU, wide, no look-ahead"] = (
            timer(with_env(gn_silu, GNEXT_ONEPASS="0", GNEXT_WIDE="2", GNEXT_WIDE_AHEAD="0")), "")
        if args.bwd:
            _, mean, rstd = torch.ops.gnext.group_norm(x, G, w, b, 1e-5)
            bwd = lambda: torch.ops.gnext.group_norm_backward(dy, x, mean, rstd, w, G, [True, True, True])  # noqa
            rows["backward: gnext own plan"] = (timer(bwd), "")
            rows["backward: gnext two-pass (or one-pass)"] = (timer(with_env(bwd, GNEXT_WIDE="0")), "")
            rows["backward: wide kernel (GNEXT_WIDE=2)"] = (timer(with_env(bwd, GNEXT_WIDE="2", GNEXT_ONEPASS="0")), "")
            ref_b = with_env(bwd, GNEXT_WIDE="0")()
            got_b = with_env(bwd, GNEXT_WIDE="2", GNEXT_ONEPASS="0")()
            errs = [((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got_b, ref_b)]
            rows["backward: wide vs two-pass rel err (dx, dw, db)"] = (0.0, " ".join(f"{e:.1e}" for e in errs))
            _, mean_a, rstd_a = torch.ops.gnext.group_norm_act(x, G, w, b, 1e-5, "silu", None)
            bwd_a = lambda: torch.ops.gnext.group_norm_act_backward(  # noqa
                dy, x, mean_a, rstd_a, w, b, G, "silu", [True, True, True])
            rows["GN+SiLU backward: own plan"] = (timer(bwd_a), "")
            rows["GN+SiLU backward: two-pass (or one-pass)"] = (timer(with_env(bwd_a, GNEXT_WIDE="0")), "")
            rows["GN+SiLU backward: wide (GNEXT_WIDE=2)"] = (timer(with_env(bwd_a, GNEXT_WIDE="2", GNEXT_ONEPASS="0")),
                                                           "")
        comp = torch.compile(lambda t: F.group_norm(t, G, w, b), dynamic=False)
        rows["torch.compile"] = (timer(lambda: comp(x)), "")
        for name, (ms, note) in rows.items():
            if ms == 0:
                print(f"   {name:38s} {note}", flush=True)
            else:  # the floor is the forward's (1R + 1W); the backward's is 1.5x that (2R + 1W)
                print(f"   {name:38s} {ms:7.3f} ms  ({floor / ms:.2f} of floor)  {note}", flush=True)
        del x, y, ref, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
