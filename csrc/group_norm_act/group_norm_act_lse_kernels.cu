// SPDX-License-Identifier: BSD-3-Clause
// Kernels of group_norm_act_logsumexp (see group_norm_act_lse_launch.h for the phases and the layout) and their
// launcher: dtype / activation / phase / kernel dispatch only; errors return as cudaError_t.
#include <cmath>
#include <type_traits>

#include "../common/device_utils.cuh"
#include "../group_norm/group_norm_dispatch.cuh"
#include "group_norm_act_lse_launch.h"

namespace gnext {
namespace lse {
namespace {

// Online logsumexp state (m, s): logsumexp = m + log(s). One exp per element; r == m covers
// +inf == +inf (torch.logsumexp gives +inf there), a NaN r makes s NaN.
__device__ __forceinline__ void lse_update(float r, float& m, float& s) {
  const float e = r == m ? 1.f : __expf(-fabsf(r - m));
  if (r > m) {
    s = fmaf(s, e, 1.f);
    m = r;
  } else {
    s += e;
  }
}
// Merge of two states (m, s) and (m2, s2), same conventions.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  if (m2 > m) {
    const float t = m, u = s;
    m = m2, s = s2, m2 = t, s2 = u;
  }
  s += m2 == m ? s2 : s2 * __expf(m2 - m);
}

// Per-channel forward parameters q = (rstd*gamma, mean, beta, shift) of channel c in image n.
__device__ __forceinline__ float4 chan_params(const LseArgs& a, int64_t n, int c) {
  const int64_t g = n * a.G + c / (a.C / a.G);
  const float gm = a.gamma ? a.gamma[c] : 1.f, bt = a.beta ? a.beta[c] : 0.f, sh = a.shift ? a.shift[c] : 0.f;
  return make_float4(a.rstd[g] * gm, a.mean[g], bt, sh);
}

// r = [residual] v + act(y) with v = z + shift, xm = v - mean, y = rstd*gamma*xm + beta.
template <int ACT>
__device__ __forceinline__ float lse_r(float z, const float4& q, bool residual, float& xm, float& y) {
  const float v = z + q.w;
  xm = v - q.y;
  y = fmaf(q.x, xm, q.z);
  const float act = act_apply<ACT, true>(y);  // tanh_one_exp: its ~1e-7 absolute error is summed
  return residual ? act + v : act;
}

// Per-channel sums of one phase: (sum dy*xm, sum dy) for kLseGradStats, sum dx for kLseGradInput.
template <int PHASE>
constexpr int kAccFloats = PHASE == kLseGradStats ? 2 : 1;

// The CTA's per-channel sums: `rows` rows of C * kAcc floats in shared memory, added in row order
// (deterministic) into partial[((n * K + k) * C + c) * kAcc + i], this CTA being n * K + k.
template <int kAcc>
__device__ __forceinline__ void write_partials(const float* acc, int rows, int C, float* partial) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    for (int i = 0; i < kAcc; ++i) {
      float t = acc[c * kAcc + i];
      for (int w = 1; w < rows; ++w) t += acc[(w * C + c) * kAcc + i];
      partial[(row + c) * kAcc + i] = t;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Any layout (sC, sP), one thread per pixel looping over the channels (NCHW: coalesced across the
// warp's pixels). Per-channel sums: warp shuffles, then per-warp rows in shared memory.
template <typename T, int ACT, int PHASE>
__global__ void __launch_bounds__(kLseThreads) lse_pixel_kernel(const LseArgs a) {
  extern __shared__ float4 smem[];
  const int C = static_cast<int>(a.C);
  const int64_t n = blockIdx.x / a.K, k = blockIdx.x % a.K, HxW = a.HxW;
  const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float4* prm = smem;
  float4* cf = prm + C;  // kLseGradInput: (mean, c2, rstd*gamma, c3)
  float* acc = reinterpret_cast<float*>(cf + (PHASE == kLseGradInput ? C : 0));
  constexpr int kAcc = kAccFloats<PHASE>;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    prm[c] = chan_params(a, n, c);
    if constexpr (PHASE == kLseGradInput) cf[c] = a.coef[n * C + c];
  }
  if constexpr (PHASE != kLseForward)
    for (int i = threadIdx.x; i < nwarps * C * kAcc; i += blockDim.x) acc[i] = 0.f;
  __syncthreads();
  const bool sums = PHASE == kLseGradStats || (PHASE == kLseGradInput && a.partial != nullptr);
  const int64_t p0 = k * a.chunk, p1 = p0 + a.chunk < HxW ? p0 + a.chunk : HxW;
  const T* x = static_cast<const T*>(a.x) + n * a.C * HxW;
  T* dx = PHASE == kLseGradInput ? static_cast<T*>(a.dx) + n * a.C * HxW : nullptr;
  for (int64_t base = p0; base < p1; base += blockDim.x) {
    const int64_t p = base + threadIdx.x;
    const bool active = p < p1;
    float L = 0.f, gr = 0.f;
    if constexpr (PHASE != kLseForward) {
      if (active) {
        L = to_float(static_cast<const T*>(a.out)[n * HxW + p]);
        gr = to_float(static_cast<const T*>(a.grad)[n * HxW + p]);
      }
    }
    float m = -INFINITY, s = 0.f;
    const int64_t off = p * a.sP;
#pragma unroll 4
    for (int c = 0; c < C; ++c) {
      const float z = active ? to_float(x[off + c * a.sC]) : 0.f;
      float xm, y;
      const float r = lse_r<ACT>(z, prm[c], a.residual, xm, y);
      if constexpr (PHASE == kLseForward) {
        lse_update(r, m, s);
      } else {
        const float dr = active ? gr * __expf(r - L) : 0.f;
        const float dy = active ? dr * act_grad<ACT, true>(y) : 0.f;
        if constexpr (PHASE == kLseGradStats) {
          const float2 t = warp_reduce<Sum2Op>(make_float2(dy * xm, dy));
          if (lane == 0) {
            acc[(warp * C + c) * 2] += t.x;
            acc[(warp * C + c) * 2 + 1] += t.y;
          }
        } else {
          const float4 kc = cf[c];
          const float d = fmaf(kc.z, dy, fmaf(kc.y, xm, kc.w)) + (a.residual ? dr : 0.f);
          if (active) dx[off + c * a.sC] = static_cast<T>(d);
          if (sums) {
            const float t = warp_reduce<SumOp>(active ? d : 0.f);
            if (lane == 0) acc[warp * C + c] += t;
          }
        }
      }
    }
    if constexpr (PHASE == kLseForward)
      if (active) static_cast<T*>(a.out)[n * HxW + p] = static_cast<T>(m + logf(s));
  }
  if (!sums) return;
  __syncthreads();
  write_partials<kAcc>(acc, nwarps, C, a.partial);
}

// ---------------------------------------------------------------------------------------------
// Channels innermost (channels_last, HxW == 1) with C <= 32 * kLanesCpt: `tpp` lanes share a pixel,
// each owning kLanesCpt consecutive channels (16-byte accesses of V elements), so a warp reads 32/tpp
// whole pixel rows. A thread's logsumexp over its channels is a local max and sum; the tpp partial
// results are merged with shuffles. Per-channel sums stay in registers over all the thread's pixels
// and are combined through shared memory at the end.
template <typename T, int ACT, int PHASE>
__global__ void __launch_bounds__(kLseThreads) lse_lanes_kernel(const LseArgs a) {
  extern __shared__ float4 smem[];
  constexpr int V = 16 / sizeof(T), CPT = kLanesCpt, J = CPT / V;
  constexpr int kAcc = kAccFloats<PHASE>;
  float* acc = reinterpret_cast<float*>(smem);
  const int C = static_cast<int>(a.C), tpp = a.tpp;
  const int64_t n = blockIdx.x / a.K, k = blockIdx.x % a.K, HxW = a.HxW;
  const int cv = threadIdx.x & (tpp - 1), slot = threadIdx.x / tpp, slots = blockDim.x / tpp;
  const int c0 = cv * CPT;
  const bool has_ch = c0 < C;
  float4 q[CPT], kc[PHASE == kLseGradInput ? CPT : 1];
#pragma unroll
  for (int j = 0; j < CPT; ++j) {
    q[j] = chan_params(a, n, has_ch ? c0 + j : 0);
    if constexpr (PHASE == kLseGradInput) kc[j] = a.coef[n * C + (has_ch ? c0 + j : 0)];
  }
  float sa[CPT], sb[CPT];
#pragma unroll
  for (int j = 0; j < CPT; ++j) sa[j] = sb[j] = 0.f;
  const bool sums = PHASE == kLseGradStats || (PHASE == kLseGradInput && a.partial != nullptr);
  const int64_t p0 = k * a.chunk, p1 = p0 + a.chunk < HxW ? p0 + a.chunk : HxW;
  const T* x = static_cast<const T*>(a.x) + n * a.C * HxW;
#pragma unroll 2
  for (int64_t base = p0; base < p1; base += slots) {
    const int64_t p = base + slot;
    const bool active = p < p1, ld = active && has_ch;
    float z[CPT];
    if (ld) {
#pragma unroll
      for (int jj = 0; jj < J; ++jj) load_vec<T, V>(x + p * C + c0 + jj * V, z + jj * V);
    } else {
#pragma unroll
      for (int j = 0; j < CPT; ++j) z[j] = 0.f;
    }
    if constexpr (PHASE == kLseForward) {
      float r[CPT], m = -INFINITY;
#pragma unroll
      for (int j = 0; j < CPT; ++j) {
        float xm, y;
        r[j] = lse_r<ACT>(z[j], q[j], a.residual, xm, y);
        m = fmaxf(m, r[j]);  // a NaN r is skipped here and makes s NaN below
      }
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < CPT; ++j) s += r[j] == m ? 1.f : __expf(r[j] - m);  // r == m: +-inf
      if (!ld) m = -INFINITY, s = 0.f;
      for (int mask = tpp >> 1; mask > 0; mask >>= 1)
        lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, mask), __shfl_xor_sync(0xffffffffu, s, mask));
      if (active && cv == 0) static_cast<T*>(a.out)[n * HxW + p] = static_cast<T>(m + logf(s));
    } else {
      float L = 0.f, gr = 0.f;
      if (ld) {
        L = to_float(static_cast<const T*>(a.out)[n * HxW + p]);
        gr = to_float(static_cast<const T*>(a.grad)[n * HxW + p]);
      }
      float o[CPT];
#pragma unroll
      for (int j = 0; j < CPT; ++j) {
        float xm, y;
        const float r = lse_r<ACT>(z[j], q[j], a.residual, xm, y);
        const float dr = ld ? gr * __expf(r - L) : 0.f;
        const float dy = ld ? dr * act_grad<ACT, true>(y) : 0.f;
        if constexpr (PHASE == kLseGradStats) {
          sa[j] = fmaf(dy, xm, sa[j]);
          sb[j] += dy;
        } else {
          o[j] = fmaf(kc[j].z, dy, fmaf(kc[j].y, xm, kc[j].w)) + (a.residual ? dr : 0.f);
          if (ld) sa[j] += o[j];
        }
      }
      if constexpr (PHASE == kLseGradInput)
        if (ld) {
          T* dx = static_cast<T*>(a.dx) + n * a.C * HxW + p * C + c0;
#pragma unroll
          for (int jj = 0; jj < J; ++jj) store_vec<T, V>(dx + jj * V, o + jj * V);
        }
    }
  }
  if (!sums) return;
  if (has_ch) {
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      acc[(slot * C + c0 + j) * kAcc] = sa[j];
      if constexpr (kAcc == 2) acc[(slot * C + c0 + j) * kAcc + 1] = sb[j];
    }
  }
  __syncthreads();
  write_partials<kAcc>(acc, slots, C, a.partial);
}

}  // namespace

cudaError_t launch_lse(int phase, const LseArgs& a, cudaStream_t stream) {
  return gn::with_scalar(a.t, [&](auto tt) {
    using T = decltype(tt);
    auto by_act = [&](auto aa) -> cudaError_t {
      constexpr int ACT = decltype(aa)::value;
      auto go = [&](auto kernel) -> cudaError_t {
        if (a.smem > 48 * 1024) {
          const cudaError_t e =
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(a.smem));
          if (e != cudaSuccess) return e;
        }
        kernel<<<static_cast<unsigned>(a.N * a.K), a.threads, a.smem, stream>>>(a);
        return cudaGetLastError();
      };
      auto by_phase = [&](auto pp) -> cudaError_t {
        constexpr int PHASE = decltype(pp)::value;
        return a.tpp > 0 ? go(lse_lanes_kernel<T, ACT, PHASE>) : go(lse_pixel_kernel<T, ACT, PHASE>);
      };
      switch (phase) {
        case kLseForward:
          return by_phase(std::integral_constant<int, kLseForward>{});
        case kLseGradStats:
          return by_phase(std::integral_constant<int, kLseGradStats>{});
        case kLseGradInput:
          return by_phase(std::integral_constant<int, kLseGradInput>{});
      }
      return cudaErrorInvalidValue;
    };
    return gn::with_int<0, kActCount>(a.act, by_act);
  });
}

}  // namespace lse
}  // namespace gnext
