"""``python -m groupnorm_ext --info``: what this gnext build was compiled with and whether it can run
here (torch release, CUDA, GPU architecture). The compiled module uses PyTorch's stable ABI, so it
runs on every torch release from the build's `torch_min` on, not only the one it was built against. Exit status 0 when the ops can run on this
machine's GPU (or, without a GPU, on the CPU), 1 otherwise."""
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
        need = tuple(int(v) for v in tmin.split("."))
        if run < need:
            print(f"  WARNING: this build needs torch >= {tmin} (LibTorch stable ABI target), running {torch.__version__}")
            ok = False
        else:
            print(f"  stable ABI: runs on torch >= {tmin} (this torch: yes)")
    try:
        from . import _C  # noqa: F401

        import torch.ops  # noqa: F401

        names = [n for n in ("group_norm", "group_norm_act", "group_norm_act_logsumexp",
                             "conv_transpose2d_gelu_group_norm")
                 if hasattr(torch.ops.gnext, n)]
        print(f"  library loaded: torch.ops.gnext.{{{', '.join(names)}}}")
    except Exception as e:  # noqa: BLE001  (report any load failure)
        print(f"  library FAILED to load: {e}")
        return 1
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m groupnorm_ext", description=__doc__)
    p.add_argument("--info", action="store_true", help="print build and runtime information")
    args = p.parse_args(argv)
    if args.info:
        return info()
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
