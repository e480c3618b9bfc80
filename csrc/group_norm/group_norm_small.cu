// Small-group GroupNorm forward (NCHW groups of at most kSmallMaxVecs 16-byte vectors, e.g. HxW = 1, 4x4
// maps, odd small C/G): `lanes` lanes of a warp hold one group in registers, k vectors each, and compute
//   mean = x0 + sum(x - x0) / L (x0: the group's first element),  var = sum((x - mean)^2) / L  (two passes
//   over the registers),  rstd = 1/sqrt(var + eps),
//   out = act((x - mean) * rstd * gamma[c] + beta[c]) (+ residual)
// with warp shuffles only: one launch, no shared memory, no scratch, no inter-CTA waits. Geometry:
// SmallGeometry (group_norm_launch.h), chosen by small_geometry (group_norm_heuristics.h).
#include "group_norm_dispatch.cuh"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace gn {

namespace {

template <typename T, int V, int A>
__global__ void __launch_bounds__(kSmallThreads)
    small_forward_kernel(OnePassArgs a, int64_t groups, int G, int D, uint32_t L, int lanes_log2, int k,
                         FastDivmod hw) {
  constexpr int K = kSmallMaxVecs / 32;  // vectors per lane at most
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & 31, sl = lane & (lanes - 1);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t u = warp * (32 >> lanes_log2) + (lane >> lanes_log2);  // this lane's group
  const bool active = u < groups;
  const uint32_t nvec = L / V;
  const T* __restrict__ xg = static_cast<const T*>(a.x) + (active ? u : 0) * L;
  float xv[K][V];
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint32_t v = sl + i * lanes;
    if (i < k && active && v < nvec) {
      load_vec<T, V>(xg + v * V, xv[i]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) xv[i][e] = 0.f;
    }
  }
  // The sum of x - x0, x0 = the group's first element: near a large mean a plain float sum rounds every
  // partial sum at ulp(sum); shifted, the terms and the sums are of the spread's size.
  const float x0 = __shfl_sync(0xffffffffu, xv[0][0], lane & ~(lanes - 1));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < k && sl + i * lanes < nvec) {
#pragma unroll
      for (int e = 0; e < V; ++e) s += xv[i][e] - x0;
    }
  }
  // Sums over the group's lanes (xor offsets below `lanes` stay inside the group); every lane takes part.
  for (int m = 1; m < lanes; m <<= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  const float mean = x0 + s / static_cast<float>(L);
  float q = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < k && sl + i * lanes < nvec) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = xv[i][e] - mean;
        q = fmaf(d, d, q);
      }
    }
  }
  for (int m = 1; m < lanes; m <<= 1) q += __shfl_xor_sync(0xffffffffu, q, m);
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
    float* y = xv[i];
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

}  // namespace

cudaError_t launch_small_forward(ScalarKind t, const Problem& p, const SmallGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || g.k < 1 || g.k > kSmallMaxVecs / 32 || g.lanes_log2 < 0 || g.lanes_log2 > 5)
    return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    constexpr int V = 16 / sizeof(T);
    if (g.vec != V) return cudaErrorInvalidValue;
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      small_forward_kernel<T, V, A><<<g.grid, kSmallThreads, 0, stream>>>(
          a, p.N * p.G, static_cast<int>(p.G), static_cast<int>(p.D), static_cast<uint32_t>(p.D * p.HxW),
          g.lanes_log2, g.k, FastDivmod(static_cast<uint32_t>(p.HxW)));
      return cudaGetLastError();
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

}  // namespace gn
}  // namespace gnext
