// SPDX-License-Identifier: BSD-3-Clause
// Device helpers shared by every gnext kernel: float conversion, 16-byte vector loads/stores (also with
// L2 eviction-priority hints), cp.async copies, programmatic dependent launch, inter-CTA counters, Welford
// states and their merge (Chan et al.), deterministic warp/block reductions, and a 32-bit fast divider.
#pragma once
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "pointwise.h"

namespace gnext {

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

// ---------------------------------------------------------------------------------------------
// Vector access: V elements of T, V * sizeof(T) <= 16 bytes, pointer aligned to V * sizeof(T).
// The memory access goes through one raw integer vector (uint4 for 16 bytes) so that it
// compiles to a single LDG.128 / STG.128 (a plain struct copy may be split into scalar stores).
template <int Bytes> struct RawVec;
template <> struct RawVec<16> { using type = uint4; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<2> { using type = unsigned short; };

template <typename T, int V>
union Pack {
  using Raw = typename RawVec<sizeof(T) * V>::type;
  Raw raw;
  T v[V];
  __device__ Pack() {}
};

// Global load (read-only path, __ldg) / store (st.global.v4/v2) of one raw vector, so the
// access is never split into scalar instructions.
template <typename Raw>
__device__ __forceinline__ Raw ldg_raw(const Raw* p) {
  if constexpr (sizeof(Raw) == 2) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
  } else {
    return __ldg(p);
  }
}
// A 16-byte load through the coherent path (ld.global, not .nc) in a volatile asm: a store that follows it in program
// order may alias it, so ptxas keeps it before that store, and loads written together stay in flight together. ptxas
// sinks the read-only path's loads of float32 vectors past the stores (one to three in flight per thread where four
// were written; docs/decisions/two-pass-split.md). Other sizes: ldg_raw.
__device__ __forceinline__ uint4 ld_ordered(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <typename Raw>
__device__ __forceinline__ Raw ld_ordered(const Raw* p) {
  return ldg_raw(p);
}
__device__ __forceinline__ void stg_raw(uint4* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void stg_raw(uint2* p, const uint2& v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void stg_raw(unsigned int* p, const unsigned int& v) { *p = v; }
__device__ __forceinline__ void stg_raw(unsigned short* p, const unsigned short& v) { *p = v; }

// The V elements of a raw vector as float (a vector loaded earlier and held raw).
template <typename T, int V>
__device__ __forceinline__ void unpack_vec(const typename Pack<T, V>::Raw& raw, float* out) {
  Pack<T, V> pk;
  pk.raw = raw;
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_float(pk.v[j]);
}

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
  unpack_vec<T, V>(ldg_raw(reinterpret_cast<const typename Pack<T, V>::Raw*>(p)), out);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float* in) {
  Pack<T, V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = static_cast<T>(in[j]);
  stg_raw(reinterpret_cast<typename Pack<T, V>::Raw*>(p), pk.raw);
}

// ---------------------------------------------------------------------------------------------
// L2 eviction-priority hints (sm_80+): an access policy for a whole access.
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 ldg_hint(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void stg_hint(void* p, const uint4& v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (cp.async, sm_80+): 16 bytes per call, cached in L2 only.
// Each thread commits its copies as one group; wait_group<N> returns once at most N of the
// thread's most recent groups are still in flight (a __syncthreads() then publishes them).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// 16-byte shared-memory load of V elements of T (V * sizeof(T) == 16) into floats.
template <typename T, int V>
__device__ __forceinline__ void lds_vec(const T* p, float* out) {
  Pack<T, V> pk;
  pk.raw = *reinterpret_cast<const typename Pack<T, V>::Raw*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_float(pk.v[j]);
}

// Shared-memory store of V floats as T (one vector store).
template <typename T, int V>
__device__ __forceinline__ void sts_vec(T* p, const float* in) {
  Pack<T, V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = static_cast<T>(in[j]);
  *reinterpret_cast<typename Pack<T, V>::Raw*>(p) = pk.raw;
}

// Programmatic dependent launch (sm_90+; launch_dependent() in group_norm/group_norm_dispatch.cuh). A kernel
// launched that way may start while the kernel before it in the stream is still running: it calls pdl_wait()
// before its first global memory access, which returns once the previous grid has completed and its writes
// are visible (so everything before that grid too). pdl_trigger(): this CTA lets the next kernel's CTAs be
// scheduled now (they wait in their pdl_wait()). Both are no-ops without PDL and before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Inter-CTA signalling through an integer counter in global memory (no float atomics):
// arrive() publishes this thread's earlier global writes (release), wait_count() spins until the
// counter reaches `target` (acquire). Only valid when every CTA involved is co-resident.
__device__ __forceinline__ void arrive(unsigned* counter) {
  __threadfence();
  atomicAdd(counter, 1u);
}
__device__ __forceinline__ void wait_count(const unsigned* counter, unsigned target) {
  unsigned v;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v >= target) break;
    __nanosleep(64);
  }
}
// After wait_count(counter, target) returned: the target-th thread to depart (one per arrival) resets
// the counter to zero for the next launch. Departures take the counter from target towards 2 * target,
// so waiters still spinning see >= target; atomicInc wraps the last one (old value 2 * target - 1) to
// zero, after every waiter has passed. Nothing uses its result, so the thread never waits for it: an
// atomicAdd whose result decided an atomicExch put a round trip to L2 on every tile's critical path
// (one-pass forward, H100 same-machine A/B: L1#35 6.20 -> 6.41 ms, 128x64x258² fp32 1.81 -> 1.94;
// with atomicInc 6.20 and 1.81 again).
__device__ __forceinline__ void depart(unsigned* counter, unsigned target) {
  atomicInc(counter, 2 * target - 1);
}

// ---------------------------------------------------------------------------------------------
// Welford state: mean, M2 = sum((x - mean)^2) and count, all float32.
struct WelfordState {
  float mean, m2, n;
};

// Chan's parallel merge of two Welford states. Deterministic for a fixed merge order.
__device__ __forceinline__ WelfordState welford_merge(const WelfordState& a, const WelfordState& b) {
  const float n = a.n + b.n;
  if (n == 0.f) return a;
  const float wb = __fdividef(b.n, n);
  const float delta = b.mean - a.mean;
  return {fmaf(delta, wb, a.mean), a.m2 + b.m2 + delta * delta * a.n * wb, n};
}

// Exact two-pass statistics of P values held in registers (no cancellation).
template <int P>
__device__ __forceinline__ WelfordState welford_of(const float* v) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < P; ++j) sum += v[j];
  const float mean = sum * (1.f / P);
  float m2 = 0.f;
#pragma unroll
  for (int j = 0; j < P; ++j) m2 = fmaf(v[j] - mean, v[j] - mean, m2);
  return {mean, m2, static_cast<float>(P)};
}

// ---------------------------------------------------------------------------------------------
// Reductions with a fixed combination order (bitwise reproducible run to run).
__device__ __forceinline__ WelfordState shfl_xor(const WelfordState& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.mean, mask), __shfl_xor_sync(0xffffffffu, s.m2, mask),
          __shfl_xor_sync(0xffffffffu, s.n, mask)};
}
__device__ __forceinline__ float shfl_xor(float s, int mask) { return __shfl_xor_sync(0xffffffffu, s, mask); }
__device__ __forceinline__ float2 shfl_xor(const float2& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.x, mask), __shfl_xor_sync(0xffffffffu, s.y, mask)};
}
__device__ __forceinline__ double2 shfl_xor(const double2& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.x, mask), __shfl_xor_sync(0xffffffffu, s.y, mask)};
}

struct WelfordOp {
  using T = WelfordState;
  __device__ static T identity() { return {0.f, 0.f, 0.f}; }
  __device__ static T combine(const T& a, const T& b) { return welford_merge(a, b); }
};
struct SumOp {
  using T = float;
  __device__ static T identity() { return 0.f; }
  __device__ static T combine(const T& a, const T& b) { return a + b; }
};
struct Sum2Op {
  using T = float2;
  __device__ static T identity() { return {0.f, 0.f}; }
  __device__ static T combine(const T& a, const T& b) { return {a.x + b.x, a.y + b.y}; }
};
struct Sum2dOp {  // two sums in double (e.g. sum and sum of squares before a variance)
  using T = double2;
  __device__ static T identity() { return {0.0, 0.0}; }
  __device__ static T combine(const T& a, const T& b) { return {a.x + b.x, a.y + b.y}; }
};

template <typename Op>
__device__ __forceinline__ typename Op::T warp_reduce(typename Op::T v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = Op::combine(v, shfl_xor(v, mask));
  return v;
}

// Block-wide reduction; blockDim.x must be a multiple of 32. The result is returned to every
// thread. `scratch` holds 33 values of Op::T; the call ends with a barrier so it can be reused.
template <typename Op>
__device__ typename Op::T block_reduce(typename Op::T v, typename Op::T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce<Op>(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? scratch[lane] : Op::identity();
    v = warp_reduce<Op>(v);
    if (lane == 0) scratch[32] = v;
  }
  __syncthreads();
  v = scratch[32];
  __syncthreads();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Division of n < 2^31 by a fixed divisor d in [1, 2^31) with a multiply-high (Granlund-Montgomery).
struct FastDivmod {
  uint32_t divisor = 1, multiplier = 1, shift = 0;
  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((1ull << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, multiplier) + n) >> shift; }
};


// ---------------------------------------------------------------------------------------------
// Input prologues of the GroupNorm kernels: a = act(z + bias[c]) is what gets normalized (the
// fused ConvTranspose2d + GELU + GroupNorm op feeds the conv output z). The formulas and constants
// are PyTorch's F.gelu (approximate='none': x * Phi(x); 'tanh': the tanh approximation).
// pre_apply returns a; pre_apply_grad also returns da/dz. Kinds: pointwise.h.

template <int P>
__device__ __forceinline__ float pre_apply(float z, float b) {
  if constexpr (P == kPreNone) {
    return z;
  } else if constexpr (P == kPreBiasGelu) {
    const float u = z + b;
    return 0.5f * u * (1.f + erff(u * 0.70710678118654752f));
  } else {
    const float u = z + b;
    const float inner = 0.79788456080286536f * (u + 0.044715f * u * u * u);
    return 0.5f * u * (1.f + tanhf(inner));
  }
}

template <int P>
__device__ __forceinline__ float pre_apply_grad(float z, float b, float& a) {
  if constexpr (P == kPreNone) {
    a = z;
    return 1.f;
  } else if constexpr (P == kPreBiasGelu) {
    // a by pre_apply's exact expression: the backward's a must equal the forward's bit for bit, or the
    // GroupNorm backward's cancellations (sum of dx over a group = 0) break when |mean| >> std.
    const float u = z + b;
    a = pre_apply<P>(z, b);
    const float cdf = 0.5f * (1.f + erff(u * 0.70710678118654752f));
    return cdf + u * 0.39894228040143268f * __expf(-0.5f * u * u);
  } else {
    const float u = z + b;
    const float kBeta = 0.79788456080286536f, kKappa = 0.044715f;
    const float t = tanhf(kBeta * (u + kKappa * u * u * u));
    a = pre_apply<P>(z, b);
    return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * u * u);
  }
}


// exp(x) and 1/x as one MUFU instruction each (PTX ex2.approx.ftz / rcp.approx.ftz): the approximations
// __expf and __fdividef use, without the scaling around them for subnormal inputs and results (the
// .ftz-less PTX forms), which the activations never need: exp's
// subnormal results (x < -87.3) and 1/d for d >= 2^126 become 0, as the exact values round to within
// 1e-37 of it in the products they feed.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh from one exp: sign(x) * (1 - 2 / (exp(2|x|) + 1)). Absolute error ~1e-7, so its relative error
// grows for |x| << 1: for values that are summed afterwards (the logsumexp kernels), not for outputs.
__device__ __forceinline__ float tanh_one_exp(float x) {
  return copysignf(1.f - __fdividef(2.f, __expf(2.f * fabsf(x)) + 1.f), x);
}
template <bool Fast>
__device__ __forceinline__ float tanh_(float x) {
  if constexpr (Fast) {
    return tanh_one_exp(x);
  } else {
    return tanhf(x);
  }
}

// Output activations of group_norm_act (PyTorch's formulas; derivatives as in its backward kernels).
// Fast: tanh with an absolute (not relative) error bound of ~1e-7 (tanh_one_exp).
template <int A, bool Fast = false>
__device__ __forceinline__ float act_apply(float n) {
  if constexpr (A == kActIdentity) {
    return n;
  } else if constexpr (A == kActSilu) {
    // Two MUFU ops and two multiplies (exp_ftz, rcp_ftz), where '/' adds a Newton step, a range check
    // and a slow-path call per element. n < -87: exp(-n) = inf or beyond 2^126, the product is (-)0, as
    // the exact n * sigmoid(n) rounds to within 1e-36 of it.
    return n * rcp_ftz(1.f + exp_ftz(-n));
  } else if constexpr (A == kActGelu) {
    return 0.5f * n * (1.f + erff(n * 0.70710678118654752f));
  } else if constexpr (A == kActGeluTanh) {
    return 0.5f * n * (1.f + tanh_<Fast>(0.79788456080286536f * (n + 0.044715f * n * n * n)));
  } else if constexpr (A == kActRelu) {
    return n > 0.f ? n : (n == n ? 0.f : n);  // NaN propagates, as torch.relu
  } else if constexpr (A == kActTanh) {
    return tanh_<Fast>(n);
  } else if constexpr (A == kActHardswish) {
    return n * fminf(fmaxf(n + 3.f, 0.f), 6.f) * (1.f / 6.f);
  } else {  // |tanh| <= 1: hardswish(t) = t * (t + 3) / 6 (NaN propagates)
    const float t = tanh_<Fast>(n);
    return t * (t + 3.f) * (1.f / 6.f);
  }
}

template <int A, bool Fast = false>
__device__ __forceinline__ float act_grad(float n) {
  if constexpr (A == kActIdentity) {
    return 1.f;
  } else if constexpr (A == kActSilu) {
    const float s = rcp_ftz(1.f + exp_ftz(-n));  // as act_apply
    return s * (1.f + n * (1.f - s));
  } else if constexpr (A == kActGelu) {
    const float cdf = 0.5f * (1.f + erff(n * 0.70710678118654752f));
    return cdf + n * 0.39894228040143268f * __expf(-0.5f * n * n);
  } else if constexpr (A == kActGeluTanh) {
    const float kBeta = 0.79788456080286536f, kKappa = 0.044715f;
    const float t = tanh_<Fast>(kBeta * (n + kKappa * n * n * n));
    return 0.5f * (1.f + t) + 0.5f * n * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * n * n);
  } else if constexpr (A == kActRelu) {
    return n > 0.f ? 1.f : 0.f;
  } else if constexpr (A == kActTanh) {
    const float t = tanh_<Fast>(n);
    return 1.f - t * t;
  } else if constexpr (A == kActHardswish) {
    return n < -3.f ? 0.f : (n <= 3.f ? n * (1.f / 3.f) + 0.5f : 1.f);
  } else {
    const float t = tanh_<Fast>(n);  // |t| <= 1: hardswish'(t) = t / 3 + 1 / 2
    return fmaf(t, 1.f / 3.f, 0.5f) * (1.f - t * t);
  }
}

// The backward through an output activation: dy' = dy * act'(n), n = sg * xm + sb (xm = x - mean,
// sg = rstd * gamma, sb = beta), the same fmaf the forward normalized with, so the derivative is taken
// at the value the forward produced (kinks of ReLU/hardswish included). Every backward kernel (two-pass,
// one-pass, wide) feeds its GroupNorm sums and its dx step with dy'.
template <int A>
__device__ __forceinline__ float act_dy(float dy, float xm, float sg, float sb) {
  if constexpr (A == kActIdentity) {
    return dy;
  } else {
    return dy * act_grad<A>(fmaf(sg, xm, sb));
  }
}

}  // namespace gnext
