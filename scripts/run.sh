#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# gnext's two entry points: build the extension in place (incremental: ninja keeps its objects in build/, so a
# second run recompiles only what changed), then
#   scripts/run.sh bench [suite] [args]    benchmarks (scripts/bench: groupnorm (default), act, l2_19, models)
#   scripts/run.sh test  [pytest args]     test suite (GPU tests skip without CUDA)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || { echo "torch is not installed for $PY: see README.md" >&2; exit 1; }
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$PY" setup.py -q build_ext --inplace
cmd=${1:-}
shift || true
case "$cmd" in
  bench) exec "$PY" scripts/bench "$@" ;;
  test) exec "$PY" -m pytest -q tests "$@" ;;
  *) echo "usage: scripts/run.sh bench|test [args]" >&2; exit 2 ;;
esac
