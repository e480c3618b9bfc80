// SPDX-License-Identifier: BSD-3-Clause
// Launchers of the persistent GroupNorm kernels: one-pass (group_norm_onepass.cuh) and wide
// (group_norm_wide.cuh); dispatch and launch only.
// No ATen, no message formatting here (see group_norm_launch.h); errors return as cudaError_t.
#include "group_norm_dispatch.cuh"
#include "group_norm_onepass.cuh"
#include "group_norm_wide.cuh"

namespace gnext {
namespace gn {

namespace {
// Tags of launch_persistent: one-pass kernels by (T, kernel id), wide kernels by (T, activation, bwd).
template <typename T, int Id>
struct OnePassTag {};
template <typename T, int A, bool Bwd>
struct WideTag {};
template <typename T, int A>
struct WideNhwcTag {};
}  // namespace

cudaError_t launch_onepass(bool bwd, ScalarKind t, const Problem& p, const OnePassGeometry& g, const OnePassArgs& a,
                           cudaStream_t stream) {
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    constexpr int V = 16 / sizeof(T);
    if (g.vec != V || g.threads > kOnePassThreads || g.threads % 32 != 0) return cudaErrorInvalidValue;
    // CTAs wait on each other only when a group spans several tiles: then all must be co-resident.
    auto go = [&](auto id, auto kernel, auto... extra) -> cudaError_t {
      return launch_persistent<OnePassTag<T, decltype(id)::value>>(kernel, g.grid, g.threads, g.smem,
                                                                   a.counters != nullptr, stream, a, g, extra...);
    };
    auto layout = [&](auto btag) -> cudaError_t {
      constexpr bool B = decltype(btag)::value;
      if (g.nhwc) {
        if (a.pw.mode != kPreNone) return cudaErrorInvalidValue;  // no prologue in the NHWC kernel
        return go(std::integral_constant<int, 2 * B>{}, onepass_nhwc_kernel<T, V, B>, p.C, p.G, p.D, p.HxW,
                  g.units * g.T);
      }
      // Channel of a vector (ragged: of an element) within a multi-channel tile.
      if (g.ragged && (B || pw_pre(a.pw.mode) != kPreNone)) return cudaErrorInvalidValue;  // forward epilogues only
      const FastDivmod hwv = g.ragged    ? FastDivmod(static_cast<uint32_t>(p.HxW))
                             : g.cpt > 1 ? FastDivmod(static_cast<uint32_t>(p.HxW / V))
                                         : FastDivmod();
      return with_pw(a.pw.mode, [&](auto pp) {
        constexpr int P = decltype(pp)::value;
        return go(std::integral_constant<int, 2 * B + 1 + 4 * P>{}, onepass_nchw_kernel<T, V, B, P>, p.G, p.D,
                  p.HxW, g.units * g.T, hwv);
      });
    };
    return bwd ? layout(std::true_type{}) : layout(std::false_type{});
  });
}

cudaError_t launch_wide_forward(ScalarKind t, const Problem& p, const WideGeometry& g, const OnePassArgs& a,
                                cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr) return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      // cooperative: every CTA waits on all others once per group
      return launch_persistent<WideTag<T, A, false>>(
          wide_forward_kernel<T, A>, g.grid, kWideThreads, g.smem, true, stream, a, p.N * p.G, p.D * p.HxW,
          FastDivmod(static_cast<uint32_t>(p.HxW)), static_cast<int>(p.G), static_cast<int>(p.D), g.slice, g.held,
          g.ahead);
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

cudaError_t launch_wide_nhwc_forward(ScalarKind t, const Problem& p, const WideGeometry& g, const OnePassArgs& a,
                                     cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr || g.threads > kWideThreads) return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    constexpr int V = 16 / sizeof(T);
    if (p.C % V != 0 || g.threads % (p.C / V) != 0) return cudaErrorInvalidValue;
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      return launch_persistent<WideNhwcTag<T, A>>(
          wide_nhwc_forward_kernel<T, A>, g.grid, g.threads, g.smem, true, stream, a, p.N, p.C * p.HxW,
          static_cast<int>(p.C), static_cast<int>(p.G), static_cast<int>(p.D), g.slice, g.held, g.ahead);
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

cudaError_t launch_wide_backward(ScalarKind t, const Problem& p, const WideGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr || g.slice > p.HxW) return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      return launch_persistent<WideTag<T, A, true>>(
          wide_backward_kernel<T, A>, g.grid, kWideThreads, g.smem, true, stream, a, p.N * p.G, p.D * p.HxW,
          FastDivmod(static_cast<uint32_t>(p.HxW)), p.HxW, static_cast<int>(p.G), static_cast<int>(p.D), g.slice,
          g.held);
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

}  // namespace gn
}  // namespace gnext
