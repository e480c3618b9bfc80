// Launchers of the GroupNorm kernels: dtype / vector-width dispatch and <<<>>> launches only.
// No ATen, no message formatting here (see group_norm_launch.h); errors return as cudaError_t.
#include <atomic>
#include <type_traits>

#include "group_norm_kernels.cuh"
#include "group_norm_onepass.cuh"
#include "group_norm_launch.h"

namespace gnext {
namespace gn {
namespace {

constexpr int kMaxDevices = 64;

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

// Prologue kind (PreKind) as a compile-time constant.
template <typename F>
cudaError_t with_pre(int kind, F&& f) {
  switch (kind) {
    case kPreNone:
      return f(std::integral_constant<int, kPreNone>{});
    case kPreBiasGelu:
      return f(std::integral_constant<int, kPreBiasGelu>{});
    case kPreBiasGeluTanh:
      return f(std::integral_constant<int, kPreBiasGeluTanh>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_reduce(bool grad, ScalarKind t, const Problem& p, const ReduceGeometry& g, const void* x,
                          const void* dy, const float* mean, float* partial, const PreArgs& pre,
                          cudaStream_t stream) {
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    return with_vec<T>(g.vec, [&](auto vv) { return with_pre(pre.kind, [&](auto pp) {
      constexpr int V = decltype(vv)::value;
      constexpr int P = decltype(pp)::value;
      auto go = [&](auto rtag) -> cudaError_t {
        using R = decltype(rtag);
        using State = typename R::State;
        const T* xp = static_cast<const T*>(x);
        const T* dyp = static_cast<const T*>(dy);
        State* out = reinterpret_cast<State*>(partial);
        if (g.nhwc) {
          auto kernel = reduce_nhwc_kernel<T, V, R, P>;
          if (g.smem > 48 * 1024) {
            const cudaError_t e =
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem));
            if (e != cudaSuccess) return e;
          }
          kernel<<<dim3(p.N, g.K), g.threads, g.smem, stream>>>(xp, dyp, mean, out, p.HxW, g.chunk,
                                                                 static_cast<int>(p.C), static_cast<int>(p.D),
                                                                 static_cast<int>(p.G), g.tpr, g.rpi, pre);
        } else {
          reduce_nchw_kernel<T, V, R, P><<<dim3(p.N * p.C, g.K), g.threads, 0, stream>>>(
              xp, dyp, mean, out, p.HxW, g.chunk, p.C, p.D, p.G, pre);
        }
        return cudaGetLastError();
      };
      return grad ? go(GradReducer{}) : go(MomentsReducer{});
    }); });
  });
}

cudaError_t launch_finalize_forward(ScalarKind wt, const Problem& p, const PartialLayout& L, const float* partial,
                                    const void* gamma, const void* beta, float* mean, float* rstd, float* coef,
                                    float eps, cudaStream_t stream) {
  return with_scalar(wt, [&](auto wtag) {
    using W = decltype(wtag);
    finalize_forward_kernel<W><<<p.N * p.G, 256, 0, stream>>>(
        reinterpret_cast<const WelfordState*>(partial), L, static_cast<const W*>(gamma), static_cast<const W*>(beta),
        mean, rstd, reinterpret_cast<float4*>(coef), p.C, p.G, eps);
    return cudaGetLastError();
  });
}

cudaError_t launch_finalize_backward(ScalarKind wt, const Problem& p, const PartialLayout& L, const float* partial,
                                     const float* mean, const float* rstd, const void* gamma, float* dsum, float* coef,
                                     cudaStream_t stream) {
  return with_scalar(wt, [&](auto wtag) {
    using W = decltype(wtag);
    finalize_backward_kernel<W><<<p.N * p.G, 256, 0, stream>>>(
        reinterpret_cast<const float2*>(partial), L, mean, rstd, static_cast<const W*>(gamma),
        reinterpret_cast<float2*>(dsum), reinterpret_cast<float4*>(coef), p.C, p.G, p.HxW);
    return cudaGetLastError();
  });
}

cudaError_t launch_gamma_beta_backward(ScalarKind pt, const Problem& p, const float* dsum, const float* rstd,
                                       void* dgamma, void* dbeta, cudaStream_t stream) {
  return with_scalar(pt, [&](auto ptag) {
    using P = decltype(ptag);
    const unsigned blocks = static_cast<unsigned>((p.C + 255) / 256);
    gamma_beta_backward_kernel<P><<<blocks, 256, 0, stream>>>(reinterpret_cast<const float2*>(dsum), rstd,
                                                              static_cast<P*>(dgamma), static_cast<P*>(dbeta), p.N,
                                                              p.C, p.G);
    return cudaGetLastError();
  });
}

cudaError_t launch_affine(bool has_dy, ScalarKind t, const Problem& p, const AffineGeometry& g, const void* x,
                          const void* dy, void* out, const float* coef, const PreArgs& pre, cudaStream_t stream) {
  return with_scalar(t, [&](auto tt) {
    using T = decltype(tt);
    return with_vec<T>(g.vec, [&](auto vv) { return with_pre(pre.kind, [&](auto pp) {
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
          affine_nhwc_kernel<T, V, HasDy, P><<<grid, g.threads, 0, stream>>>(
              xp, dyp, op, k, p.HxW, g.chunk, static_cast<int>(p.C), g.tpr, g.rpi, pre);
        } else {
          affine_nchw_kernel<T, V, HasDy, P><<<grid, g.threads, 0, stream>>>(
              xp, dyp, op, k, p.N * p.C, p.HxW, g.chunk, g.rows_per_cta,
              g.rows_per_cta > 1 ? FastDivmod(static_cast<uint32_t>(p.HxW / V)) : FastDivmod(), p.C, pre);
        }
        return cudaGetLastError();
      };
      return has_dy ? go(std::true_type{}) : go(std::false_type{});
    }); });
  });
}

cudaError_t launch_onepass(bool bwd, ScalarKind t, const Problem& p, const OnePassGeometry& g, const OnePassArgs& a,
                           cudaStream_t stream) {
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    constexpr int V = 16 / sizeof(T);
    if (g.vec != V || g.threads > kOnePassThreads || g.threads % 32 != 0) return cudaErrorInvalidValue;
    // `tag` is unused in the body: a distinct type per kernel makes each kernel's instantiation of
    // this lambda, and so its smem_set cache below, distinct (the kernels share signatures).
    auto go = [&](auto tag, auto kernel, auto... extra) -> cudaError_t {
      // Raise the kernel's dynamic shared-memory limit once per device (the call costs host time).
      static std::atomic<int> smem_set[kMaxDevices];
      int dev = 0;
      cudaError_t e = cudaGetDevice(&dev);
      if (e != cudaSuccess) return e;
      if (dev >= kMaxDevices || smem_set[dev].load() < static_cast<int>(g.smem)) {
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem));
        if (e != cudaSuccess) return e;
        if (dev < kMaxDevices) smem_set[dev].store(static_cast<int>(g.smem));
      }
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(g.grid);
      cfg.blockDim = dim3(g.threads);
      cfg.dynamicSmemBytes = g.smem;
      cfg.stream = stream;
      // CTAs wait on each other only when a group spans several tiles: then all must be co-resident.
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = 1;
      cfg.attrs = attr;
      cfg.numAttrs = a.counters != nullptr ? 1 : 0;
      return cudaLaunchKernelEx(&cfg, kernel, a, g, extra...);
    };
    auto layout = [&](auto btag) -> cudaError_t {
      constexpr bool B = decltype(btag)::value;
      if (g.nhwc) {
        if (a.pre.kind != kPreNone) return cudaErrorInvalidValue;  // no prologue in the NHWC kernel
        return go(std::integral_constant<int, 2 * B>{}, onepass_nhwc_kernel<T, V, B>, p.C, p.G, p.D, p.HxW,
                  g.units * g.T);
      }
      const FastDivmod hwv = g.cpt > 1 ? FastDivmod(static_cast<uint32_t>(p.HxW / V)) : FastDivmod();
      return with_pre(a.pre.kind, [&](auto pp) {
        constexpr int P = decltype(pp)::value;
        return go(std::integral_constant<int, 2 * B + 1 + 4 * P>{}, onepass_nchw_kernel<T, V, B, P>, p.G, p.D,
                  p.HxW, g.units * g.T, hwv);
      });
    };
    return bwd ? layout(std::true_type{}) : layout(std::false_type{});
  });
}

}  // namespace gn
}  // namespace gnext
