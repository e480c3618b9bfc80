// Issue 17 probe (not product code): an L2-resident GroupNorm forward for NCHW groups too large for the
// one-pass plan's shared memory. One persistent launch; every CTA owns a contiguous slice of each group.
// Per group u: the CTAs read their slices (statistics, loads marked L2 evict_last), publish a Welford
// partial and arrive on u's counter; after all arrived, each CTA merges the partials and re-reads its
// slice -- from L2 if it stayed there -- and writes y (loads and stores marked evict_first).
// Lookahead mode reads group u+1's slice before waiting on u (two groups in L2 at once). Without it, the
// first stage_kb of each CTA's slice can be kept in shared memory instead of L2 (the rest re-read from L2).
// Built by scripts/dev/l2_resident_probe.py (nvcc -shared); called through ctypes on torch tensors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../../csrc/common/device_utils.cuh"

using gnext::WelfordOp;
using gnext::WelfordState;

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

__device__ __forceinline__ uint64_t policy(bool keep) {
  uint64_t p;
  if (keep)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

template <bool Hint>
__device__ __forceinline__ uint4 ld16(const void* p, uint64_t pol) {
  uint4 v;
  if constexpr (Hint) {
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
  } else {
    v = __ldg(reinterpret_cast<const uint4*>(p));
  }
  return v;
}

template <bool Hint>
__device__ __forceinline__ void st16(void* p, const uint4& v, uint64_t pol) {
  if constexpr (Hint) {
    asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w), "l"(pol)
                 : "memory");
  } else {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& r, float* out) {
  constexpr int V = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[V];
  } u;
  u.raw = r;
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = static_cast<float>(u.v[j]);
}
template <typename T>
__device__ __forceinline__ uint4 pack(const float* in) {
  constexpr int V = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[V];
  } u;
#pragma unroll
  for (int j = 0; j < V; ++j) u.v[j] = static_cast<T>(in[j]);
  return u.raw;
}

// Statistics of x[lo, hi) (element offsets, multiples of V), published as partial[blockIdx.x].
template <typename T, bool Hint>
__device__ void stats(const T* __restrict__ xu, int64_t lo, int64_t hi, WelfordState* partial, unsigned* counter,
                      WelfordState* scratch, uint4* stage, int64_t held) {
  constexpr int V = 16 / sizeof(T);
  const uint64_t keep = policy(true);
  WelfordState s = WelfordOp::identity();
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  int64_t i = lo + threadIdx.x * V;
  for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
    uint4 r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) r[k] = ld16<Hint>(xu + i + k * step, keep);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (i + k * step - lo < held) stage[(i + k * step - lo) / V] = r[k];
    float v[kUnroll * V];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) unpack<T>(r[k], v + k * V);
    s = gnext::welford_merge(s, gnext::welford_of<kUnroll * V>(v));
  }
  for (; i < hi; i += step) {
    float v[V];
    const uint4 r = ld16<Hint>(xu + i, keep);
    if (i - lo < held) stage[(i - lo) / V] = r;
    unpack<T>(r, v);
    s = gnext::welford_merge(s, gnext::welford_of<V>(v));
  }
  s = gnext::block_reduce<WelfordOp>(s, scratch);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = s;
    gnext::arrive(counter);
  }
}

template <typename T, bool Hint, bool Lookahead>
__global__ void __launch_bounds__(kThreads)
    l2res_fwd(const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ gamma,
              const float* __restrict__ beta, WelfordState* partial, unsigned* counters, int64_t units,
              int64_t unit_elems, int64_t HxW, int D, int G, int64_t slice, float eps, int64_t held) {
  constexpr int V = 16 / sizeof(T);
  extern __shared__ uint4 stage[];  // the first `held` elements of the CTA's slice (not with Lookahead)
  __shared__ WelfordState scratch[33];
  __shared__ float s_stat[2];
  const unsigned nb = gridDim.x;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t hi = min(unit_elems, lo + slice);
  stats<T, Hint>(x, lo, hi, partial, counters, scratch, stage, Lookahead ? 0 : held);
  for (int64_t u = 0; u < units; ++u) {
    if (Lookahead && u + 1 < units)
      stats<T, Hint>(x + (u + 1) * unit_elems, lo, hi, partial + (u + 1) * nb, counters + u + 1, scratch, stage, 0);
    if (threadIdx.x == 0) gnext::wait_count(counters + u, nb);
    __syncthreads();
    if (threadIdx.x < 32) {
      WelfordState s = WelfordOp::identity();
      for (unsigned j = threadIdx.x; j < nb; j += 32) {
        const float* p = reinterpret_cast<const float*>(partial + u * nb + j);
        s = gnext::welford_merge(s, WelfordState{__ldcg(p), __ldcg(p + 1), __ldcg(p + 2)});
      }
      s = gnext::warp_reduce<WelfordOp>(s);
      if (threadIdx.x == 0) {
        s_stat[0] = s.mean;
        s_stat[1] = rsqrtf(fmaxf(s.m2 / s.n, 0.f) + eps);
        gnext::depart(counters + u, nb);
      }
    }
    __syncthreads();
    const float mean = s_stat[0], rstd = s_stat[1];
    const uint64_t drop = policy(false);
    const T* xu = x + u * unit_elems;
    T* yu = y + u * unit_elems;
    const int c0 = static_cast<int>(u % G) * D;
    const int64_t step = static_cast<int64_t>(blockDim.x) * V;
    if (Lookahead) held = 0;
    auto fetch = [&](int64_t i) { return i - lo < held ? stage[(i - lo) / V] : ld16<Hint>(xu + i, drop); };
    auto normalize = [&](int64_t i, const uint4& r) {
      const int c = c0 + static_cast<int>(i / HxW);
      const float a = rstd * __ldg(gamma + c), b = __ldg(beta + c) - mean * a;
      float v[V];
      unpack<T>(r, v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = fmaf(v[j], a, b);
      st16<Hint>(yu + i, pack<T>(v), drop);
    };
    int64_t i = lo + threadIdx.x * V;
    for (; i + (kUnroll - 1) * step < hi; i += kUnroll * step) {
      uint4 r[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) r[k] = fetch(i + k * step);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) normalize(i + k * step, r[k]);
    }
    for (; i < hi; i += step) normalize(i, fetch(i));
    if (!Lookahead && u + 1 < units)
      stats<T, Hint>(x + (u + 1) * unit_elems, lo, hi, partial + (u + 1) * nb, counters + u + 1, scratch, stage,
                     held);
  }
}

template <typename T, bool Hint, bool Look>
int launch_t(const void* x, void* y, const float* gamma, const float* beta, void* ws, long N, long C, long G,
             long HxW, float eps, int ctas_per_sm, int stage_kb, cudaStream_t stream) {
  auto kernel = l2res_fwd<T, Hint, Look>;
  int dev = 0, sms = 0, occ = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const size_t smem = static_cast<size_t>(stage_kb) * 1024;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kThreads, smem);
  const int per_sm = ctas_per_sm > 0 ? std::min(ctas_per_sm, occ) : occ;
  const unsigned nb = static_cast<unsigned>(sms * per_sm);
  const int64_t units = N * G, D = C / G, unit_elems = D * HxW;
  constexpr int V = 16 / sizeof(T);
  const int64_t align = 1024 / sizeof(T);  // slices start on 1 KB
  int64_t slice = (unit_elems + nb - 1) / nb;
  slice = (slice + align - 1) / align * align;
  static_assert(1024 % (V * sizeof(T)) == 0, "vector");
  auto* partial = static_cast<WelfordState*>(ws);
  auto* counters = reinterpret_cast<unsigned*>(static_cast<char*>(ws) + units * 4096 * sizeof(WelfordState));
  kernel<<<nb, kThreads, smem, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), gamma, beta, partial,
                                         counters, units, unit_elems, HxW, static_cast<int>(D), static_cast<int>(G),
                                         slice, eps, static_cast<int64_t>(smem / sizeof(T)));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? static_cast<int>(nb) : -static_cast<int>(e);
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16. mode: bit 0 cache hints, bit 1 lookahead. stage_kb: shared
// memory per CTA holding the start of its slice between the two reads (ignored with lookahead). ws: zeroed, at least
// N*G*4096*12 + N*G*4 bytes (counters return to zero after each launch). Returns the grid size, or
// -cudaError. HxW must be a multiple of the vector (16 bytes).
extern "C" int l2res_forward(int dtype, int mode, const void* x, void* y, const float* gamma, const float* beta,
                             void* ws, long N, long C, long G, long HxW, float eps, int ctas_per_sm, int stage_kb,
                             void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
#define GO(T)                                                                                            \
  switch (mode) {                                                                                        \
    case 0: return launch_t<T, false, false>(x, y, gamma, beta, ws, N, C, G, HxW, eps, ctas_per_sm, stage_kb, s);  \
    case 1: return launch_t<T, true, false>(x, y, gamma, beta, ws, N, C, G, HxW, eps, ctas_per_sm, stage_kb, s);   \
    case 2: return launch_t<T, false, true>(x, y, gamma, beta, ws, N, C, G, HxW, eps, ctas_per_sm, stage_kb, s);   \
    default: return launch_t<T, true, true>(x, y, gamma, beta, ws, N, C, G, HxW, eps, ctas_per_sm, stage_kb, s);   \
  }
  if (dtype == 0) GO(float)
  if (dtype == 1) GO(__half)
  GO(__nv_bfloat16)
#undef GO
}
