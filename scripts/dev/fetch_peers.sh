#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The public Triton GroupNorm+SiLU kernels gnext is compared with (sglang 0.5.23, vllm-omni 0.30.0;
# Apache-2.0): downloads the two wheels (pure Python for these files) and unpacks only the kernel files
# into .peers/ (git-ignored). scripts/bench/peers.py loads them by path at run time; their code is never
# copied into the project. Carry .peers/ to a GPU machine that has no network.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" sglang==0.5.23 vllm-omni==0.30.0
mkdir -p .peers
unzip -q -o "$tmp"/sglang-*.whl 'sglang/kernels/ops/diffusion/norm/group_norm_silu_triton.py' \
  'sglang/kernels/ops/diffusion/norm/group_norm_silu_twopass_triton.py' -d .peers
unzip -q -o "$tmp"/vllm_omni-*.whl 'vllm_omni/model_executor/models/common/ops/fused_group_norm_silu.py' -d .peers
rm -rf "$tmp"
find .peers -name '*.py'
