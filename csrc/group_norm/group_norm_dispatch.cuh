// Compile-time dispatch helpers shared by the launcher translation units (nvcc only): element
// type, vector width and pointwise mode as template constants.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "../common/device_utils.cuh"
#include "group_norm_launch.h"

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
