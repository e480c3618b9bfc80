// SPDX-License-Identifier: BSD-3-Clause
// Compile-time dispatch helpers shared by the launcher translation units (nvcc only): element
// type, vector width and pointwise mode as template constants.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "../common/device_utils.cuh"
#include "group_norm_launch.h"
#include "group_norm_tuning.h"

namespace gnext {
namespace gn {

constexpr int kMaxDevices = 64;  // per-device caches of kernel attributes

template <typename F>
cudaError_t with_scalar(ScalarKind t, F&& f) {
  switch (t) {
    case ScalarKind::Float:
      return f(float{});
    case ScalarKind::Half:
      return f(c10::Half{});
    case ScalarKind::BFloat16:
      return f(c10::BFloat16{});
  }
  return cudaErrorInvalidValue;
}

// vec is 1 or the 16-byte width of T.
template <typename T, typename F>
cudaError_t with_vec(int vec, F&& f) {
  if (vec == 1) return f(std::integral_constant<int, 1>{});
  return f(std::integral_constant<int, 16 / sizeof(T)>{});
}

// A runtime value in [M, End) as a compile-time constant: f(std::integral_constant<int, value>).
template <int M, int End, typename F>
cudaError_t with_int(int value, F& f) {
  if constexpr (M == End) {
    return cudaErrorInvalidValue;
  } else {
    return value == M ? f(std::integral_constant<int, M>{}) : with_int<M + 1, End>(value, f);
  }
}

// Raises `kernel`'s dynamic shared-memory limit to at least `smem` bytes, once per device and size (the call
// costs host time). `Tag` is a distinct type per kernel: instantiations of one template share signatures, so
// a cache keyed by the kernel's type alone would be shared by all of them (a kernel would then launch
// without its limit raised).
template <typename Tag, typename Kernel>
cudaError_t raise_smem_limit(Kernel kernel, size_t smem) {
  static std::atomic<int> smem_set[kMaxDevices];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= kMaxDevices || smem_set[dev].load() < static_cast<int>(smem)) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    if (dev < kMaxDevices) smem_set[dev].store(static_cast<int>(smem));
  }
  return cudaSuccess;
}

// Programmatic dependent launch (PDL, sm_90+) of `kernel`: it may start while the kernel before it in the
// stream finishes (its launch and CTA start-up overlap that kernel's tail); it must call pdl_wait()
// (common/device_utils.cuh) before its first global memory access, which keeps stream order. Used for every
// two-pass and small-group kernel: the first one of an op overlaps the tail of the caller's previous kernel,
// the others their gnext predecessor's. A plain launch before sm_90 or with Tuning::pdl = 0 (measurements).
inline bool pdl_enabled() {
  static std::atomic<int> major[kMaxDevices];  // compute capability major + 1 per device, 0: not read yet
  if (tuning().pdl == 0) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) return false;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    m = v + 1;
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m - 1 >= 9;
}
// cudaLaunchKernelEx with one launch attribute, or none (attr null).
template <typename Kernel, typename... Args>
cudaError_t launch_ex(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      cudaLaunchAttribute* attr, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = attr != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}
template <typename Kernel, typename... Args>
cudaError_t launch_dependent(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_ex(kernel, grid, block, smem, stream, pdl_enabled() ? &attr : nullptr, args...);
}

// Launch of a persistent kernel: `grid` CTAs of `threads`, `smem` bytes of dynamic shared memory, all CTAs
// co-resident (cooperative launch) when they wait on each other. `Tag`: see raise_smem_limit.
template <typename Tag, typename Kernel, typename... Args>
cudaError_t launch_persistent(Kernel kernel, unsigned grid, int threads, size_t smem, bool cooperative,
                              cudaStream_t stream, Args... args) {
  const cudaError_t e = raise_smem_limit<Tag>(kernel, smem);
  if (e != cudaSuccess) return e;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return launch_ex(kernel, dim3(grid), dim3(threads), smem, stream, cooperative ? &attr : nullptr, args...);
}

// Pointwise mode (pw_mode in common/pointwise.h) as a compile-time constant: all kPwModes, or only
// the prologue modes (kernels that an output activation does not change: the forward reduction).
template <typename F>
cudaError_t with_pw(int mode, F&& f) {
  return with_int<0, kPwModes>(mode, f);
}
template <typename F>
cudaError_t with_pw_pre(int mode, F&& f) {
  switch (pw_pre(mode)) {
    case kPreNone:
      return f(std::integral_constant<int, kPreNone>{});
    case kPreBiasGelu:
      return f(std::integral_constant<int, kPreBiasGelu>{});
    case kPreBiasGeluTanh:
      return f(std::integral_constant<int, kPreBiasGeluTanh>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace gn
}  // namespace gnext
