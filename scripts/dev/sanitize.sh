#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# compute-sanitizer memcheck, racecheck, synccheck and initcheck over scripts/dev/sanitize_cases.py
# (every gnext kernel family, small shapes). Logs in $OUT (default ./sanitize_out); one summary
# line per tool. Needs a built extension and a GPU.
set -uo pipefail
OUT=${OUT:-$PWD/sanitize_out}
mkdir -p "$OUT"
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
for tool in $TOOLS; do
  # Only gnext's kernels are instrumented (PyTorch's own are out of scope and slow under the
  # tools), except for initcheck: it must see PyTorch's kernels initialize the inputs.
  extra=(--kernel-name kns=gnext)
  [ "$tool" = memcheck ] && extra+=(--leak-check no)
  [ "$tool" = initcheck ] && extra=()
  timeout ${TOOL_TIMEOUT:-300} compute-sanitizer --tool "$tool" "${extra[@]}" \
    python3 scripts/dev/sanitize_cases.py > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  echo "$tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1) ($(grep -c ' ok$' "$OUT/sanitize_$tool.log") cases ok)"
done
