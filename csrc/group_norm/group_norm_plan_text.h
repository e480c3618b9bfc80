// SPDX-License-Identifier: BSD-3-Clause
// The GroupNorm planner as text (group_norm_plan_text.cpp), with plain types only, for the Python module.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace gnext {

// The current CUDA device as the planner sees it: {SMs, CC major, shared memory per SM, per block (opt-in),
// reserved per block, L2 bytes, peak DRAM GB/s}.
std::array<int64_t, 7> current_plan_device();

// The forward and backward plans of a GroupNorm of `shape` = {N, C, G, HxW} (C % G == 0, checked by the caller),
// esize-byte elements, NCHW or channels_last, output activation `act` (ActKind) and residual, the forward with an
// input shift (input_bias), on `device` (the fields above), under the process's Tuning; aligned pointers assumed.
std::string describe_plans(const std::array<int64_t, 4>& shape, int esize, bool channels_last, int act,
                           bool residual, const std::array<int64_t, 7>& device, bool input_bias = false);

}  // namespace gnext
