#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Nsight Compute evidence for the shapes that miss the bandwidth-floor targets (docs/kernels.md):
# DRAM throughput, achieved occupancy and warp stall reasons of the kernel that dominates each.
# Clocks are left as found (--clock-control none). Output: $OUT/ncu_gaps.txt
#   OUT=dir [MATCH=text] bash scripts/dev/ncu_gaps.sh      (MATCH: only the cases whose title contains it)
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
NCU=${NCU:-ncu}
log="$OUT/ncu_gaps.txt"
: > "$log"
run() {  # title, kernel regex, ncu_case.py args...
  local title=$1 kern=$2
  shift 2
  [[ "$title" == *"${MATCH:-}"* ]] || return 0
  echo "######## $title" >> "$log"
  timeout 150 "$NCU" --clock-control none --kernel-name "regex:$kern" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio \
    python3 scripts/dev/ncu_case.py "$@" >> "$log" 2>&1
  echo "$title rc=$?"
}
# forward of 8 MiB groups, L1#35's geometry on 16 samples instead of 112, and the VAE map: the bulk kernel on
# sm_90 below 3.8 TB/s, else the one-pass or two-pass kernels (the regex matches whichever runs)
run "fwd 16x64x512x512 fp32 G=8" "bulk|onepass|reduce" 16,64,512,512 8 float32 nchw fwd
run "fwd VAE 1x128x1024x1024 fp16 G=32" "bulk|onepass|reduce" 1,128,1024,1024 32 float16 nchw fwd
# backward of 8 MiB groups: the bulk kernel (streamed) on sm_90 below 3.8 TB/s, else the two-pass reduction
run "bwd 16x64x512x512 fp32 G=8" "bulk|reduce" 16,64,512,512 8 float32 nchw bwd
# channels_last, two-pass forward
run "two-pass fwd reduce UNet 16x512x128x128 bf16 CL" reduce 16,512,128,128 32 bfloat16 cl fwd
run "two-pass fwd elementwise UNet 16x512x128x128 bf16 CL" affine 16,512,128,128 32 bfloat16 cl fwd
# channels_last VAE map (every group spans the image: the two-pass kernels' 2R + 1W cap)
run "two-pass fwd reduce VAE 1x128x1024x1024 fp16 CL" reduce 1,128,1024,1024 32 float16 cl fwd
run "two-pass fwd elementwise VAE 1x128x1024x1024 fp16 CL" affine 1,128,1024,1024 32 float16 cl fwd
# one-pass backward, ResNet
run "one-pass bwd ResNet 32x256x56x56 bf16" onepass 32,256,56,56 32 bfloat16 nchw bwd
grep -E "^########|Duration|DRAM Throughput|Achieved Occupancy|dram__bytes|stalled_|Registers Per|Grid Size|==ERROR" "$log"
