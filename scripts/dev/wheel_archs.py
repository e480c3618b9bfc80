#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""What device code a gnext wheel carries, and the release gates on it (no GPU needed):
  python scripts/dev/wheel_archs.py dist/gnext-*.whl [--cuobjdump PATH]
Prints the wheel size, the SASS archs and PTX of each translation unit (cuobjdump --list-elf /
--list-ptx). Exit status 1 when a gate fails: the wheel is over 100 MB (the package index's default
per-file limit), or an arch of the build info lacks SASS in some translation unit."""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LIMIT_MB = 100


def find_cuobjdump(given):
    if given:
        return given
    for cand in (shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if cand and Path(cand).exists():
            return cand
    try:  # triton's wheel ships one
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    sys.exit("no cuobjdump found (--cuobjdump PATH)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel")
    p.add_argument("--cuobjdump", default=None)
    args = p.parse_args()
    tool = find_cuobjdump(args.cuobjdump)
    ok = True
    size_mb = Path(args.wheel).stat().st_size / 2**20
    print(f"wheel {Path(args.wheel).name}: {size_mb:.1f} MB (limit {LIMIT_MB} MB)")
    ok &= size_mb < LIMIT_MB
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(args.wheel) as z:
        so = next(n for n in z.namelist() if n.endswith(".so"))
        z.extract(so, tmp)
        info = z.read("groupnorm_ext/_build_info.py").decode()
        lib = str(Path(tmp) / so)
        elf = subprocess.run([tool, "--list-elf", lib], capture_output=True, text=True).stdout
        ptx = subprocess.run([tool, "--list-ptx", lib], capture_output=True, text=True).stdout
    archs = re.search(r"'cuda_archs': \[([^\]]*)\]", info).group(1).replace("'", "").split(", ")
    print(f"build info archs: {' '.join(archs)}")
    units = collections.defaultdict(set)
    for m in re.finditer(r"ELF file\s+\d+: (\w+)\.(sm_\w+)\.cubin", elf):
        units[m.group(1)].add(m.group(2))
    ptx_units = collections.defaultdict(set)
    for m in re.finditer(r"PTX file\s+\d+: (\w+)\.(sm_\w+)\.ptx", ptx):
        ptx_units[m.group(1)].add(m.group(2).replace("sm_", "compute_"))
    want = {"sm_" + a.replace(".", "").replace("+PTX", "") for a in archs}
    for unit in sorted(units):
        missing = want - units[unit]
        ok &= not missing
        print(f"  {unit:22s} SASS {' '.join(sorted(units[unit]))}  PTX {' '.join(sorted(ptx_units[unit])) or '-'}"
              + (f"  MISSING {' '.join(sorted(missing))}" if missing else ""))
    print("gates:", "pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
