#!/usr/bin/env bash
# One device call: build the extension, run the GPU test suite, the KernelBench check and the
# benchmark. Logs and results go to $OUT (default ./device_out); a short table prints last.
#   bash scripts/device_run.sh [bench args...]
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' | tee -a "$OUT/gpu.txt"
# The image sets CXX=/opt/gcc/bin/g++, whose driver links libstdc++ statically into shared
# objects: a second libstdc++ in the process crashes on the first formatted C++ error. Build with
# the system compiler (setup.py also refuses an extension that carries its own libstdc++).
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
t0=$SECONDS
GNEXT_PTXAS_VERBOSE=1 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "registers|spill" "$OUT/build.log" | sed 's/^ *//' | sort | uniq -c | sort -rn | head -5
echo "build: $((SECONDS - t0)) s"
t0=$SECONDS
python3 -m pytest -q -x -p no:cacheprovider tests > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
python3 scripts/kernelbench/level1_35_group_norm.py > "$OUT/kernelbench.log" 2>&1; echo "kernelbench L1#35 rc=$?: $(tail -1 "$OUT/kernelbench.log")"
t0=$SECONDS
python3 scripts/bench.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($((SECONDS - t0)) s)"
sed -n '/^Device:/,$p' "$OUT/bench.log"
