#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# One device call: build the extension, a quick smoke test of the one-pass kernels, the benchmark,
# the GPU test suite and the KernelBench check, each under a time limit so that one call fits the
# device's 10-minute cap (a hang shows as a timeout, not a lost call). Logs and results go to $OUT
# (default ./device_out); a short table prints last.
#   bash scripts/dev/device_run.sh [bench args...]
#   STEPS="deps build smoke aten bench test kb fused act sanitize ncu host models shapes kernels plan dist" BUDGET_S=580 \
#     bash scripts/dev/device_run.sh
# test runs pytest with PYTEST_N xdist workers (default 8; 0: none), on TEST_SHARD=i/k's files if given (the files
# i, i + k, ... of tests/test_*.py sorted). aten: tests/test_aten_kernels.py.
# models: ROWS (default all), VARIANTS (default all) and MODELS_NAME (output name) of the real-model benchmark (FUSION_WHEN=always: the compile + fusion variant rewrites training graphs too); shapes: SHARD (default 0/1) of the randomized shape sweep with the GN+SiLU peers
# (.peers/ from scripts/dev/fetch_peers.sh carried along); kernels: per-kernel times
# (scripts/dev/profile_kernels.py); plan: the device as the planner sees it and a few plans. MATCH:
# only the sweep cases / profile shapes whose name contains it.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
STEPS=${STEPS:-build smoke bench test kb}
BUDGET_S=${BUDGET_S:-580}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' | tee -a "$OUT/gpu.txt"
# The image sets CXX=/opt/gcc/bin/g++, whose driver links libstdc++ statically into shared
# objects: a second libstdc++ in the process crashes on the first formatted C++ error. Build with
# the system compiler (setup.py also refuses an extension that carries its own libstdc++).
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
left() { echo $((BUDGET_S - SECONDS)); }
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has deps; then  # benchmark-only packages carried as wheels in .whl/ (no network there)
  python3 -m pip install -q --no-deps --no-index .whl/*.whl > "$OUT/deps.log" 2>&1; echo "deps rc=$?"
fi
if has build; then
  t0=$SECONDS
  GNEXT_PTXAS_VERBOSE=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  grep -E "registers|spill" "$OUT/build.log" | sed 's/^ *//' | sort | uniq -c | sort -rn | head -5
  echo "build: $((SECONDS - t0)) s"
fi
if has smoke; then
  t0=$SECONDS
  timeout 120 python3 -m pytest -q --maxfail=5 -p no:cacheprovider tests/test_group_norm.py -k "onepass or graph or deterministic" > "$OUT/pytest_smoke.log" 2>&1
  rc=$?
  echo "smoke rc=$rc ($((SECONDS - t0)) s): $(tail -1 "$OUT/pytest_smoke.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_smoke.log" | head -10
  [ $rc -ne 0 ] && exit $rc
fi
if has aten; then  # enable_aten_kernels: its tests (the host time of its calls: the host step)
  t0=$SECONDS
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_aten_kernels.py > "$OUT/pytest_aten.log" 2>&1
  echo "aten tests rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/pytest_aten.log")"
  grep -E "^(FAILED|ERROR)|Error:" "$OUT/pytest_aten.log" | head -10
fi
if has bench; then
  t0=$SECONDS
  timeout $(( $(left) - 60 )) python3 scripts/bench/groupnorm.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? ($((SECONDS - t0)) s)"
fi
if has test; then
  t0=$SECONDS
  nproc_args=()
  [ "${PYTEST_N:-8}" != 0 ] && python3 -c "import xdist" 2> /dev/null && nproc_args=(-n "${PYTEST_N:-8}")
  # TEST_SHARD=i/k: the test files i, i + k, ... of the sorted list (the whole suite did not fit one call's limit
  # on the H200 with 14 workers: two calls with shards 0/2 and 1/2 cover it).
  test_files=(tests)
  if [ -n "${TEST_SHARD:-}" ]; then
    mapfile -t test_files < <(ls tests/test_*.py | sort | awk -v i="${TEST_SHARD%/*}" -v k="${TEST_SHARD#*/}" '(NR - 1) % k == i')
  fi
  # SIGINT at the limit: pytest then still prints its summary (failures, counts) and the slowest tests.
  timeout -s INT -k 20 $(( $(left) - 40 )) python3 -m pytest -q --maxfail=5 --durations=30 -p no:cacheprovider \
    "${nproc_args[@]}" "${test_files[@]}" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
fi
if has kb; then
  timeout $(( $(left) )) python3 scripts/kernelbench/level1_35_group_norm.py > "$OUT/kernelbench.log" 2>&1
  echo "kernelbench L1#35 rc=$?: $(tail -1 "$OUT/kernelbench.log")"
fi
if has fused; then
  t0=$SECONDS
  timeout $(( $(left) - 30 )) python3 scripts/bench/conv_gelu_gn.py --out "$OUT" > "$OUT/bench_l2_19.log" 2>&1
  echo "bench L2#19 rc=$? ($((SECONDS - t0)) s)"; tail -8 "$OUT/bench_l2_19.log"
  timeout 120 python3 scripts/kernelbench/level2_19_convtranspose_gelu_groupnorm.py > "$OUT/kernelbench_l2_19.log" 2>&1
  echo "kernelbench L2#19 rc=$?: $(tail -1 "$OUT/kernelbench_l2_19.log")"
fi
if has act; then
  t0=$SECONDS
  timeout $(( $(left) - 20 )) python3 scripts/bench/group_norm_act.py --out "$OUT" > "$OUT/bench_group_norm_act.log" 2>&1
  echo "bench group_norm_act rc=$? ($((SECONDS - t0)) s)"; sed -n '/^Device:/,$p' "$OUT/bench_group_norm_act.log"
fi
if has sanitize; then
  mkdir -p "$OUT/sanitizer"
  OUT=$OUT/sanitizer TOOL_TIMEOUT=$(( ($(left) - 10) / 4 )) bash scripts/dev/sanitize.sh
fi
if has plan; then
  python3 -c 'import torch, groupnorm_ext as g; torch.zeros(1, device="cuda"); print("planner device:", g._library._C._device())' 2>&1 | tee "$OUT/plan.log"
  for s in 1,128,1024,1024:32:float16 112,64,512,512:8:float32 16,512,128,128:32:bfloat16:cl 32,2048,7,7:32:bfloat16; do
    python3 -m groupnorm_ext --plan "$s" >> "$OUT/plan.log" 2>&1
  done
  echo "plan rc=$?"
fi
if has host; then
  timeout $(( $(left) )) python3 scripts/dev/host_overhead.py --ops --json "$OUT/host_overhead.json" > "$OUT/host_overhead.log" 2>&1
  echo "host_overhead rc=$?"; grep -v Warn "$OUT/host_overhead.log"
fi
if has models; then
  t0=$SECONDS
  timeout $(( $(left) - 10 )) python3 scripts/bench/real_models.py --rows "${ROWS:-vae-fp16-nchw,vae-fp16-cl,unet2d-train-bf16,sd15-unet-fp16,bit-train-bf16}" \
    --rounds "${ROUNDS:-7}" --fusion-when "${FUSION_WHEN:-auto}" --out "$OUT" --name "${MODELS_NAME:-real_models}" \
    ${VARIANTS:+--variants "$VARIANTS"} > "$OUT/real_models.log" 2>&1
  echo "models rc=$? ($((SECONDS - t0)) s)"; m="$OUT/${MODELS_NAME:-real_models}.md"; [ -f "$m" ] && cat "$m"
fi
if has shapes; then
  t0=$SECONDS
  timeout $(( $(left) - 10 )) python3 scripts/bench/sweep.py --act --shard "${SHARD:-0/1}" ${MATCH:+--match "$MATCH"} \
    --out "$OUT" > "$OUT/sweep.log" 2>&1
  echo "shape sweep rc=$? ($((SECONDS - t0)) s)"; tail -15 "$OUT/sweep.log"
fi
if has kernels; then
  timeout $(( $(left) - 10 )) python3 scripts/dev/profile_kernels.py ${MATCH:+--match "$MATCH"} > "$OUT/profile_kernels.log" 2>&1
  echo "profile_kernels rc=$?"; grep -E "^== |host time" "$OUT/profile_kernels.log" | head -40
fi
if has dist; then  # every GPU of the host: the NCCL tests, one GroupNorm layer split over them, the split decodes.
  # All logs go to one dist.log (a call brings back only so many files); the results are the JSON files.
  t0=$SECONDS; dlog="$OUT/dist.log"
  run_logged() { echo "== $*" >> "$dlog"; "$@" > "$OUT/.last.log" 2>&1; local rc=$?; cat "$OUT/.last.log" >> "$dlog"; return $rc; }
  if [ -z "${DIST_BENCH_ONLY:-}" ]; then
    run_logged timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py tests/test_split_ops.py
    echo "distributed tests rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/.last.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/.last.log" | head -10
    for shape in ${DIST_SHAPES:-1,128,4096,4096 1,512,512,512}; do
      run_logged timeout 180 python3 scripts/bench/distributed_gn.py --shape "$shape" \
        --json "$OUT/distributed_gn_${shape//,/x}.json" ${DIST_PROFILE:+--profile}
      echo "distributed_gn $shape rc=$?"; grep -v Warn "$OUT/.last.log" | tail -14
    done
  fi
  for size in ${DECODE_SIZES:-2048 4096}; do
    run_logged timeout $(( $(left) - 10 )) python3 scripts/bench/parallel_decode.py --size "$size" --rounds "${ROUNDS:-5}" \
      --json "$OUT/parallel_decode_$size.json"
    echo "parallel_decode $size rc=$?"; grep -v -i warn "$OUT/.last.log" | tail -14
  done
  for size in ${VIDEO_SIZES:-512}; do  # HunyuanVideo's decoder, 17 frames
    run_logged timeout $(( $(left) - 10 )) python3 scripts/bench/parallel_decode.py --model video --size "$size" \
      --frames 17 --rounds "${ROUNDS:-5}" --json "$OUT/parallel_decode_video_$size.json"
    echo "parallel_decode video $size rc=$?"; grep -v -i warn "$OUT/.last.log" | tail -14
  done
  rm -f "$OUT/.last.log"
fi
if has ncu; then
  OUT=$OUT timeout $(( $(left) )) bash scripts/dev/ncu_gaps.sh
fi
[ -f "$OUT/bench.log" ] && sed -n '/^Device:/,$p' "$OUT/bench.log"
exit 0
