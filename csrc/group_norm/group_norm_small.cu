// SPDX-License-Identifier: BSD-3-Clause
// Small-group GroupNorm (NCHW groups of at most kSmallMaxVecs 16-byte vectors, e.g. HxW = 1, 4x4 maps, odd
// small C/G): `lanes` lanes of a warp hold one group in registers, k vectors each (vector v of a group on
// lane v % lanes). Groups of up to 8 vectors per thread of a CTA (ResNet-GN's 7x7 and 14x14 maps; the forward up
// to 16: its 28x28 and 56x56 maps): the same kernels with the CTA's 256 threads as the lanes (Cta), the sums
// through shared memory (group_sum).
// Geometry: SmallGeometry (group_norm_launch.h), chosen by small_geometry (group_norm_plan.h).
// Forward, one launch, no shared memory (Cta: 64 bytes), no scratch, no inter-CTA waits:
//   mean = x0 + sum(x - x0) / L (x0: the group's first element),  var = sum((x - mean)^2) / L  (two passes
//   over the registers),  rstd = 1/sqrt(var + eps),
//   out = act((x - mean) * rstd * gamma[c] + beta[c]) (+ residual)
// with warp shuffles (and for Cta one exchange through shared memory per sum).
// Backward (Wu & He 2018; the formula of the other backward kernels, finalize_backward_kernel): x and dy in
// registers, dy' = dy * act'(GroupNorm(x)) (dy' = dy without an output activation), per channel
//   s1[c] = sum dy' (x - mean),  s2[c] = sum dy'  (to dsum for dgamma/dbeta, launch_gamma_beta_backward)
// in a fixed order (pieces in shared memory, summed channel by channel: deterministic), then
//   c2 = -rstd^3 sum_c gamma[c] s1[c] / L,  c3 = -rstd sum_c gamma[c] s2[c] / L,
//   dx = rstd gamma[c] dy' + c2 (x - mean) + c3.
#include "group_norm_dispatch.cuh"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

namespace {

// Lanes per group of a plan that gives each group a whole CTA (SmallGeometry::lanes_log2 == kSmallCtaLog2).
constexpr int kSmallCtaLanes = 1 << kSmallCtaLog2;
static_assert(kSmallCtaLanes == kSmallThreads, "a CTA-wide group spans the CTA");

// The sum over the lanes that hold one group: xor shuffles over `lanes` lanes of a warp (every lane takes part;
// offsets below `lanes` stay inside the group), or with Cta over the whole CTA: the warps' sums through shared
// memory `red`, added in warp order by every thread (the same value in every thread; deterministic).
template <bool Cta>
__device__ __forceinline__ float2 group_sum(float2 v, int lanes, float2* red) {
  for (int m = 1; m < (Cta ? 32 : lanes); m <<= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, m);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, m);
  }
  if constexpr (Cta) {
    __syncthreads();  // every thread has read red's previous contents
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < kSmallThreads / 32; ++w) {
      v.x += red[w].x;
      v.y += red[w].y;
    }
  }
  return v;
}

template <typename T, int V, int A, int K, bool Cta>
__global__ void __launch_bounds__(kSmallThreads)
    small_forward_kernel(OnePassArgs a, int64_t groups, int G, int D, uint32_t L, int lanes_log2, int k,
                         FastDivmod hw) {
  pdl_wait();  // launch_dependent: the previous kernel in the stream has completed
  __shared__ float2 red[Cta ? kSmallThreads / 32 : 1];
  const int lanes = Cta ? kSmallCtaLanes : 1 << lanes_log2;
  const int lane = threadIdx.x & 31, sl = Cta ? static_cast<int>(threadIdx.x) : lane & (lanes - 1);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  // this lane's group
  const int64_t u = Cta ? static_cast<int64_t>(blockIdx.x) : warp * (32 >> lanes_log2) + (lane >> lanes_log2);
  const bool active = u < groups;
  const uint32_t nvec = L / V;
  const T* __restrict__ xg = static_cast<const T*>(a.x) + (active ? u : 0) * L;
  // 2-byte elements at 16 vectors per thread are held as loaded and converted at each use: as float they took
  // 203-213 registers (one CTA per SM; 0.56x the one-pass forward on the H200), raw 16-byte vectors take 64.
  constexpr bool kRaw = K == 16 && sizeof(T) == 2;
  using Raw = typename Pack<T, V>::Raw;
  float xv[kRaw ? 1 : K][V];
  Raw xr[kRaw ? K : 1];
  auto vec = [&](int i, float (&f)[V]) {
    if constexpr (kRaw) {
      unpack_vec<T, V>(xr[i], f);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) f[e] = xv[i][e];
    }
  };
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint32_t v = sl + i * lanes;
    if (i < k && active && v < nvec) {
      if constexpr (kRaw) {
        xr[i] = ldg_raw(reinterpret_cast<const Raw*>(xg + v * V));
      } else {
        load_vec<T, V>(xg + v * V, xv[i]);
      }
    } else if constexpr (kRaw) {
      xr[i] = Raw{};
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) xv[i][e] = 0.f;
    }
  }
  // The sum of x - x0, x0 = the group's first element: near a large mean a plain float sum rounds every
  // partial sum at ulp(sum); shifted, the terms and the sums are of the spread's size.
  const float x0 = Cta ? to_float(xg[0]) : __shfl_sync(0xffffffffu, xv[0][0], lane & ~(lanes - 1));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < k && sl + i * lanes < nvec) {
      float f[V];
      vec(i, f);
#pragma unroll
      for (int e = 0; e < V; ++e) s += f[e] - x0;
    }
  }
  s = group_sum<Cta>(make_float2(s, 0.f), lanes, red).x;
  const float mean = x0 + s / static_cast<float>(L);
  float q = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < k && sl + i * lanes < nvec) {
      float f[V];
      vec(i, f);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = f[e] - mean;
        q = fmaf(d, d, q);
      }
    }
  }
  q = group_sum<Cta>(make_float2(q, 0.f), lanes, red).x;
  const float rstd = rsqrtf(q / static_cast<float>(L) + a.eps);
  if (!active) return;
  if (sl == 0) {
    a.mean[u] = mean;
    a.rstd[u] = rstd;
  }
  const int64_t c0 = (u % G) * D;  // the group's first channel
  T* __restrict__ og = static_cast<T*>(a.out) + u * L;
  const T* __restrict__ rg = a.pw.residual != nullptr ? static_cast<const T*>(a.pw.residual) + u * L : nullptr;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint32_t v = sl + i * lanes;
    if (i >= k || v >= nvec) continue;
    float y[V];
    vec(i, y);
    normalize_straddling<A, V>(y, v * V, hw, c0, mean, rstd, a.gamma, a.beta, a.wt);
    if (rg != nullptr) {
      float rv[V];
      load_vec<T, V>(rg + v * V, rv);
#pragma unroll
      for (int e = 0; e < V; ++e) y[e] += rv[e];
    }
    store_vec<T, V>(og + v * V, y);
  }
}

// Backward: see the top of the file. Pieces of (dy' (x - mean), dy') in shared memory as SmallPieces
// (group_norm_launch.h) lays them out, summed per channel, except where a piece is a whole channel (HxW == V,
// or HxW == 1): then straight from registers.
template <typename T, int V, int A, int K, bool Cta>
__global__ void __launch_bounds__(kSmallThreads)
    small_backward_kernel(OnePassArgs a, int64_t groups, int G, int D, uint32_t L, int lanes_log2, int k,
                          uint32_t HxW, FastDivmod hw) {
  // No pdl_trigger(): dgamma/dbeta after it launches as it exits. Triggered at the start, in a chain of
  // backward calls (a CUDA graph) the next call's kernels took SM slots early: 256x1024x1x1 bf16 backward 10.0
  // -> 12.8 µs per call.
  pdl_wait();  // launch_dependent: the previous kernel in the stream has completed
  using Raw = typename Pack<T, V>::Raw;
  extern __shared__ float2 pieces[];
  __shared__ float2 red[Cta ? kSmallThreads / 32 : 1];
  const int lanes = Cta ? kSmallCtaLanes : 1 << lanes_log2;
  const int lane = threadIdx.x & 31;
  const int sl = Cta ? static_cast<int>(threadIdx.x) : lane & (lanes - 1), gw = Cta ? 0 : lane >> lanes_log2;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t u = Cta ? static_cast<int64_t>(blockIdx.x) : warp * (32 >> lanes_log2) + gw;  // this lane's group
  const bool active = u < groups;
  const uint32_t nvec = L / V;
  const SmallPieces pc(HxW, static_cast<uint32_t>(V));
  const int64_t base = (active ? u : 0) * L;
  const float mu = active ? a.mean[u] : 0.f, rs = active ? a.rstd[u] : 0.f;
  const int64_t c0 = (active ? u % G : 0) * D;  // the group's first channel
  float2* const sp =
      Cta ? pieces : pieces + (static_cast<int64_t>(threadIdx.x >> 5) * (32 >> lanes_log2) + gw) * D * pc.slots;
  float2* const ds = a.dsum != nullptr && active ? reinterpret_cast<float2*>(a.dsum) + u * D : nullptr;
  float2 acc = make_float2(0.f, 0.f);  // sum_c gamma[c] (s1[c], s2[c]) over this lane's channels
  auto channel_sum = [&](int64_t d, float2 s) {
    if (ds != nullptr) ds[d] = s;
    const float w = load_param(a.gamma, a.wt, c0 + d, 1.f);
    acc.x = fmaf(w, s.x, acc.x);
    acc.y = fmaf(w, s.y, acc.y);
  };
  const T* __restrict__ xg = static_cast<const T*>(a.x) + base;
  const T* __restrict__ dg = static_cast<const T*>(a.dy) + base;
  Raw xr[K], dr[K];
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint32_t v = sl + i * lanes;
    if (i < k && active && v < nvec) {
      xr[i] = ldg_raw(reinterpret_cast<const Raw*>(xg + v * V));
      dr[i] = ldg_raw(reinterpret_cast<const Raw*>(dg + v * V));
    }
  }
  // Channel c's (rstd * gamma[c], beta[c]): the output activation's input is sg * (x - mean) + sb. Loaded once
  // per vector where a vector lies in one channel (a load per element made the backward with an activation
  // up to 2x slower than without).
  auto chan = [&](int64_t c) {
    const float w = load_param(a.gamma, a.wt, c, 1.f);
    return make_float2(rs * w, A == kActIdentity ? 0.f : load_param(a.beta, a.wt, c, 0.f));
  };
  // dy' of an element (the output activation's derivative at the forward's value).
  auto dyp = [&](float dv, float xm, float2 k) { return act_dy<A>(dv, xm, k.x, k.y); };
  // Pieces of this lane's vectors. With an activation, dy' is kept in registers (dp) for dx below, so that its
  // derivative (two MUFU ops for SiLU) is evaluated once per element: H100 backward kernel µs, computed twice ->
  // kept, back-to-back calls (inputs L2-resident): GroupNorm+SiLU 16x4096x4x4 bf16 14.7 -> 11.7 (GN
  // 9.3), 32x256x7x7 bf16 11.4 -> 9.4 (7.2), 256x256x7x7 fp32 35.9 -> 30.8 (23.4), 1024x512x4x4 fp16 40.1 ->
  // 38.9 (33.3), even where the registers this takes (216 for bf16 at K = 8) leave one CTA per SM.
  constexpr bool kKeep = A != kActIdentity;
  float dp[kKeep ? K : 1][V];
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint32_t v = sl + i * lanes;
    if (i >= k || !active || v >= nvec) continue;
    float xv[V], dv[V];
    unpack_vec<T, V>(xr[i], xv);
    unpack_vec<T, V>(dr[i], dv);
    if (pc.mode == SmallPieces::kVector) {  // the vector lies in one channel
      const float2 kc = A != kActIdentity ? chan(c0 + hw.div(v * V)) : float2{};
      float2 s = make_float2(0.f, 0.f);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = dyp(dv[e], xv[e] - mu, kc);
        if constexpr (kKeep) dp[i][e] = d;
        s.x = fmaf(d, xv[e] - mu, s.x);
        s.y += d;
      }
      if (pc.direct) {
        channel_sum(v, s);
      } else {
        sp[v] = s;
      }
    } else if (pc.mode == SmallPieces::kStraddle) {
      // b elements in channel cf, the rest (if any) in cf + 1, whose first vector this is.
      const uint32_t cf = hw.div(v * V);
      const uint32_t b = min(uint32_t{V}, (cf + 1) * HxW - v * V);
      const float2 kf = A != kActIdentity ? chan(c0 + cf) : float2{};
      const float2 kl = A != kActIdentity && b < V ? chan(c0 + cf + 1) : kf;
      float2 sf = make_float2(0.f, 0.f), sn = make_float2(0.f, 0.f);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const bool first = e < static_cast<int>(b);
        const float xm = xv[e] - mu;
        const float d = dyp(dv[e], xm, first ? kf : kl);
        if constexpr (kKeep) dp[i][e] = d;
        if (first) {
          sf.x = fmaf(d, xm, sf.x);
          sf.y += d;
        } else {
          sn.x = fmaf(d, xm, sn.x);
          sn.y += d;
        }
      }
      sp[cf * pc.slots + (v - cf * HxW / V)] = sf;
      if (b < V) sp[(cf + 1) * pc.slots] = sn;
    } else {  // HxW < V, not a divisor of V: a piece per element
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = A != kActIdentity ? dyp(dv[e], xv[e] - mu, chan(c0 + hw.div(v * V + e))) : dv[e];
        if constexpr (kKeep) dp[i][e] = d;
        const float2 s = make_float2(d * (xv[e] - mu), d);
        if (pc.direct) {
          channel_sum(v * V + e, s);
        } else {
          sp[v * V + e] = s;
        }
      }
    }
  }
  if (!pc.direct) {
    if constexpr (Cta) {
      __syncthreads();
    } else {
      __syncwarp();
    }
    // Channel sums, to dsum and acc: tpc lanes per channel (a power of two, up to lanes / D), each adding every
    // tpc-th of the channel's pieces in order, then xor shuffles over the tpc lanes (deterministic).
    int tpc = 1;
    while (tpc < 32 && 2 * tpc * D <= lanes) tpc *= 2;
    const int r = sl & (tpc - 1);
    for (int d0 = 0; d0 < D; d0 += lanes / tpc) {
      const int d = d0 + sl / tpc;
      float2 s = make_float2(0.f, 0.f);
      if (active && d < D) {
        const uint32_t n = pc.count(d);
        for (uint32_t j = r; j < n; j += tpc) {
          const float2 q = sp[d * pc.slots + j];
          s.x += q.x;
          s.y += q.y;
        }
      }
      for (int m = 1; m < tpc; m <<= 1) {
        s.x += __shfl_xor_sync(0xffffffffu, s.x, m);
        s.y += __shfl_xor_sync(0xffffffffu, s.y, m);
      }
      if (r == 0 && active && d < D) channel_sum(d, s);
    }
  }
  acc = group_sum<Cta>(acc, lanes, red);
  if (!active || a.out == nullptr) return;
  const float inv_l = 1.f / static_cast<float>(L);
  const float c2 = -rs * rs * rs * acc.x * inv_l, c3 = -rs * acc.y * inv_l;
  T* __restrict__ og = static_cast<T*>(a.out) + base;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint32_t v = sl + i * lanes;
    if (i >= k || v >= nvec) continue;
    float xv[V], dv[V];
    unpack_vec<T, V>(xr[i], xv);
    if constexpr (kKeep) {
#pragma unroll
      for (int e = 0; e < V; ++e) dv[e] = dp[i][e];
    } else {
      unpack_vec<T, V>(dr[i], dv);
    }
    const uint32_t cf = hw.div(v * V), cl = hw.div(v * V + V - 1);
    if (cf == cl) {
      const float g = chan(c0 + cf).x;
#pragma unroll
      for (int e = 0; e < V; ++e) xv[e] = fmaf(g, dv[e], fmaf(c2, xv[e] - mu, c3));
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) xv[e] = fmaf(chan(c0 + hw.div(v * V + e)).x, dv[e], fmaf(c2, xv[e] - mu, c3));
    }
    store_vec<T, V>(og + v * V, xv);
  }
}

// Tag of raise_smem_limit: the backward kernel by (T, activation, K).
template <typename T, int A, int K>
struct SmallBwdTag {};

// Both launchers: checks the plan, then f(T{}, integral_constant<int, A>, integral_constant<int, K>, bool_constant<Cta>)
// with V = 16 / sizeof(T) and K = g.kreg, the plan's vectors per lane rounded up to 1, 2, 4, 8 (or 16: a CTA's
// forward): the registers that hold a lane's vectors are sized by K, so a plan of few vectors per lane keeps more
// CTAs resident (with K = 8 for every plan, every small kernel took 126-128 registers). H100 kernel µs forward /
// backward, GNEXT_SMALL_KREG=8 (K = 8 always) -> sized, inputs in DRAM: 1024x512x4x4 fp16 22.9 / 38.8 -> 15.6 /
// 36.4, 256x1024x1x1 bf16 4.7 / 10.8 -> 4.1 / 10.0; inputs L2-resident: 32x256x7x7 bf16 5.9 / 7.7 -> 5.0 / 7.2, 256x256x7x7 fp32 14.5 / 27.6
// -> 13.5 / 23.4, 2x1280x1x1 fp16 3.7 / 6.0 -> 2.9 / 5.2.
template <typename F>
cudaError_t with_small(ScalarKind t, const SmallGeometry& g, const OnePassArgs& a, F&& f) {
  static_assert(kSmallMaxVecs / 32 == 8 && kSmallCtaFwdMaxK == 16,
                "K dispatch below covers 1..8 vectors per lane, and 16 for a CTA's forward");
  const bool cta = g.lanes_log2 == kSmallCtaLog2;
  if (pw_pre(a.pw.mode) != kPreNone || g.k < 1 || g.k > g.kreg || g.kreg > (cta ? kSmallCtaFwdMaxK : kSmallMaxVecs / 32) ||
      g.lanes_log2 < 0 || (g.lanes_log2 > 5 && !cta) || (cta && g.kreg < 2) || g.smem > kSmallMaxSmem)
    return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    if (g.vec != static_cast<int>(16 / sizeof(tt))) return cudaErrorInvalidValue;
    auto go = [&](auto aa) -> cudaError_t {
      using Warp = std::false_type;
      using Cta = std::true_type;
      using K8 = std::integral_constant<int, 8>;
      if constexpr (!small_sized_act(decltype(aa)::value)) {  // warps: 8 vector registers per lane only
        if (!cta) return g.kreg == 8 ? f(tt, aa, K8{}, Warp{}) : cudaErrorInvalidValue;
        if constexpr (small_cta_act(decltype(aa)::value)) {
          switch (g.kreg) {
            case 2: return f(tt, aa, std::integral_constant<int, 2>{}, Cta{});
            case 4: return f(tt, aa, std::integral_constant<int, 4>{}, Cta{});
            case 8: return f(tt, aa, K8{}, Cta{});
            case 16:  // GELU: float32 only (small_geometry)
              if constexpr (sizeof(decltype(tt)) == 4) return f(tt, aa, std::integral_constant<int, 16>{}, Cta{});
              return cudaErrorInvalidValue;
            default: return cudaErrorInvalidValue;
          }
        }
        return cudaErrorInvalidValue;
      } else {
        switch (g.kreg * 2 + cta) {  // a CTA-wide group has more than 256 vectors: K >= 2
          case 2: return f(tt, aa, std::integral_constant<int, 1>{}, Warp{});
          case 4: return f(tt, aa, std::integral_constant<int, 2>{}, Warp{});
          case 8: return f(tt, aa, std::integral_constant<int, 4>{}, Warp{});
          case 16: return f(tt, aa, K8{}, Warp{});
          case 5: return f(tt, aa, std::integral_constant<int, 2>{}, Cta{});
          case 9: return f(tt, aa, std::integral_constant<int, 4>{}, Cta{});
          case 17: return f(tt, aa, K8{}, Cta{});
          case 33: return f(tt, aa, std::integral_constant<int, 16>{}, Cta{});
          default: return cudaErrorInvalidValue;
        }
      }
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

}  // namespace

cudaError_t launch_small_forward(ScalarKind t, const Problem& p, const SmallGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream) {
  return with_small(t, g, a, [&](auto tt, auto aa, auto kk, auto cc) -> cudaError_t {
    using T = decltype(tt);
    constexpr int V = 16 / sizeof(T), A = decltype(aa)::value, K = decltype(kk)::value;
    constexpr bool Cta = decltype(cc)::value;
    return launch_dependent(small_forward_kernel<T, V, A, K, Cta>, dim3(g.grid), dim3(kSmallThreads), 0, stream, a,
                            p.N * p.G, static_cast<int>(p.G), static_cast<int>(p.D),
                            static_cast<uint32_t>(p.D * p.HxW), g.lanes_log2, g.k,
                            FastDivmod(static_cast<uint32_t>(p.HxW)));
  });
}

cudaError_t launch_small_backward(ScalarKind t, const Problem& p, const SmallGeometry& g, const OnePassArgs& a,
                                  cudaStream_t stream) {
  return with_small(t, g, a, [&](auto tt, auto aa, auto kk, auto cc) -> cudaError_t {
    using T = decltype(tt);
    constexpr int V = 16 / sizeof(T), A = decltype(aa)::value, K = decltype(kk)::value;
    constexpr bool Cta = decltype(cc)::value;
    if constexpr ((Cta && K == 8 && A != kActIdentity) || K == 16) {  // not built: small_geometry leaves it to others
      return cudaErrorInvalidValue;
    } else {
      if (g.smem > 48 * 1024) {
        const cudaError_t e =
            raise_smem_limit<SmallBwdTag<T, A, K * 2 + Cta>>(small_backward_kernel<T, V, A, K, Cta>, g.smem);
        if (e != cudaSuccess) return e;
      }
      return launch_dependent(small_backward_kernel<T, V, A, K, Cta>, dim3(g.grid), dim3(kSmallThreads), g.smem,
                              stream, a, p.N * p.G, static_cast<int>(p.G), static_cast<int>(p.D),
                              static_cast<uint32_t>(p.D * p.HxW), g.lanes_log2, g.k,
                              static_cast<uint32_t>(p.HxW), FastDivmod(static_cast<uint32_t>(p.HxW)));
    }
  });
}

}  // namespace gn
}  // namespace gnext
