// SPDX-License-Identifier: BSD-3-Clause
// CUDA host helpers of the stable-ABI ops (C++ files compiled by the host compiler): the current
// stream and device guard through torch::stable, device attributes from the CUDA runtime (cached per
// device), and a check for CUDA runtime errors.
#pragma once
#ifndef USE_CUDA
#error "cuda_utils.h needs -DUSE_CUDA (the CUDA entry points of the stable C shim; setup.py sets it)"
#endif
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <mutex>
#include <vector>
#include <utility>

#include "stable.h"

namespace gnext {

#define GNEXT_CUDA_CHECK(expr)                                                                         \
  do {                                                                                                 \
    const cudaError_t gnext_err_ = (expr);                                                             \
    GNEXT_CHECK(gnext_err_ == cudaSuccess, "gnext: CUDA error: ", cudaGetErrorString(gnext_err_), " (", \
                #expr, ")");                                                                           \
  } while (0)

// The current CUDA stream of t's device (torch.cuda.current_stream()).
inline cudaStream_t current_stream(const Tensor& t) {
  void* s = nullptr;
  GNEXT_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &s) == AOTI_TORCH_SUCCESS,
              "gnext: cannot get the current CUDA stream of ", device_name(t));
  return static_cast<cudaStream_t>(s);
}

// Bound of the per-device host caches below (device index < kMaxDevices).
constexpr int kMaxDevices = 64;

// The archs this module was compiled for, as setup.py passes them (TORCH_CUDA_ARCH_LIST encoded as
// one preprocessor token: "9.0a;12.0+PTX" -> 90a_120ptx).
#define GNEXT_STR2(x) #x
#define GNEXT_STR(x) GNEXT_STR2(x)
#ifdef GNEXT_CUDA_ARCHS
inline constexpr const char* kBuiltArchs = GNEXT_STR(GNEXT_CUDA_ARCHS);
#else
inline constexpr const char* kBuiltArchs = "";
#endif

cudaError_t probe_kernel_image();  // arch_check.cu

// "90a_120ptx" -> "sm_90a, compute_120 (PTX)".
inline std::string readable_archs(const char* token) {
  std::string out, cur;
  auto flush = [&] {
    if (cur.empty()) return;
    const bool ptx = cur.size() > 3 && cur.compare(cur.size() - 3, 3, "ptx") == 0;
    out += (out.empty() ? "" : ", ") + (ptx ? "compute_" + cur.substr(0, cur.size() - 3) + " (PTX)" : "sm_" + cur);
    cur.clear();
  };
  for (const char* c = token; *c != '\0'; ++c) *c == '_' ? flush() : cur.push_back(*c);
  flush();
  return out.empty() ? "(unknown)" : out;
}

// Raises, once per device until it passes, when this build has no device code the GPU can run: a
// clear message naming the GPU and the archs the build has, instead of a launch failure.
inline void check_device_supported(int dev) {
  static std::array<std::atomic<bool>, kMaxDevices> ok{};
  if (dev < 0 || dev >= kMaxDevices || ok[dev].load(std::memory_order_relaxed)) return;
  const cudaError_t e = probe_kernel_image();
  if (e == cudaSuccess) {
    ok[dev].store(true, std::memory_order_relaxed);
    return;
  }
  cudaDeviceProp prop{};
  GNEXT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  fail("gnext: this build has no device code for ", prop.name, " (cuda:", dev, ", sm_", prop.major, prop.minor,
       "): it was compiled for ", readable_archs(kBuiltArchs), ". Install a gnext wheel built for sm_", prop.major,
       prop.minor, " or rebuild with TORCH_CUDA_ARCH_LIST including ", prop.major, ".", prop.minor,
       " (python -m groupnorm_ext --info lists what this build supports). CUDA said: ", cudaGetErrorString(e));
}

// Makes t's device current for the scope (c10::cuda::CUDAGuard), after checking that this build can
// run on it (check_device_supported).
struct DeviceGuard {
  explicit DeviceGuard(const Tensor& t) : DeviceGuard(t.get_device_index()) {}
  explicit DeviceGuard(int32_t index) : g(index) { check_device_supported(index); }
  torch::stable::accelerator::DeviceGuard g;
};

// What the launch planners read of cudaDeviceProp (read once per device).
struct DeviceProps {
  int multiProcessorCount;
  int major, minor;  // compute capability
  size_t sharedMemPerBlockOptin, sharedMemPerMultiprocessor, reservedSharedMemPerBlock;
  size_t l2CacheSize;  // bytes
  int memoryClockKHz, memoryBusWidthBits;  // peak DRAM bandwidth: 2 * clock * width / 8 (peak_dram_gbs)
};

// Peak DRAM bandwidth in GB/s (double data rate): H100 SXM 3352, H200 4814 or 4916 (two hosts seen).
inline int64_t peak_dram_gbs(const DeviceProps& p) {
  return 2 * int64_t{p.memoryClockKHz} * (p.memoryBusWidthBits / 8) / 1000000;
}

// Of the current device (the ops set it with DeviceGuard first).
inline const DeviceProps& device_props() {
  static std::array<DeviceProps, kMaxDevices> props;
  static std::array<std::once_flag, kMaxDevices> once;
  int dev = 0;
  GNEXT_CUDA_CHECK(cudaGetDevice(&dev));
  GNEXT_CHECK(dev >= 0 && dev < kMaxDevices, "gnext: CUDA device index ", dev, " out of range");
  std::call_once(once[dev], [dev] {
    auto attr = [dev](cudaDeviceAttr a) {
      int v = 0;
      GNEXT_CUDA_CHECK(cudaDeviceGetAttribute(&v, a, dev));
      return v;
    };
    DeviceProps& p = props[dev];
    p.multiProcessorCount = attr(cudaDevAttrMultiProcessorCount);
    p.major = attr(cudaDevAttrComputeCapabilityMajor);
    p.minor = attr(cudaDevAttrComputeCapabilityMinor);
    p.sharedMemPerBlockOptin = static_cast<size_t>(attr(cudaDevAttrMaxSharedMemoryPerBlockOptin));
    p.sharedMemPerMultiprocessor = static_cast<size_t>(attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor));
    p.reservedSharedMemPerBlock = static_cast<size_t>(attr(cudaDevAttrReservedSharedMemoryPerBlock));
    p.l2CacheSize = static_cast<size_t>(attr(cudaDevAttrL2CacheSize));
    p.memoryClockKHz = attr(cudaDevAttrMemoryClockRate);
    p.memoryBusWidthBits = attr(cudaDevAttrGlobalMemoryBusWidth);
  });
  return props[dev];
}

// Zeroed unsigned counters for inter-CTA signalling (see arrive / wait_count / depart in
// device_utils.cuh). Kernels that use them leave them zero when they finish (the last of a unit's
// T tiles to depart resets its counter), so a buffer kept per (device, stream) serves every launch
// on that stream without a cudaMemsetAsync or an allocation: kernels on one stream run in order.
// While the stream is being captured into a CUDA graph, the counters come from a fresh tensor zeroed
// by a memset captured with the graph (a graph may be replayed on any stream, beside other work).
// `keep` holds that tensor alive until the launch is enqueued.
struct Counters {
  unsigned* ptr = nullptr;
  Tensor keep;
};
// Whether work enqueued on `stream` now is being captured into a CUDA graph.
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  GNEXT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}
inline Counters zeroed_counters(const Tensor& like, int64_t n, cudaStream_t stream) {
  Counters c;
  if (n <= 0) return c;
  if (capturing(stream)) {
    c.keep = empty_on(like, {n}, ScalarType::Int);
    c.ptr = static_cast<unsigned*>(c.keep.data_ptr());
    GNEXT_CUDA_CHECK(cudaMemsetAsync(c.ptr, 0, static_cast<size_t>(n) * sizeof(unsigned), stream));
    return c;
  }
  struct Buffer {
    unsigned* ptr;
    int64_t size;
  };
  static std::mutex mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, Buffer>();  // never freed: process lifetime
  const int dev = like.get_device_index();
  std::lock_guard<std::mutex> lock(mutex);
  Buffer& b = (*buffers)[{dev, stream}];
  if (b.size < n) {
    // Grown geometrically; the old buffer is left allocated (a few KB; an earlier launch on this
    // stream may still be reading it).
    const int64_t size = std::max<int64_t>({n, 2 * b.size, 4096});
    void* p = nullptr;
    GNEXT_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(size) * sizeof(unsigned)));
    GNEXT_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(size) * sizeof(unsigned), stream));
    b = {static_cast<unsigned*>(p), size};
  }
  c.ptr = b.ptr;
  return c;
}

// Float scratch for one op call (partial sums, per-channel sums, coefficients), valid until the op's
// last launch on `stream` is enqueued. Outside CUDA-graph capture it is a buffer kept per (thread,
// device, stream), grown geometrically: kernels on one stream run in order, and a buffer per thread
// means that another thread enqueuing on the same stream between this call's launches uses its own.
// The buffer is cudaMalloc'ed, outside PyTorch's caching allocator: a tensor kept alive from that
// allocator would be taken from a CUDA-graph pool during torch.compile's cudagraph warm-up and then
// be reported there as an untracked live allocation. Like the counters' buffer, an outgrown buffer is
// left allocated (an earlier launch may still read it) and the total stays under twice the largest
// request. Requests above kScratchCacheFloats, and every request during capture, get a fresh tensor
// (during capture: from the graph's pool, as any temporary of a captured op). This saves an
// allocation per scratch array per call (~3-8 us of host time each on the H100 machine).
constexpr int64_t kScratchCacheFloats = int64_t(1) << 22;  // 16 MiB
// Every non-null pointer 16-byte aligned (the kernels' vector accesses).
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

inline int64_t scratch_slice_floats(int64_t n) { return (n + 3) / 4 * 4; }  // 16-byte aligned slices
struct Scratch {
  float* ptr = nullptr;
  Tensor keep;  // a fresh tensor when not from the cached buffer: alive until the launches are enqueued
  float* take(int64_t n) {  // the next slice of n floats; nullptr for n = 0 (an array not wanted)
    if (n <= 0) return nullptr;
    float* p = ptr;
    ptr += scratch_slice_floats(n);
    return p;
  }
};
// Floats of a scratch holding slices of these sizes (take them in this order).
inline int64_t scratch_floats(std::initializer_list<int64_t> sizes) {
  int64_t n = 0;
  for (int64_t s : sizes) n += scratch_slice_floats(s);
  return n;
}
inline Scratch scratch(const Tensor& like, int64_t n, cudaStream_t stream) {
  Scratch s;
  if (n <= 0) return s;
  if (capturing(stream) || n > kScratchCacheFloats) {
    s.keep = empty_on(like, {n}, ScalarType::Float);
    s.ptr = static_cast<float*>(s.keep.data_ptr());
    return s;
  }
  struct Entry {
    int dev;
    cudaStream_t stream;
    float* ptr;
    int64_t size;
  };
  thread_local std::vector<Entry> buffers;  // plain data: nothing to release at thread exit
  const int dev = like.get_device_index();
  Entry* e = nullptr;
  for (Entry& x : buffers)
    if (x.dev == dev && x.stream == stream) e = &x;
  if (e == nullptr) e = &buffers.emplace_back(Entry{dev, stream, nullptr, 0});
  if (e->size < n) {
    const int64_t size = std::min<int64_t>(std::max<int64_t>({n, 2 * e->size, 16384}), kScratchCacheFloats);
    void* p = nullptr;
    GNEXT_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(size) * sizeof(float)));
    *e = {dev, stream, static_cast<float*>(p), size};
  }
  s.ptr = e->ptr;
  return s;
}

}  // namespace gnext
