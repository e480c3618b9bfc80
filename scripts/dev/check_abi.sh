#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Release gates on the built module (CPU only; CI runs it):
#  1. abi3audit: the extension uses only the CPython limited API of 3.10 (one cp310-abi3 wheel serves
#     every CPython >= 3.10);
#  2. every libtorch entry point the module imports (aoti_torch_* / torch_*: the stable C shim) is
#     defined by the OLDEST supported torch (2.11, setup.py's TORCH_TARGET_VERSION): its libtorch_cpu.so
#     and libtorch_cuda.so are taken from the torch 2.11.0 wheel (downloaded, not installed).
#   bash scripts/dev/check_abi.sh [path/to/_C.abi3.so]
# Each step is skipped with a message when its package cannot be downloaded (no network).
set -euo pipefail
cd "$(dirname "$0")/../.."
so=${1:-groupnorm_ext/_C.abi3.so}
py=${PYTHON:-python}
if "$py" -m pip install -q abi3audit >/dev/null 2>&1; then
  "$py" -m abi3audit --strict --verbose --assume-minimum-abi3 3.10 "$so"
else
  echo "SKIPPED: could not install abi3audit"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$py" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" torch==2.11.0 >/dev/null 2>&1; then
  echo "SKIPPED: could not download the torch 2.11.0 wheel to check the module's entry points against it"
  exit 0
fi
unzip -q -o "$tmp"/torch-2.11.0-*.whl 'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch_cuda.so' -d "$tmp/x"
nm -D --undefined-only "$so" | awk '{print $2}' | grep -E '^(aoti_torch_|torch_)' | sort -u > "$tmp/need"
nm -D --defined-only "$tmp"/x/torch/lib/libtorch_cpu.so "$tmp"/x/torch/lib/libtorch_cuda.so 2>/dev/null \
  | awk 'NF == 3 {print $3}' | grep -E '^(aoti_torch_|torch_)' | sort -u > "$tmp/have"
missing=$(comm -23 "$tmp/need" "$tmp/have")
if [ -n "$missing" ]; then
  echo "entry points the module needs that torch 2.11 does not define:"; echo "$missing"; exit 1
fi
echo "stable ABI: all $(wc -l < "$tmp/need") entry points the module imports are defined by torch 2.11.0"
