# SPDX-License-Identifier: BSD-3-Clause
"""Compiles (-fsyntax-only) every C++ source of csrc/ against the headers of the torch that runs this script,
with setup.py's CUDA-build defines and C++17 (what torch 2.11's cpp_extension passes), in parallel. CI runs it
with the oldest supported torch (2.11): a header or API the build needs that torch 2.11 lacks fails CI, not a
user's build. The .cu files include no torch header (their interface is group_norm_launch.h's plain types).
Compiling is not loading: scripts/dev/check_abi.sh checks the built module's entry points against torch 2.11.
    python scripts/dev/check_torch_min.py [-j N]"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import subprocess
import sys
import sysconfig

import torch
from torch.utils import cpp_extension

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFINES = ["-DTORCH_TARGET_VERSION=0x020b000000000000ULL", "-DUSE_CUDA", "-DGNEXT_CUDA_ARCHS=check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", "-DPy_LIMITED_API=0x030A0000", "-DTORCH_EXTENSION_NAME=_C"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-j", type=int, default=os.cpu_count() or 2)
    args = p.parse_args()
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    try:
        inc = cpp_extension.include_paths(device_type="cuda")
    except TypeError:
        inc = cpp_extension.include_paths(cuda=True)
    inc += [os.path.join(cuda_home, "include"), sysconfig.get_paths()["include"]]
    cxx = os.environ.get("CXX", "c++")
    flags = ["-fsyntax-only", "-std=c++17", "-Wall", *DEFINES, *(f"-I{d}" for d in inc)]
    sources = sorted(str(s) for s in (ROOT / "csrc").rglob("*.cpp"))

    def check(src):
        out = subprocess.run([cxx, *flags, src], capture_output=True, text=True)
        return src, out.returncode, out.stderr

    bad = 0
    with concurrent.futures.ThreadPoolExecutor(args.j) as pool:
        for src, rc, err in pool.map(check, sources):
            if rc != 0:
                bad += 1
                print(f"FAILED {os.path.relpath(src, ROOT)}:\n{err[-4000:]}")
    print(f"torch {torch.__version__}: {len(sources) - bad}/{len(sources)} C++ sources compile")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
