// SPDX-License-Identifier: BSD-3-Clause
// GroupNorm CUDA kernels (Wu & He 2018): y = (x - mean[n,g]) * rstd[n,g] * gamma[c] + beta[c],
// rstd = 1 / sqrt(var + eps), var the biased variance over the D = C/G channels x HxW positions
// of group g of sample n.
//
// Both directions are a per-channel reduction, a tiny per-(n, g) finalize, then one
// elementwise pass with per-(n, c) coefficients:
//   forward : Welford partials of x       -> mean, rstd, coef = (mean, rstd*gamma, 0, beta)
//   backward: partial sums of dy*(x-mean), dy -> coef = (mean, c2, rstd*gamma, c3), dgamma/dbeta
//   pass    : out = coef.y * (x - coef.x) + coef.z * dy + coef.w
// Every reduction combines in a fixed order (no float atomics): results are bitwise
// reproducible. Offsets are int64. Two memory layouts:
//   NCHW: contiguous (N*C rows of HxW); a CTA reduces one chunk of one row.
//   NHWC: channels_last (N, HxW rows of C); a CTA reduces a range of rows, all C channels.
#pragma once
#include "../common/device_utils.cuh"
#include "group_norm_launch.h"

namespace gnext {
namespace gn {

// gamma/beta/bias element c as float (dflt when p is null).
__device__ __forceinline__ float load_param(const void* p, ScalarKind k, int64_t c, float dflt) {
  if (p == nullptr) return dflt;
  switch (k) {
    case ScalarKind::Half:
      return to_float(static_cast<const c10::Half*>(p)[c]);
    case ScalarKind::BFloat16:
      return to_float(static_cast<const c10::BFloat16*>(p)[c]);
    default:
      return static_cast<const float*>(p)[c];
  }
}

// One warp merges the grid's n Welford partials of a group, partial j at p[j] (written by other CTAs: read from
// L2): lane l takes j = l, l + 32, ... in order with all 8 loads of a step issued before its merges (one L2 round
// trip per 8 * 32 partials, not one per partial), then the lanes merge by warp_reduce. The same bits in every CTA
// that runs it, no float atomics. Every lane returns the merged state.
__device__ __forceinline__ WelfordState warp_merge_partials(const WelfordState* p, unsigned n, int lane) {
  WelfordState m = WelfordOp::identity();
  for (unsigned j0 = lane; j0 < n; j0 += 8 * 32) {
    WelfordState q[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float* f = reinterpret_cast<const float*>(p + j0 + k * 32);
      q[k] = j0 + k * 32 < n ? WelfordState{__ldcg(f), __ldcg(f + 1), __ldcg(f + 2)} : WelfordOp::identity();
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) m = welford_merge(m, q[k]);
  }
  return warp_reduce<WelfordOp>(m);
}

// The backward's per-element terms of one 16-byte vector of x and of dy (V = 16 / sizeof(T) elements of one channel):
// xm = x - mean and dy' = dy * act'(n), n = xm * sg + sb (sg = rstd * gamma, sb = beta of the channel).
template <typename T, int A>
__device__ __forceinline__ void vec_grads(const uint4& xr, const uint4& dr, float mean, float sg, float sb, float* xm,
                                          float* dd) {
  constexpr int V = 16 / sizeof(T);
  Pack<T, V> xv, dv;
  xv.raw = xr, dv.raw = dr;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    xm[j] = to_float(xv.v[j]) - mean;
    dd[j] = act_dy<A>(to_float(dv.v[j]), xm[j], sg, sb);
  }
}

// Adds one vector's terms of its channel's backward sums, (sum dy' * xm, sum dy'), to the slice's first channel's
// sums (s0) or to its second's (s1).
template <int V>
__device__ __forceinline__ void add_grad_sums(const float* xm, const float* dd, bool first, float2& s0, float2& s1) {
  float2 t = {0.f, 0.f};
#pragma unroll
  for (int e = 0; e < V; ++e) {
    t.x = fmaf(dd[e], xm[e], t.x);
    t.y += dd[e];
  }
  if (first) {
    s0.x += t.x, s0.y += t.y;
  } else {
    s1.x += t.x, s1.y += t.y;
  }
}

// out[e] = act((x[e] - mean) * rstd * gamma[c] + beta[c]) for the V elements at offset `off` of a group that starts
// at channel c0, c = c0 + (off + e) / HxW (hw: HxW). A vector may straddle channels (HxW not a multiple of V):
// one channel's parameters when it does not.
template <int A, int V>
__device__ __forceinline__ void normalize_straddling(float* x, uint32_t off, const FastDivmod& hw, int64_t c0,
                                                     float mean, float rstd, const void* gamma, const void* beta,
                                                     ScalarKind wt) {
  const uint32_t cf = hw.div(off), cl = hw.div(off + V - 1);
  if (cf == cl) {
    const float scale = rstd * load_param(gamma, wt, c0 + cf, 1.f), shift = load_param(beta, wt, c0 + cf, 0.f);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = act_apply<A>(fmaf(x[e] - mean, scale, shift));
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t c = c0 + hw.div(off + e);
      x[e] = act_apply<A>(fmaf(x[e] - mean, rstd * load_param(gamma, wt, c, 1.f), load_param(beta, wt, c, 0.f)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// What a reduction accumulates per channel.
struct MomentsReducer {  // forward: Welford statistics of x
  using Op = WelfordOp;
  using State = WelfordState;
  static constexpr bool kNeedsDy = false;
  template <int P>
  __device__ static void accumulate(State& s, const float* x, const float*, float) {
    s = welford_merge(s, welford_of<P>(x));
  }
};

struct GradReducer {  // backward: (sum dy * (x - mean), sum dy)
  using Op = Sum2Op;
  using State = float2;
  static constexpr bool kNeedsDy = true;
  template <int P>
  __device__ static void accumulate(State& s, const float* x, const float* dy, float mu) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      s.x = fmaf(dy[j], x[j] - mu, s.x);
      s.y += dy[j];
    }
  }
};

// dy at (pixel row r, channels c0..c0+V) of one image of an NHWC backward kernel: a vector load in
// the input's channels_last layout, or V loads strided by HxW when dy is NCHW (the kernels' DyNchw). db points
// at the image (n * HxW * C elements in either layout).
template <typename T, int V>
__device__ __forceinline__ void load_dy_nhwc(const T* __restrict__ db, bool nchw, int64_t r, int c0, int C,
                                             int64_t HxW, float* out) {
  if (nchw) {
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = to_float(db[static_cast<int64_t>(c0 + j) * HxW + r]);
  } else {
    load_vec<T, V>(db + r * C + c0, out);
  }
}

// ---------------------------------------------------------------------------------------------
// NCHW reduction. grid = (N*C rows, K chunks of HxW); partial[(row * K) + k].
// `chunk` is a multiple of V; HxW % V == 0 when V > 1.
template <typename T, int V, typename R, int Pw>
__device__ __forceinline__ void reduce_nchw(const T* __restrict__ x, const T* __restrict__ dy,
                                            const float* __restrict__ mean, typename R::State* __restrict__ partial,
                                            int64_t HxW, int64_t chunk, int64_t C, int64_t D, int64_t G, PwArgs pw) {
  pdl_trigger();  // the finalize after it may launch (launch_dependent)
  pdl_wait();     // launched as dependent of the caller's previous kernel
  using State = typename R::State;
  __shared__ State scratch[33];
  const int64_t row = blockIdx.x;
  const int64_t h0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t len = min(HxW, h0 + chunk) - h0;
  const int64_t off = row * HxW + h0;
  float mu = 0.f;
  if constexpr (R::kNeedsDy) mu = mean[(row / C) * G + (row % C) / D];
  constexpr int P = pw_pre(Pw), A = pw_act(Pw);
  const float pb = P == kPreNone ? 0.f : load_param(pw.bias, pw.bias_t, row % C, 0.f);
  // Epilogue, backward: dy -> dy * act'(n), n = (x - mean) * rstd * gamma + beta.
  float sg = 0.f, sb = 0.f;
  if constexpr (R::kNeedsDy && A != kActIdentity) {
    sg = pw.rstd[(row / C) * G + (row % C) / D] * load_param(pw.gamma, pw.wt, row % C, 1.f);
    sb = load_param(pw.beta, pw.wt, row % C, 0.f);
  }
  auto epi_dy = [&](float* xs, float* ds, int n) {
    if constexpr (R::kNeedsDy && A != kActIdentity) {
      for (int e = 0; e < n; ++e) ds[e] = act_dy<A>(ds[e], xs[e] - mu, sg, sb);
    }
  };

  State s = R::Op::identity();
  const int64_t nvec = len / V, bs = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * bs < nvec; i += kUnroll * bs) {
    float xs[kUnroll * V], ds[kUnroll * V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load_vec<T, V>(x + off + (i + u * bs) * V, xs + u * V);
      if constexpr (R::kNeedsDy) load_vec<T, V>(dy + off + (i + u * bs) * V, ds + u * V);
    }
    if constexpr (P != kPreNone) {
#pragma unroll
      for (int e = 0; e < kUnroll * V; ++e) xs[e] = pre_apply<P>(xs[e], pb);
    }
    epi_dy(xs, ds, kUnroll * V);
    R::template accumulate<kUnroll * V>(s, xs, ds, mu);
  }
  for (; i < nvec; i += bs) {
    float xs[V], ds[V];
    load_vec<T, V>(x + off + i * V, xs);
    if constexpr (R::kNeedsDy) load_vec<T, V>(dy + off + i * V, ds);
    if constexpr (P != kPreNone) {
#pragma unroll
      for (int e = 0; e < V; ++e) xs[e] = pre_apply<P>(xs[e], pb);
    }
    epi_dy(xs, ds, V);
    R::template accumulate<V>(s, xs, ds, mu);
  }
  s = block_reduce<typename R::Op>(s, scratch);
  if (threadIdx.x == 0) partial[row * gridDim.y + blockIdx.y] = s;
}

template <typename T, int V, typename R, int Pw>
__global__ void __launch_bounds__(kMaxThreads)
    reduce_nchw_kernel(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ mean,
                       typename R::State* __restrict__ partial, int64_t HxW, int64_t chunk, int64_t C, int64_t D,
                       int64_t G, PwArgs pw) {
  reduce_nchw<T, V, R, Pw>(x, dy, mean, partial, HxW, chunk, C, D, G, pw);
}

// The forward's reduction without a prologue, at reduce_fwd_ctas_per_sm CTAs per SM: the planner counts its waves in
// them (reduce_fwd_chunks). A kernel of its own: a minimum-blocks bound on the template above also changed the
// registers of its other instances (the backward's and the prologues', 32-64 -> 40-124), which were not measured.
template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads, reduce_fwd_ctas_per_sm(sizeof(T), V))
    reduce_nchw_fwd_kernel(const T* __restrict__ x, typename MomentsReducer::State* __restrict__ partial,
                           int64_t HxW, int64_t chunk, int64_t C, int64_t D, int64_t G, PwArgs pw) {
  reduce_nchw<T, V, MomentsReducer, 0>(x, nullptr, nullptr, partial, HxW, chunk, C, D, G, pw);
}

// ---------------------------------------------------------------------------------------------
// NHWC reduction. grid = (N, K ranges of `rchunk` rows); partial[(n * K + k) * C + c].
// Thread t owns channel vectors cv = t % tpr (+ tpr, ...) and rows t / tpr (+ rpi, ...);
// dynamic shared memory holds rpi * C states.
template <typename T, int V, typename R, int Pw, bool DyNchw = false>
__global__ void __launch_bounds__(kMaxThreads)
    reduce_nhwc_kernel(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ mean,
                       typename R::State* __restrict__ partial, int64_t rows, int64_t rchunk, int C, int D, int G,
                       int tpr, int rpi, PwArgs pw) {
  pdl_trigger();  // the finalize after it may launch (launch_dependent)
  pdl_wait();     // launched as dependent of the caller's previous kernel
  using State = typename R::State;
  constexpr int P = pw_pre(Pw), A = pw_act(Pw);
  constexpr bool kEpi = R::kNeedsDy && A != kActIdentity;  // dy -> dy * act'(GroupNorm(x))
  extern __shared__ unsigned char smem_raw[];
  State* sm = reinterpret_cast<State*>(smem_raw);
  const int64_t n = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rchunk, r1 = min(rows, r0 + rchunk);
  const int lane_c = threadIdx.x % tpr, lane_r = threadIdx.x / tpr;
  const int CV = C / V;
  const T* xb = x + n * rows * C;
  const T* db = R::kNeedsDy ? dy + n * rows * C : nullptr;

  if constexpr (!R::kNeedsDy) {
    // Forward: per channel sum(a - a0) and sum((a - a0)^2), a0 = the thread's first row (a = x, or the
    // prologue's act(x + bias)), turned into a Welford state at the end. A Welford merge per 4 rows cost a
    // division and ~6 instructions per element; H100 same-process A/B, forward kernels µs Welford / shifted
    // sums: 1x128x1024x1024 fp16 CL 293.0 / 288.3,
    // 16x512x128x128 bf16 CL 294.2 / 289.0, 1x256x512x512 bf16 CL 157.5 / 153.8. The shift keeps the sums of
    // the spread's size near a large mean (as the small-group kernel's x - x0).
    if (lane_r < rpi) {
      for (int cv = lane_c; cv < CV; cv += tpr) {
        const int c0 = cv * V;
        float pb[V], sh[V], s1[V], s2[V];
        const int64_t rf = r0 + lane_r;
        float xf[V];
        if (rf < r1) {
          load_vec<T, V>(xb + rf * C + c0, xf);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) xf[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
          pb[j] = P == kPreNone ? 0.f : load_param(pw.bias, pw.bias_t, c0 + j, 0.f);
          sh[j] = pre_apply<P>(xf[j], pb[j]);
          s1[j] = 0.f, s2[j] = 0.f;
        }
        int cnt = 0;
        int64_t r = rf;
        for (; r + (kUnroll - 1) * rpi < r1; r += kUnroll * rpi) {
          float xs[kUnroll][V];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) load_vec<T, V>(xb + (r + u * rpi) * C + c0, xs[u]);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
              const float d = pre_apply<P>(xs[u][j], pb[j]) - sh[j];
              s1[j] += d;
              s2[j] = fmaf(d, d, s2[j]);
            }
          }
          cnt += kUnroll;
        }
        for (; r < r1; r += rpi) {
          float xs[V];
          load_vec<T, V>(xb + r * C + c0, xs);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float d = pre_apply<P>(xs[j], pb[j]) - sh[j];
            s1[j] += d;
            s2[j] = fmaf(d, d, s2[j]);
          }
          ++cnt;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
          State st = R::Op::identity();
          if (cnt > 0) {
            const float n = static_cast<float>(cnt), m = s1[j] / n;
            st.mean = sh[j] + m;
            st.m2 = fmaxf(s2[j] - s1[j] * m, 0.f);
            st.n = n;
          }
          sm[lane_r * C + c0 + j] = st;
        }
      }
    }
  } else {  // backward: (sum dy' (x - mean), sum dy')
    if (lane_r < rpi) {
      for (int cv = lane_c; cv < CV; cv += tpr) {
        const int c0 = cv * V;
        float mu[V], pb[V], sg[V], sb[V];
        State s[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          mu[j] = mean[n * G + (c0 + j) / D];
          pb[j] = P == kPreNone ? 0.f : load_param(pw.bias, pw.bias_t, c0 + j, 0.f);
          sg[j] = kEpi ? pw.rstd[n * G + (c0 + j) / D] * load_param(pw.gamma, pw.wt, c0 + j, 1.f) : 0.f;
          sb[j] = kEpi ? load_param(pw.beta, pw.wt, c0 + j, 0.f) : 0.f;
          s[j] = R::Op::identity();
        }
        int64_t r = r0 + lane_r;
        for (; r + (kUnroll - 1) * rpi < r1; r += kUnroll * rpi) {
          float xs[kUnroll][V], ds[kUnroll][V];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            load_vec<T, V>(xb + (r + u * rpi) * C + c0, xs[u]);
            load_dy_nhwc<T, V>(db, DyNchw, r + u * rpi, c0, C, rows, ds[u]);
          }
#pragma unroll
          for (int j = 0; j < V; ++j) {
            float xj[kUnroll], dj[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              xj[u] = pre_apply<P>(xs[u][j], pb[j]);
              dj[u] = act_dy<kEpi ? A : kActIdentity>(ds[u][j], xj[u] - mu[j], sg[j], sb[j]);
            }
            R::template accumulate<kUnroll>(s[j], xj, dj, mu[j]);
          }
        }
        for (; r < r1; r += rpi) {
          float xs[V], ds[V];
          load_vec<T, V>(xb + r * C + c0, xs);
          load_dy_nhwc<T, V>(db, DyNchw, r, c0, C, rows, ds);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            xs[j] = pre_apply<P>(xs[j], pb[j]);
            ds[j] = act_dy<kEpi ? A : kActIdentity>(ds[j], xs[j] - mu[j], sg[j], sb[j]);
            R::template accumulate<1>(s[j], xs + j, ds + j, mu[j]);
          }
        }
#pragma unroll
        for (int j = 0; j < V; ++j) sm[lane_r * C + c0 + j] = s[j];
      }
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    State s = sm[c];
    for (int q = 1; q < rpi; ++q) s = R::Op::combine(s, sm[q * C + c]);
    partial[(n * gridDim.y + blockIdx.y) * C + c] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward finalize, one CTA per (n, g): merge the D*K Welford partials of the group, write
// mean/rstd and the per-channel coefficients (mean, rstd * gamma, 0, beta). Up to 1024 threads
// (launch_finalize_forward: enough for one round of loads where D*K is large).
template <typename W>
__global__ void __launch_bounds__(1024)
    finalize_forward_kernel(const WelfordState* __restrict__ partial, PartialLayout L, const W* __restrict__ gamma,
                            const W* __restrict__ beta, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                            float4* __restrict__ coef, int64_t C, int64_t G, float eps, ChannelShift shift) {
  pdl_trigger();
  pdl_wait();  // launch_dependent: the kernel before it has completed
  __shared__ WelfordState scratch[33];
  const int64_t ng = blockIdx.x, n = ng / G, g = ng % G, D = C / G;
  const WelfordState* p = partial + n * L.s_n + g * D * L.s_c;
  // Consecutive threads read consecutive states: along k for NCHW partials (s_k == 1), along the
  // channel for NHWC ones (s_c == 1, k strided by C). Four loads in flight per thread before merging.
  WelfordState s = WelfordOp::identity();
  const int64_t total = D * L.K;
  const bool channel_fastest = L.s_c == 1 && L.s_k != 1;
  constexpr int kLoads = 4;
  for (int64_t j0 = threadIdx.x; j0 < total; j0 += kLoads * blockDim.x) {
    WelfordState q[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t j = j0 + u * blockDim.x;
      q[u] = WelfordOp::identity();
      if (j < total) {
        const int64_t d = channel_fastest ? j % D : j / L.K, k = channel_fastest ? j / D : j % L.K;
        q[u] = p[d * L.s_c + k * L.s_k];
        if (shift.p) q[u].mean += load_param(shift.p, shift.t, g * D + d, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) s = welford_merge(s, q[u]);
  }
  s = block_reduce<WelfordOp>(s, scratch);
  const float var = fmaxf(s.m2 / s.n, 0.f);
  const float rstd = rsqrtf(var + eps);
  if (threadIdx.x == 0) {
    mean_out[ng] = s.mean;
    rstd_out[ng] = rstd;
  }
  if (coef == nullptr) return;  // statistics only
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const int64_t c = g * D + d;
    const float w = gamma ? to_float(gamma[c]) : 1.f, b = beta ? to_float(beta[c]) : 0.f;
    // With a shift (statistics of x + shift[c]), the elementwise pass still reads x: x - (mean - shift[c]).
    coef[n * C + c] = make_float4(s.mean - load_param(shift.p, shift.t, c, 0.f), rstd * w, 0.f, b);
  }
}

// Backward finalize, one CTA per (n, g): per-channel sums (sum dy*(x-mean), sum dy) into dsum
// (for dgamma/dbeta) and the dx coefficients (mean, c2, rstd * gamma, c3) with
//   c2 = -rstd^3 * sum_c gamma*sum dy*(x-mean) / (D*HxW),  c3 = -rstd * sum_c gamma*sum dy / (D*HxW).
template <typename W>
__global__ void __launch_bounds__(256)
    finalize_backward_kernel(const float2* __restrict__ partial, PartialLayout L, const float* __restrict__ mean,
                             const float* __restrict__ rstd, const W* __restrict__ gamma, float2* __restrict__ dsum,
                             float4* __restrict__ coef, int64_t C, int64_t G, int64_t HxW) {
  pdl_trigger();
  pdl_wait();  // launch_dependent: the kernel before it has completed
  __shared__ float2 scratch[33];
  const int64_t ng = blockIdx.x, n = ng / G, g = ng % G, D = C / G;
  // Warp w sums the K partials of channels w, w + nwarps, ... (lanes stride over k).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float2 acc = {0.f, 0.f};
  for (int64_t d = warp; d < D; d += nwarps) {
    const int64_t c = g * D + d;
    const float2* p = partial + n * L.s_n + c * L.s_c;
    float2 t = {0.f, 0.f};
    for (int64_t k = lane; k < L.K; k += 32) t = Sum2Op::combine(t, p[k * L.s_k]);
    t = warp_reduce<Sum2Op>(t);
    if (lane == 0) {
      if (dsum) dsum[n * C + c] = t;
      const float w = gamma ? to_float(gamma[c]) : 1.f;
      acc.x = fmaf(w, t.x, acc.x);
      acc.y = fmaf(w, t.y, acc.y);
    }
  }
  if (coef == nullptr) return;  // uniform across the block: only dgamma/dbeta wanted
  acc = block_reduce<Sum2Op>(acc, scratch);
  const float r = rstd[ng], mu = mean[ng];
  const float inv_count = 1.f / static_cast<float>(D * HxW);
  const float c2 = -r * r * r * acc.x * inv_count;
  const float c3 = -r * acc.y * inv_count;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const int64_t c = g * D + d;
    const float w = gamma ? to_float(gamma[c]) : 1.f;
    coef[n * C + c] = make_float4(mu, c2, r * w, c3);
  }
}

// dgamma[c] = sum_n rstd[n,g] * sum dy*(x-mean);  dbeta[c] = sum_n sum dy. A CTA of kGammaBetaRows x 32
// threads per 32 channels: row y sums n = y, y + kGammaBetaRows, ... (loads of a warp: 32 consecutive
// channels), then row 0 adds the rows in order (deterministic). One thread per channel walked all N in turn:
// 1024x512x4x4 fp16 took ~190 us there, latency-bound.
constexpr int kGammaBetaRows = 16;
template <typename W>
__global__ void __launch_bounds__(32 * kGammaBetaRows)
    gamma_beta_backward_kernel(const float2* __restrict__ dsum, const float* __restrict__ rstd,
                               W* __restrict__ dgamma, W* __restrict__ dbeta, int64_t N, int64_t C, int64_t G) {
  pdl_wait();  // launch_dependent (no trigger: see small_backward_kernel)
  __shared__ float2 rows[kGammaBetaRows][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + tx;
  float2 acc = make_float2(0.f, 0.f);
  if (c < C) {
    const int64_t g = c / (C / G);
#pragma unroll 4
    for (int64_t n = ty; n < N; n += kGammaBetaRows) {
      const float2 t = dsum[n * C + c];
      acc.x = fmaf(t.x, rstd[n * G + g], acc.x);
      acc.y += t.y;
    }
  }
  rows[ty][tx] = acc;
  __syncthreads();
  if (ty != 0 || c >= C) return;
  for (int y = 1; y < kGammaBetaRows; ++y) {
    acc.x += rows[y][tx].x;
    acc.y += rows[y][tx].y;
  }
  if (dgamma) dgamma[c] = static_cast<W>(acc.x);
  if (dbeta) dbeta[c] = static_cast<W>(acc.y);
}

// ---------------------------------------------------------------------------------------------
// Elementwise pass: out = coef.y * (x - coef.x) [+ coef.z * dy] + coef.w, coef per (n, c).
template <bool HasDy>
__device__ __forceinline__ float channel_affine(const float4& k, float x, float dy) {
  float r = fmaf(k.y, x - k.x, k.w);
  if constexpr (HasDy) r = fmaf(k.z, dy, r);
  return r;
}

// channel_affine with the pointwise extension (pc: the channel's prologue bias, or for the
// epilogue's backward its beta). Prologue: of a = pre(x + pc); backward times pre'(x + pc).
// Epilogue: forward act(...) (the residual is added by the caller); backward with
// dy * act'(n), n = (x - mean) * rstd * gamma + beta = k.z * (x - k.x) + pc.
template <bool HasDy, int Pw>
__device__ __forceinline__ float pw_affine(const float4& k, float x, float dy, float pc) {
  constexpr int P = pw_pre(Pw), A = pw_act(Pw);
  if constexpr (P != kPreNone) {
    if constexpr (!HasDy) {
      return channel_affine<false>(k, pre_apply<P>(x, pc), 0.f);
    } else {
      float a;
      const float g = pre_apply_grad<P>(x, pc, a);
      return channel_affine<true>(k, a, dy) * g;
    }
  } else if constexpr (A == kActIdentity) {
    return channel_affine<HasDy>(k, x, dy);
  } else if constexpr (!HasDy) {
    return act_apply<A>(channel_affine<false>(k, x, 0.f));
  } else {
    return channel_affine<true>(k, x, act_dy<A>(dy, x - k.x, k.z, pc));
  }
}

// Per-channel value pc of pw_affine for channel c.
template <bool HasDy, int Pw>
__device__ __forceinline__ float pw_channel(const PwArgs& pw, int64_t c) {
  if constexpr (pw_pre(Pw) != kPreNone) return load_param(pw.bias, pw.bias_t, c, 0.f);
  if constexpr (HasDy && pw_act(Pw) != kActIdentity) return load_param(pw.beta, pw.wt, c, 0.f);
  return 0.f;
}

// Loads U vectors (x and, for the backward, dy) at offs[u] before any store, then writes
// out = channel_affine(...) for each. All U loads are in flight together, held as raw vectors until
// used (float arrays of x and the optional residual cost the 2-byte forward ~100 registers, one
// 512-thread CTA per SM; raw, 58-64; docs/decisions/two-pass-split.md).
// res: the epilogue's residual (forward), added last, or null.
template <typename T, int V, bool HasDy, int Pw, int U>
__device__ __forceinline__ void affine_vecs(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                                            const int64_t (&offs)[U], const float4* k, const float* pc, int k_stride,
                                            const T* __restrict__ res) {
  using Raw = typename Pack<T, V>::Raw;
  Raw xr[U], dr[U], rr[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    // The forward's loads in program order before the stores (ld_ordered): float32 forwards 3-5% faster on the H200;
    // the backward keeps the read-only path, where ordered loads made the H200's 2-byte SiLU backward 1.5-1.9% slower.
    if constexpr (HasDy) {
      xr[u] = ldg_raw(reinterpret_cast<const Raw*>(x + offs[u]));
      dr[u] = ldg_raw(reinterpret_cast<const Raw*>(dy + offs[u]));
    } else {
      xr[u] = ld_ordered(reinterpret_cast<const Raw*>(x + offs[u]));
      if (res != nullptr) rr[u] = ld_ordered(reinterpret_cast<const Raw*>(res + offs[u]));
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    Pack<T, V> px, pd, pr;
    px.raw = xr[u];
    if constexpr (HasDy) pd.raw = dr[u];
    float o[V];
#pragma unroll
    for (int j = 0; j < V; ++j)
      o[j] = pw_affine<HasDy, Pw>(k[j * k_stride], to_float(px.v[j]), HasDy ? to_float(pd.v[j]) : 0.f,
                                  pc[j * k_stride]);
    if (!HasDy && res != nullptr) {
      pr.raw = rr[u];
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] += to_float(pr.v[j]);
    }
    store_vec<T, V>(out + offs[u], o);
  }
}

// The backward's affine_vecs for an NHWC input whose dy is NCHW (DyNchw): x and dx at offs[u]
// (channels_last), dy of pixel row rr[u] and channels c0.. of the image at dyb (load_dy_nhwc).
template <typename T, int V, int Pw, int U>
__device__ __forceinline__ void affine_vecs_dy_nchw(const T* __restrict__ x, const T* __restrict__ dyb,
                                                    T* __restrict__ out, const int64_t (&offs)[U],
                                                    const int64_t (&rr)[U], int c0, int64_t HxW, const float4* k,
                                                    const float* pc) {
  float xs[U][V], ds[U][V];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    load_vec<T, V>(x + offs[u], xs[u]);
    load_dy_nhwc<T, V>(dyb, true, rr[u], c0, 0, HxW, ds[u]);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) xs[u][j] = pw_affine<true, Pw>(k[j], xs[u][j], ds[u][j], pc[j]);
    store_vec<T, V>(out + offs[u], xs[u]);
  }
}

// NCHW. Long rows: a CTA covers `chunk` elements of one row; grid = (N*C*chunks) with row-major CTAs
// (rows_per_cta == 0) or (N*C, chunks) (rows_per_cta == 1). Short rows: grid = (ceil(N*C / rows_per_cta)),
// a CTA covers rows_per_cta whole rows and finds each vector's row with a fast divide by HxW/V.
// The 2-byte forward is held to 40 registers, three CTAs per SM (1.5x the bytes in flight of two); without a residual
// it does not spill there. The float32 forward to 64, two CTAs (three were 0.3-0.6% slower; unbounded, the copy of the
// loop without a residual took it to 56-89).
template <typename T, int V, bool HasDy, int Pw>
__global__ void __launch_bounds__(kMaxThreads, HasDy ? 1 : affine_fwd_ctas_per_sm(sizeof(T)))
    affine_nchw_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                       const float4* __restrict__ coef, int64_t rows, int64_t HxW, int64_t chunk, int rows_per_cta,
                       FastDivmod hwv, int64_t C, PwArgs pw) {
  pdl_wait();  // launch_dependent: coef is written
  const int64_t bs = blockDim.x;
  const T* res = static_cast<const T*>(pw.residual);
  // CTAs walk the grid backwards: the reduction walked (row, chunk) forwards, so the first CTAs
  // here re-read from L2 (50 MB on the H100) what it read last.
  const int64_t bx = gridDim.x - 1 - blockIdx.x, by = gridDim.y - 1 - blockIdx.y;
  if (rows_per_cta <= 1) {
    int64_t row = bx, h0 = by * chunk;
    if (rows_per_cta == 0) {  // tiles: a 1-D grid of per_row CTAs per row
      const int64_t per_row = (HxW + chunk - 1) / chunk;
      row = bx / per_row, h0 = bx % per_row * chunk;
    }
    const int64_t nvec = (min(HxW, h0 + chunk) - h0) / V, off = row * HxW + h0;
    const float4 k = coef[row];
    const float pc = pw_channel<HasDy, Pw>(pw, row % C);
    // Without a residual, a copy of the loop that has none of its registers.
    auto run = [&](auto with_res) {
      const T* r = decltype(with_res)::value ? res : nullptr;
      int64_t i = threadIdx.x;
      for (; i + (kUnroll - 1) * bs < nvec; i += kUnroll * bs) {
        int64_t offs[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) offs[u] = off + (i + u * bs) * V;
        affine_vecs<T, V, HasDy, Pw>(x, dy, out, offs, &k, &pc, 0, r);
      }
      for (; i < nvec; i += bs) {
        const int64_t offs[1] = {off + i * V};
        affine_vecs<T, V, HasDy, Pw>(x, dy, out, offs, &k, &pc, 0, r);
      }
    };
    if (!HasDy && res != nullptr)
      run(std::true_type{});
    else
      run(std::false_type{});
  } else {
    const int64_t r0 = bx * rows_per_cta;
    const uint32_t total = static_cast<uint32_t>(min(static_cast<int64_t>(rows_per_cta), rows - r0) * (HxW / V));
    const int64_t off = r0 * HxW;
    for (uint32_t j = threadIdx.x; j < total; j += blockDim.x) {
      const int64_t row = r0 + hwv.div(j);
      const float4 k = coef[row];
      const float pc = pw_channel<HasDy, Pw>(pw, row % C);
      const int64_t offs[1] = {off + static_cast<int64_t>(j) * V};
      affine_vecs<T, V, HasDy, Pw>(x, dy, out, offs, &k, &pc, 0, res);
    }
  }
}

// NHWC. grid = (N, K ranges of rchunk rows); thread layout as in reduce_nhwc_kernel. DyNchw: dy is
// NCHW-contiguous (backward; see PwArgs::dy_nchw). The body of affine_nhwc_kernel and affine_nhwc_act_bwd_kernel.
// kU2: two vectors per thread and trip instead of kUnroll.
template <typename T, int V, bool HasDy, int Pw, bool DyNchw, bool kU2 = false>
__device__ __forceinline__ void affine_nhwc(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                                            const float4* __restrict__ coef, int64_t rows, int64_t rchunk, int C,
                                            int tpr, int rpi, PwArgs pw) {
  pdl_wait();  // launch_dependent: coef is written
  // Backwards over the grid, as in affine_nchw_kernel: the reduction's last chunks are in L2.
  const int64_t n = gridDim.x - 1 - blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * rchunk, r1 = min(rows, r0 + rchunk);
  const int lane_c = threadIdx.x % tpr, lane_r = threadIdx.x / tpr;
  if (lane_r >= rpi) return;
  const int CV = C / V;
  const int64_t base = n * rows * C;
  const T* res = static_cast<const T*>(pw.residual);
  for (int cv = lane_c; cv < CV; cv += tpr) {
    const int c0 = cv * V;
    float4 k[V];
    float pc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      k[j] = coef[n * C + c0 + j];
      pc[j] = pw_channel<HasDy, Pw>(pw, c0 + j);
    }
    int64_t r = r0 + lane_r;
    if constexpr (HasDy && DyNchw) {  // dy NCHW: its image starts at the same element offset, base
      for (; r + (kUnroll - 1) * rpi < r1; r += kUnroll * rpi) {
        int64_t offs[kUnroll], rr[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) rr[u] = r + u * rpi, offs[u] = base + rr[u] * C + c0;
        affine_vecs_dy_nchw<T, V, Pw>(x, dy + base, out, offs, rr, c0, rows, k, pc);
      }
      for (; r < r1; r += rpi) {
        const int64_t offs[1] = {base + r * C + c0}, rr[1] = {r};
        affine_vecs_dy_nchw<T, V, Pw>(x, dy + base, out, offs, rr, c0, rows, k, pc);
      }
      continue;
    }
    // affine_nhwc_act_bwd_kernel: two vectors per thread and trip (kU2). Each chunk's rows backwards: the
    // reduction's CTAs are co-resident, so what L2 holds after it is the end of every chunk, not the last
    // chunks. H100 same-process A/B, GroupNorm forward kernel µs forwards / backwards:
    // 1x128x1024x1024 fp16 CL 307.4 / 303.1, 16x512x128x128 bf16
    // CL 312.7 / 308.7, 1x256x512x512 bf16 CL 172.3 / 167.4; backward 514.7 / 511.2 (its chunks are half the
    // reduction's). L2 evict_last loads in the reduction and evict_first in this pass added nothing.
    constexpr int U = kU2 ? 2 : kUnroll;
    r = r1 - 1 - lane_r;
    for (; r - (U - 1) * rpi >= r0; r -= U * rpi) {
      int64_t offs[U];
#pragma unroll
      for (int u = 0; u < U; ++u) offs[u] = base + (r - u * rpi) * C + c0;
      affine_vecs<T, V, HasDy, Pw>(x, dy, out, offs, k, pc, 1, res);
    }
    for (; r >= r0; r -= rpi) {
      const int64_t offs[1] = {base + r * C + c0};
      affine_vecs<T, V, HasDy, Pw>(x, dy, out, offs, k, pc, 1, res);
    }
  }
}

template <typename T, int V, bool HasDy, int Pw, bool DyNchw = false>
__global__ void __launch_bounds__(kMaxThreads)
    affine_nhwc_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                       const float4* __restrict__ coef, int64_t rows, int64_t rchunk, int C, int tpr, int rpi,
                       PwArgs pw) {
  affine_nhwc<T, V, HasDy, Pw, DyNchw>(x, dy, out, coef, rows, rchunk, C, tpr, rpi, pw);
}

// The forward with an activation or a prologue (Pw != 0): 256 threads (nhwc_split's most), 2 CTAs per SM
// asked for. Under affine_nhwc_kernel's bound (512 threads) ptxas held the fp32 GELU-prologue kernel to 81
// registers and its loads waited on the math (ncu, 32x64x258x258 fp32: DRAM 65% busy, issue slots 28%
// busy, 490 us against 387 for the same pass without the prologue); here it takes 108-116 and keeps its
// loads ahead. U2: two vectors per thread and trip (16-bit with erf GELU). H100 same-process A/B, forward op
// us, plain / this:
// fp32 CL 32x64x258x258 GELU 699 / 594 (599), tanh 639 / 593, SiLU 602 / 593; 4x512x128x128 GELU 188 / 162
// (U2 170); 16-bit GELU with U2: 16x512x128x128 bf16 360 / 335 (295), 1x128x1024x1024 fp16 355 / 334 (294);
// 16-bit SiLU / tanh unchanged without U2 and 5-25% slower with it or with a tighter register bound.
// L2#19's fused conv op forward (fp32 bias+GELU prologue): 5.74 / 5.38 ms.
template <typename T, int V, int Pw, bool U2>
__global__ void __launch_bounds__(kNhwcActFwdThreads, 2)
    affine_nhwc_act_fwd_kernel(const T* __restrict__ x, T* __restrict__ out, const float4* __restrict__ coef,
                               int64_t rows, int64_t rchunk, int C, int tpr, int rpi, PwArgs pw) {
  affine_nhwc<T, V, false, Pw, false, U2>(x, nullptr, out, coef, rows, rchunk, C, tpr, rpi, pw);
}

// The backward with SiLU's derivative (Pw: SiLU, no prologue; fp16/bf16, V = 8): at most kNhwcActBwdThreads
// threads, held to 3 CTAs per SM (<= 80 registers) and two vectors per thread and trip. The plain kernel took
// 92 registers (2 CTAs of 256 threads per SM) and stalled on its loads (ncu: L1TEX scoreboard 76% of the
// issue gaps, DRAM 62% busy against 86% without the activation). H100 same-process A/B, us, this /
// affine_nhwc_kernel: 1x128x1024x1024 fp16 CL 331.6 /
// 351.2, 16x512x128x128 bf16 CL 329.7 / 367.5, 8x320x64x64 bf16 CL 27.5 / 29.7, 2x640x64x64 fp16 CL 16.9 /
// 15.1. GELU's derivative spills at 80 registers and lost (450.6 / 414.5 at 1x128x1024x1024): it and the
// other activations keep affine_nhwc_kernel.
template <typename T, int V, int Pw>
__global__ void __launch_bounds__(kNhwcActBwdThreads, 3)
    affine_nhwc_act_bwd_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                               const float4* __restrict__ coef, int64_t rows, int64_t rchunk, int C, int tpr, int rpi,
                               PwArgs pw) {
  affine_nhwc<T, V, true, Pw, false, true>(x, dy, out, coef, rows, rchunk, C, tpr, rpi, pw);
}

// The forward elementwise pass of an NHWC input into an NCHW output (PwArgs::out_nchw): tiles of tr = kUnroll * rpi
// pixel rows x C channels, each thread one channel vector (tpr >= C / V) of kUnroll rows, loaded as affine_nhwc
// does (16-byte loads along channels), normalized into a shared-memory tile, then written out channel by channel, a
// warp per channel. Where the image, the chunk and the tile are whole 16-byte runs of pixels (VS of them), each
// lane stores one such run (tile rows of channel c rotated by (c / V) % (tr / VS) runs, so that the scalar tile
// writes of a warp fall in different banks and the 16-byte tile reads stay aligned); otherwise consecutive lanes
// store consecutive pixels one by one (tile rows padded by one element). Two tiles: the next tile's loads are
// issued before the current one is written out, one barrier per tile. grid and chunks as affine_nhwc; the CTA's C
// coefficients and prologue biases are staged in shared memory first; smem: affine_out_nchw_smem(C, tr,
// sizeof(T)) bytes. No residual.
template <typename T, int V, int Pw>
__global__ void __launch_bounds__(kMaxThreads)
    affine_nhwc_out_nchw_kernel(const T* __restrict__ x, T* __restrict__ out, const float4* __restrict__ coef,
                                int64_t rows, int64_t rchunk, int C, int tpr, int rpi, PwArgs pw) {
  constexpr int VS = 16 / sizeof(T);
  extern __shared__ float4 out_nchw_smem[];
  const int tr = kUnroll * rpi;
  const bool runs = rows % VS == 0 && rchunk % VS == 0 && tr % VS == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int ld = runs ? tr : tr + 1, nq = tr / VS;
  float4* ks = out_nchw_smem;
  float* pcs = reinterpret_cast<float*>(ks + C);
  // tile b: channel c's rows at tiles[(b * C + c) * ld], after the coefficients and biases (16-byte aligned)
  T* tiles = reinterpret_cast<T*>(out_nchw_smem + (C * 5 + 3) / 4);
  pdl_wait();  // launch_dependent: coef is written
  const int64_t n = gridDim.x - 1 - blockIdx.x;  // backwards, as affine_nhwc
  const int64_t r0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * rchunk, r1 = min(rows, r0 + rchunk);
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    ks[c] = coef[n * C + c];
    pcs[c] = pw_channel<false, Pw>(pw, c);
  }
  __syncthreads();
  const int lane_c = threadIdx.x % tpr, lane_r = threadIdx.x / tpr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  const bool active = lane_r < rpi && lane_c < C / V;
  const int c0 = lane_c * V;
  const int rot = runs ? lane_c % nq : 0;  // this thread's channels' rotation, in runs
  const T* xb = x + n * rows * C + c0;
  T* ob = out + n * C * rows;
  float xs[kUnroll][V];
  auto load = [&](int64_t rt) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t r = rt + lane_r + u * rpi;
      if (active && r < r1) load_vec<T, V>(xb + r * C, xs[u]);
    }
  };
  if (r0 < r1) load(r0);
  int b = 0;
  for (int64_t rt = r0; rt < r1; rt += tr, b ^= 1) {
    const int nr = static_cast<int>(r1 - rt < tr ? r1 - rt : tr);
    T* tile = tiles + static_cast<int64_t>(b) * C * ld;
    if (active) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int rr = lane_r + u * rpi;
        if (rr < nr) {
          int q = rr / VS + rot;
          q = q >= nq ? q - nq : q;
          const int at = runs ? q * VS + rr % VS : rr;
#pragma unroll
          for (int j = 0; j < V; ++j)
            tile[(c0 + j) * ld + at] = static_cast<T>(pw_affine<false, Pw>(ks[c0 + j], xs[u][j], 0.f, pcs[c0 + j]));
        }
      }
    }
    // Tile b is complete; every thread is past its stores of tile b from two tiles ago.
    __syncthreads();
    if (rt + tr < r1) load(rt + tr);
    for (int c = warp; c < C; c += nwarps) {
      T* oc = ob + static_cast<int64_t>(c) * rows + rt;
      const T* tc = tile + c * ld;
      if (runs) {
        const int rc = (c / V) % nq;
        for (int q = lane; q * VS < nr; q += 32) {
          int qp = q + rc;
          qp = qp >= nq ? qp - nq : qp;
          if ((q + 1) * VS <= nr) {
            stg_raw(reinterpret_cast<uint4*>(oc + q * VS), *reinterpret_cast<const uint4*>(tc + qp * VS));
          } else {
            for (int e = 0; q * VS + e < nr; ++e) oc[q * VS + e] = tc[qp * VS + e];
          }
        }
      } else {
        for (int rr = lane; rr < nr; rr += 32) oc[rr] = tc[rr];
      }
    }
  }
}

}  // namespace gn
}  // namespace gnext
