#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# sdist -> wheel -> fresh virtual environment -> GPU test suite against the INSTALLED wheel (issue 6).
#   OUT=dir bash scripts/dev/wheel_check.sh        (on the GPU machine; needs torch, build, pytest there)
#   WHEEL=gnext-...whl [TESTS=tests/test_x.py] [BENCH_ARGS=...] OUT=dir bash scripts/dev/wheel_check.sh
#                                              (a wheel built elsewhere, e.g. on the CPU machine against
#                                               another torch release: steps 1-2 are skipped)
# 1. python -m build --sdist from this checkout (MANIFEST.in decides what ships);
# 2. the wheel is built from the unpacked sdist alone (pip wheel, no build isolation: torch is the
#    build dependency, and the machine has no network);
# 3. a fresh venv gets only that wheel; torch and the test tools come from the interpreter's existing
#    site-packages through a .pth file (no network to install them again);
# 4. the package's source directory is removed from the unpacked sdist, so the tests (run from the
#    sdist's copy of tests/) can only import the installed wheel; `python -m groupnorm_ext --info`
#    and the GPU test suite run against it.
set -euo pipefail
OUT=${OUT:-$PWD/wheel_out}
mkdir -p "$OUT"
work=$(mktemp -d)
py=$(command -v python3)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc  # see device_run.sh
if [ -n "${WHEEL:-}" ]; then
  whl=$(readlink -f "$WHEEL")
  src="$work/src"
  mkdir -p "$src" && cp -r tests scripts "$src/"
  echo "wheel: $(basename "$whl") (prebuilt; $("$py" -c "import zipfile, sys; print(zipfile.ZipFile(sys.argv[1]).read('groupnorm_ext/_build_info.py').decode().splitlines()[-1])" "$whl"))"
else
  "$py" -P -m build --sdist --no-isolation --outdir "$work/dist" . > "$OUT/sdist.log" 2>&1
  sdist=$(ls "$work"/dist/gnext-*.tar.gz)
  echo "sdist: $(basename "$sdist") ($(tar tzf "$sdist" | grep -c '^gnext-[^/]*/csrc/') csrc entries)"
  tar xzf "$sdist" -C "$work"
  src=$(ls -d "$work"/gnext-*/)
  t0=$SECONDS
  (cd "$src" && "$py" -m pip wheel --no-build-isolation --no-deps -w "$work/wheels" . > "$OUT/wheel_build.log" 2>&1)
  whl=$(ls "$work"/wheels/gnext-*.whl)
  echo "wheel: $(basename "$whl") built from the sdist in $((SECONDS - t0)) s"
fi
"$py" -m venv "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$py" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_host_packages.pth"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$whl"
rm -rf "$src/groupnorm_ext" "$src/build"
cd "$src"
"$work/venv/bin/python" -c 'import groupnorm_ext, torch; print("imported", groupnorm_ext.__file__, "torch", torch.__version__)'
"$work/venv/bin/python" -m groupnorm_ext --info
set +e
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-400} "$work/venv/bin/python" -P -m pytest -q -p no:cacheprovider ${TESTS:-tests} > "$OUT/pytest_wheel.log" 2>&1
  echo "pytest against the installed wheel rc=$?: $(tail -1 "$OUT/pytest_wheel.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_wheel.log" | head -10
fi
# BENCH_ARGS="...": scripts/bench/groupnorm.py against the installed wheel (e.g. BENCH_ARGS="--tag wheel").
if [ -n "${BENCH_ARGS:-}" ]; then
  timeout ${BENCH_TIMEOUT:-400} "$work/venv/bin/python" scripts/bench/groupnorm.py --out "$OUT" $BENCH_ARGS > "$OUT/bench_wheel.log" 2>&1
  echo "bench against the installed wheel rc=$?"; tail -4 "$OUT/bench_wheel.log"
fi
# SANITIZE_ONLY=lse: compute-sanitizer's four tools over those cases of scripts/dev/sanitize_cases.py, on the wheel
if [ -n "${SANITIZE_ONLY:-}" ]; then
  for tool in memcheck racecheck synccheck initcheck; do
    extra=(--kernel-name kns=gnext)
    [ "$tool" = initcheck ] && extra=()
    GNEXT_SANITIZE_ONLY=$SANITIZE_ONLY timeout 120 compute-sanitizer --tool "$tool" "${extra[@]}" \
      "$work/venv/bin/python" -P scripts/dev/sanitize_cases.py > "$OUT/sanitize_${SANITIZE_ONLY}_$tool.log" 2>&1
    echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_${SANITIZE_ONLY}_$tool.log" | tail -1)"
  done
fi
# EXTRA="...": more commands against the installed wheel, run in the test directory with the venv's
# python first on PATH (e.g. EXTRA="python scripts/dev/host_overhead.py").
if [ -n "${EXTRA:-}" ]; then
  (export PATH="$work/venv/bin:$PATH"; eval "$EXTRA")
fi
exit 0
