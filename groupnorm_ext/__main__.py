# SPDX-License-Identifier: BSD-3-Clause
"""``python -m groupnorm_ext --info``: what this gnext build was compiled with and whether it can run
here (torch release, CUDA, GPU architecture), and the launch planner's tuning overrides in effect. The
compiled module uses PyTorch's stable ABI, so it runs on every torch release from the build's `torch_min`
on, not only the one it was built against. Exit status 0 when the ops can run on this machine's GPU (or,
without a GPU, on the CPU), 1 otherwise.

``python -m groupnorm_ext --plan 1,128,1024,1024:32:float16[:cl] [--device h200] [--act silu] [--input-bias]``: the kernels
and geometry the planner picks for that GroupNorm, forward and backward, and why, on the visible GPU or on a
named one (no GPU needed).

``python -m groupnorm_ext bench``: gnext against eager and torch.compile on a few real-model shapes, forward and
forward+backward, on the visible GPU (without one: the CPU path against eager), in under a minute."""
from __future__ import annotations

import argparse
import sys


def _arch_ok(archs, major, minor):
    """Built SASS for this capability, or PTX (archs with +PTX) of an older or equal one it can JIT."""
    cap = major * 10 + minor
    for a in archs:
        ptx = a.endswith("+PTX")
        num = a.replace("+PTX", "").rstrip("a")
        if "." not in num:
            continue
        ma, mi = (int(v) for v in num.split("."))
        built = ma * 10 + mi
        if built == cap or (ma == major and built <= cap and not a.replace("+PTX", "").endswith("a")) \
                or (ptx and built <= cap):
            return True
    return False


def info() -> int:
    import torch

    try:
        from ._build_info import BUILD_INFO
    except ImportError:
        BUILD_INFO = {}
    print(f"gnext {BUILD_INFO.get('version', '?')}")
    print(f"  built against torch {BUILD_INFO.get('torch_full', '?')}, CUDA {BUILD_INFO.get('cuda') or 'none (CPU-only build)'}, "
          f"archs {' '.join(BUILD_INFO.get('cuda_archs', [])) or '-'}")
    print(f"  running torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}")
    ok = True
    tmin = BUILD_INFO.get("torch_min")
    if tmin:
        run = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        need = tuple(int(v) for v in str(tmin).split("."))
        if run < need:
            print(f"  WARNING: this build needs torch >= {tmin} (LibTorch stable ABI target), running {torch.__version__}")
            ok = False
        else:
            print(f"  stable ABI: runs on torch >= {tmin} (this torch: yes)")
    try:
        from . import _C  # noqa: F401

        names = [n for n in ("group_norm", "group_norm_act", "group_norm_act_logsumexp",
                             "conv_transpose2d_gelu_group_norm")
                 if hasattr(torch.ops.gnext, n)]
        print(f"  library loaded: torch.ops.gnext.{{{', '.join(names)}}}")
    except Exception as e:  # noqa: BLE001  (report any load failure)
        print(f"  library FAILED to load: {e}")
        return 1
    from ._library import tuning, tuning_docs

    docs = tuning_docs()
    print("  tuning (GNEXT_* environment variables, read at the first op; -1: the planner's rule):")
    for name, value in tuning().items():
        print(f"    {name}={value}  {docs[name]}")
    if not torch.cuda.is_available():
        print("  GPU: none visible (the CPU kernels run)")
        return 0 if ok else 1
    if not BUILD_INFO.get("cuda"):
        print("  GPU present, but this is a CPU-only build")
        return 1
    for d in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(d)
        sup = _arch_ok(BUILD_INFO.get("cuda_archs", []), major, minor)
        ok &= sup
        print(f"  cuda:{d} {torch.cuda.get_device_name(d)} sm_{major}{minor}: "
              f"{'supported' if sup else 'NOT supported by this build (rebuild with TORCH_CUDA_ARCH_LIST including it)'}")
    return 0 if ok else 1


# Devices for --plan --device, as the planner sees them: (SMs, compute capability major, shared memory per SM,
# per block (opt-in), reserved per block, L2 bytes, peak DRAM GB/s). h100 and h200: cudaDeviceGetAttribute on an
# H100 80GB HBM3 and an H200 (groupnorm_ext._C._device()); the others from the vendors' data sheets.
DEVICES = {
    "h100": (132, 9, 233472, 232448, 1024, 52428800, 3352),
    "h200": (132, 9, 233472, 232448, 1024, 62914560, 4814),
    "b200": (148, 10, 233472, 232448, 1024, 132120576, 8000),
    "a100": (108, 8, 167936, 166912, 1024, 41943040, 2039),
    "l40s": (142, 8, 102400, 101376, 1024, 100663296, 864),
}
_DTYPES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2}


def parse_shape(spec: str):
    """``N,C,H,W[,...]:G:dtype[:cl]`` -> (N, C, G, HxW, element size, channels_last). Raises ValueError."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "cl"):
        raise ValueError(f"--plan: expected N,C,H,W:G:dtype[:cl], got {spec!r}")
    dims = [int(v) for v in parts[0].split(",")]
    if len(dims) < 2 or min(dims) < 1:
        raise ValueError(f"--plan: sizes must be N,C and spatial sizes >= 1, got {parts[0]!r}")
    G = int(parts[1])
    if G < 1 or dims[1] % G != 0:
        raise ValueError(f"--plan: C={dims[1]} is not divisible by G={G}")
    if parts[2] not in _DTYPES:
        raise ValueError(f"--plan: dtype must be one of {', '.join(_DTYPES)}, got {parts[2]!r}")
    hxw = 1
    for d in dims[2:]:
        hxw *= d
    return dims[0], dims[1], G, hxw, _DTYPES[parts[2]], len(parts) == 4


def plan(spec: str, device: str | None, activation: str, residual: bool, input_bias: bool = False) -> int:
    from ._library import ACTIVATIONS, _C

    N, C, G, hxw, esize, cl = parse_shape(spec)
    if activation not in ACTIVATIONS:
        raise ValueError(f"--act must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if device is None:
        import torch

        if not torch.cuda.is_available():
            print("no GPU visible: name one with --device " + "|".join(DEVICES))
            return 1
        dev, name = None, torch.cuda.get_device_name()
    else:
        dev, name = DEVICES[device], device
    print(f"plan on {name}")
    print(_C._plan((N, C, G, hxw), esize, cl, ACTIVATIONS.index(activation), residual, dev, input_bias), end="")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m groupnorm_ext", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=["bench"],
                   help="bench: gnext vs eager and torch.compile on a few real-model shapes (< 1 minute)")
    p.add_argument("--cpu", action="store_true", help="bench the CPU path even when a GPU is visible")
    p.add_argument("--info", action="store_true", help="print build and runtime information")
    p.add_argument("--plan", metavar="N,C,H,W:G:dtype[:cl]", help="print the planner's choice for this GroupNorm")
    p.add_argument("--device", choices=sorted(DEVICES), help="--plan for this GPU instead of the visible one")
    p.add_argument("--act", default="identity", help="--plan with this output activation (group_norm_act)")
    p.add_argument("--residual", action="store_true", help="--plan with a residual added after the activation")
    p.add_argument("--input-bias", action="store_true",
                   help="--plan with a convolution's bias added to the input as it is read (input_bias)")
    args = p.parse_args(argv)
    if args.command == "bench":
        from . import _bench

        return _bench.run("cpu" if args.cpu else None)
    if args.info:
        return info()
    if args.plan:
        try:
            return plan(args.plan, args.device, args.act, args.residual, args.input_bias)
        except ValueError as e:
            p.error(str(e))
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
