// SPDX-License-Identifier: BSD-3-Clause
// Launchers of the two-pass GroupNorm kernels: dtype / vector-width / mode dispatch and launches only, every
// kernel by programmatic dependent launch (launch_dependent). The one-pass launcher: group_norm_onepass.cu,
// compiled in parallel.
// No ATen, no message formatting here (see group_norm_launch.h); errors return as cudaError_t.
#include <algorithm>

#include "group_norm_dispatch.cuh"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

// Tag of raise_smem_limit: the NHWC reduction by its template arguments.
template <typename T, int V, typename R, int P, bool DyNchw>
struct ReduceNhwcTag {};

cudaError_t launch_reduce(bool grad, ScalarKind t, const Problem& p, const ReduceGeometry& g, const void* x,
                          const void* dy, const float* mean, float* partial, const PwArgs& pw,
                          cudaStream_t stream) {
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    auto body = [&](auto vv, auto pp, auto rtag) -> cudaError_t {
      constexpr int V = decltype(vv)::value;
      constexpr int P = decltype(pp)::value;
      using R = decltype(rtag);
      using State = typename R::State;
      const T* xp = static_cast<const T*>(x);
      const T* dyp = static_cast<const T*>(dy);
      State* out = reinterpret_cast<State*>(partial);
      if (g.nhwc) {
        auto launch = [&](auto dytag) -> cudaError_t {
          constexpr bool DyNchw = decltype(dytag)::value;
          auto kernel = reduce_nhwc_kernel<T, V, R, P, DyNchw>;
          if (g.smem > 48 * 1024) {
            const cudaError_t e = raise_smem_limit<ReduceNhwcTag<T, V, R, P, DyNchw>>(kernel, g.smem);
            if (e != cudaSuccess) return e;
          }
          return launch_dependent(kernel, dim3(p.N, g.K), dim3(g.threads), g.smem, stream, xp, dyp, mean, out, p.HxW,
                                  g.chunk, static_cast<int>(p.C), static_cast<int>(p.D), static_cast<int>(p.G), g.tpr,
                                  g.rpi, pw);
        };
        // An NCHW dy (PwArgs::dy_nchw) only without an output activation (modes 0-2: GroupNorm and
        // the input prologues); the host copies dy for the others.
        if constexpr (R::kNeedsDy && pw_act(P) == kActIdentity) {
          if (pw.dy_nchw) return launch(std::true_type{});
        }
        if (pw.dy_nchw) return cudaErrorInvalidValue;
        return launch(std::false_type{});
      } else {
        if constexpr (!R::kNeedsDy && P == kPreNone)
          return launch_dependent(reduce_nchw_fwd_kernel<T, V>, dim3(p.N * p.C, g.K), dim3(g.threads), 0, stream, xp,
                                  out, p.HxW, g.chunk, p.C, p.D, p.G, pw);
        else
          return launch_dependent(reduce_nchw_kernel<T, V, R, P>, dim3(p.N * p.C, g.K), dim3(g.threads), 0, stream,
                                  xp, dyp, mean, out, p.HxW, g.chunk, p.C, p.D, p.G, pw);
      }
    };
    // The forward reduction is the same for every output activation: prologue modes only.
    return with_vec<T>(g.vec, [&](auto vv) {
      return grad ? with_pw(pw.mode, [&](auto pp) { return body(vv, pp, GradReducer{}); })
                  : with_pw_pre(pw.mode, [&](auto pp) { return body(vv, pp, MomentsReducer{}); });
    });
  });
}

cudaError_t launch_finalize_forward(ScalarKind wt, const Problem& p, const PartialLayout& L, const float* partial,
                                    const void* gamma, const void* beta, float* mean, float* rstd, float* coef,
                                    float eps, ChannelShift shift, cudaStream_t stream) {
  // Threads for one round of four loads each where the group has many partials (NHWC: D * K, K up to a few
  // hundred chunks per image), 256 at least. H100, 1x128x1024x1024 fp16 channels_last (D * K = 2112): 7.8 us
  // with 256 threads, 5.1 with 544.
  const int64_t per_group = (p.C / p.G) * L.K;
  const int threads = static_cast<int>(std::clamp<int64_t>((per_group / 4 + 31) / 32 * 32, 256, 1024));
  return with_scalar(wt, [&](auto wtag) {
    using W = decltype(wtag);
    return launch_dependent(finalize_forward_kernel<W>, dim3(p.N * p.G), dim3(threads), 0, stream,
                            reinterpret_cast<const WelfordState*>(partial), L, static_cast<const W*>(gamma),
                            static_cast<const W*>(beta), mean, rstd, reinterpret_cast<float4*>(coef), p.C, p.G, eps,
                            shift);
  });
}

cudaError_t launch_finalize_backward(ScalarKind wt, const Problem& p, const PartialLayout& L, const float* partial,
                                     const float* mean, const float* rstd, const void* gamma, float* dsum, float* coef,
                                     cudaStream_t stream) {
  return with_scalar(wt, [&](auto wtag) {
    using W = decltype(wtag);
    return launch_dependent(finalize_backward_kernel<W>, dim3(p.N * p.G), dim3(256), 0, stream,
                            reinterpret_cast<const float2*>(partial), L, mean, rstd, static_cast<const W*>(gamma),
                            reinterpret_cast<float2*>(dsum), reinterpret_cast<float4*>(coef), p.C, p.G, p.HxW);
  });
}

cudaError_t launch_gamma_beta_backward(ScalarKind pt, const Problem& p, const float* dsum, const float* rstd,
                                       void* dgamma, void* dbeta, cudaStream_t stream) {
  return with_scalar(pt, [&](auto ptag) {
    using P = decltype(ptag);
    const unsigned blocks = static_cast<unsigned>((p.C + 31) / 32);
    return launch_dependent(gamma_beta_backward_kernel<P>, dim3(blocks), dim3(32 * kGammaBetaRows), 0, stream,
                            reinterpret_cast<const float2*>(dsum), rstd, static_cast<P*>(dgamma),
                            static_cast<P*>(dbeta), p.N, p.C, p.G);
  });
}

// coef per (n, c) from statistics computed elsewhere (launch_coef).
template <typename W>
__global__ void coef_kernel(const float* __restrict__ mean, const float* __restrict__ rstd, const W* __restrict__ gamma,
                            const W* __restrict__ beta, const float2* __restrict__ gsum, float4* __restrict__ coef,
                            int64_t N, int64_t C, int64_t G) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i % C, ng = n * G + c / (C / G);
  const float r = rstd[ng], mu = mean[ng];
  const float w = gamma ? to_float(gamma[c]) : 1.f;
  if (gsum) {
    const float2 s = gsum[ng];
    coef[i] = make_float4(mu, -r * r * r * s.x, r * w, -r * s.y);
  } else {
    coef[i] = make_float4(mu, r * w, 0.f, beta ? to_float(beta[c]) : 0.f);
  }
}

cudaError_t launch_coef(ScalarKind wt, const Problem& p, const float* mean, const float* rstd, const void* gamma,
                        const void* beta, const float* gsum, float* coef, cudaStream_t stream) {
  const int64_t n = p.N * p.C;
  if (n <= 0) return cudaSuccess;
  return with_scalar(wt, [&](auto wtag) {
    using W = decltype(wtag);
    coef_kernel<W><<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
        mean, rstd, static_cast<const W*>(gamma), static_cast<const W*>(beta), reinterpret_cast<const float2*>(gsum),
        reinterpret_cast<float4*>(coef), p.N, p.C, p.G);
    return cudaGetLastError();
  });
}

// (count, mean, M2) per (n, g) in float64 from a shard's mean and rstd (eps = 0: M2 = count / rstd^2, 0 for a
// constant group's rstd = inf).
__global__ void pack_moments_kernel(const float* __restrict__ mean, const float* __restrict__ rstd, double count,
                                    double* __restrict__ out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const double r = rstd[i];
  out[i] = count;
  out[n + i] = count > 0 ? static_cast<double>(mean[i]) : 0.0;
  out[2 * n + i] = count > 0 ? count / (r * r) : 0.0;
}

cudaError_t launch_pack_moments(const float* mean, const float* rstd, int64_t count, double* out, int64_t n,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  pack_moments_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(mean, rstd,
                                                                                 static_cast<double>(count), out, n);
  return cudaGetLastError();
}

// Chan's merge over the `world` shards' (count, mean, M2) of each (n, g), in float64: mean = sum c_i m_i / c,
// M2 = sum M2_i + c_i (m_i - mean)^2 (no cancellation at large means).
__global__ void merge_moments_kernel(const double* __restrict__ m, int64_t world, int64_t n, float eps,
                                     float* __restrict__ mean, float* __restrict__ rstd, double* __restrict__ count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  double c = 0, s = 0;
  for (int64_t w = 0; w < world; ++w) {
    const double* q = m + w * 3 * n;
    c += q[i];
    s += q[i] * q[n + i];
  }
  const double mu = s / c;
  double m2 = 0;
  for (int64_t w = 0; w < world; ++w) {
    const double* q = m + w * 3 * n;
    const double d = q[n + i] - mu;
    m2 += q[2 * n + i] + q[i] * d * d;
  }
  mean[i] = static_cast<float>(mu);
  rstd[i] = static_cast<float>(1.0 / sqrt(m2 / c + static_cast<double>(eps)));
  count[i] = c;
}

cudaError_t launch_merge_moments(const double* moments, int64_t world, int64_t n, float eps, float* mean,
                                 float* rstd, double* count, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  merge_moments_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(moments, world, n, eps, mean,
                                                                                  rstd, count);
  return cudaGetLastError();
}

template <typename From, typename To>
__global__ void cast_stats_kernel(const From* __restrict__ mean, const From* __restrict__ rstd, To* __restrict__ mean_out,
                                  To* __restrict__ rstd_out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    mean_out[i] = static_cast<To>(to_float(mean[i]));
    rstd_out[i] = static_cast<To>(to_float(rstd[i]));
  }
}

cudaError_t launch_cast_stats(ScalarKind from, ScalarKind to, const void* mean, const void* rstd, void* mean_out,
                              void* rstd_out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if ((from == ScalarKind::Float) == (to == ScalarKind::Float)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((n + 255) / 256)), block(256);
  return with_scalar(from == ScalarKind::Float ? to : from, [&](auto tt) {
    using T = decltype(tt);
    if (from == ScalarKind::Float)
      cast_stats_kernel<float, T><<<grid, block, 0, stream>>>(static_cast<const float*>(mean),
                                                              static_cast<const float*>(rstd), static_cast<T*>(mean_out),
                                                              static_cast<T*>(rstd_out), n);
    else
      cast_stats_kernel<T, float><<<grid, block, 0, stream>>>(static_cast<const T*>(mean), static_cast<const T*>(rstd),
                                                              static_cast<float*>(mean_out),
                                                              static_cast<float*>(rstd_out), n);
    return cudaGetLastError();
  });
}

cudaError_t launch_affine(bool has_dy, ScalarKind t, const Problem& p, const AffineGeometry& g, const void* x,
                          const void* dy, void* out, const float* coef, const PwArgs& pw, cudaStream_t stream) {
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    return with_vec<T>(g.vec, [&](auto vv) { return with_pw(pw.mode, [&](auto pp) {
      constexpr int V = decltype(vv)::value;
      constexpr int P = decltype(pp)::value;
      auto go = [&](auto dytag) -> cudaError_t {
        constexpr bool HasDy = decltype(dytag)::value;
        const T* xp = static_cast<const T*>(x);
        const T* dyp = static_cast<const T*>(dy);
        T* op = static_cast<T*>(out);
        const float4* k = reinterpret_cast<const float4*>(coef);
        const dim3 grid(g.grid_x, g.grid_y);
        if (g.nhwc) {
          if constexpr (!HasDy && pw_pre(P) != kPreNone) {  // NCHW out (the fused conv op of an NCHW input)
            if (pw.out_nchw) {
              if (!affine_out_nchw_fits(g, p.C, sizeof(T)) || pw.residual != nullptr) return cudaErrorInvalidValue;
              return launch_dependent(affine_nhwc_out_nchw_kernel<T, V, P>, grid, dim3(g.threads),
                                      affine_out_nchw_smem(p.C, kUnroll * g.rpi, sizeof(T)), stream, xp, op, k,
                                      p.HxW, g.chunk, static_cast<int>(p.C), g.tpr, g.rpi, pw);
            }
          }
          if (pw.out_nchw) return cudaErrorInvalidValue;
          if constexpr (HasDy && pw_act(P) == kActIdentity) {  // NCHW dy: as in launch_reduce
            if (pw.dy_nchw) {
              return launch_dependent(affine_nhwc_kernel<T, V, HasDy, P, true>, grid, dim3(g.threads), 0, stream,
                                      xp, dyp, op, k, p.HxW, g.chunk, static_cast<int>(p.C), g.tpr, g.rpi, pw);
            }
          }
          if (pw.dy_nchw) return cudaErrorInvalidValue;
          if constexpr (!HasDy && P != 0) {  // an activation or a prologue: measured, see the kernel
            if (g.threads > kNhwcActFwdThreads) return cudaErrorInvalidValue;
            constexpr bool U2 = sizeof(T) == 2 && (pw_act(P) == kActGelu || pw_pre(P) == kPreBiasGelu);
            return launch_dependent(affine_nhwc_act_fwd_kernel<T, V, P, U2>, grid, dim3(g.threads), 0, stream, xp,
                                    op, k, p.HxW, g.chunk, static_cast<int>(p.C), g.tpr, g.rpi, pw);
          } else if constexpr (HasDy && pw_act(P) == kActSilu && pw_pre(P) == kPreNone && V == 8) {  // 16-bit, measured
            if (g.threads > kNhwcActBwdThreads) return cudaErrorInvalidValue;
            return launch_dependent(affine_nhwc_act_bwd_kernel<T, V, P>, grid, dim3(g.threads), 0, stream, xp, dyp,
                                    op, k, p.HxW, g.chunk, static_cast<int>(p.C), g.tpr, g.rpi, pw);
          } else {
            return launch_dependent(affine_nhwc_kernel<T, V, HasDy, P>, grid, dim3(g.threads), 0, stream, xp, dyp,
                                    op, k, p.HxW, g.chunk, static_cast<int>(p.C), g.tpr, g.rpi, pw);
          }
        }
        if (pw.out_nchw) return cudaErrorInvalidValue;  // NCHW x: out is NCHW anyway (the host leaves it unset)
        return launch_dependent(affine_nchw_kernel<T, V, HasDy, P>, grid, dim3(g.threads), 0, stream, xp, dyp, op, k,
                                p.N * p.C, p.HxW, g.chunk, g.rows_per_cta,
                                g.rows_per_cta > 1 ? FastDivmod(static_cast<uint32_t>(p.HxW / V)) : FastDivmod(),
                                p.C, pw);
      };
      return has_dy ? go(std::true_type{}) : go(std::false_type{});
    }); });
  });
}

}  // namespace gn
}  // namespace gnext
