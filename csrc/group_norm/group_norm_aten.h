// SPDX-License-Identifier: BSD-3-Clause
// On-demand CUDA kernels for aten::native_group_norm(_backward) on gnext's (group_norm_aten.cpp).
#pragma once

namespace gnext {

// Registers (enable) or removes (disable) gnext's CUDA kernels for aten::native_group_norm and
// aten::native_group_norm_backward; returns whether they were registered before the call. Thread-safe.
bool set_aten_kernels(bool enable);
// Whether they are registered now.
bool aten_kernels_enabled();

}  // namespace gnext
