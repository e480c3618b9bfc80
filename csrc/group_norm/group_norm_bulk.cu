// SPDX-License-Identifier: BSD-3-Clause
// Launchers of the bulk GroupNorm forward and backward (group_norm_bulk.cuh); dispatch and launch only.
// No ATen, no message formatting here (see group_norm_launch.h); errors return as cudaError_t.
#include <algorithm>
#include <type_traits>

#include "group_norm_bulk.cuh"
#include "group_norm_dispatch.cuh"

namespace gnext {
namespace gn {

namespace {
template <typename T, int A, int P>
struct BulkTag {};
// Streamed geometry (BulkStages): hold >= 0 and at least one stage left to each warp that takes streamed chunks
// (esize 0: the stage count alone).
bool bulk_stream_fits(const Problem& p, const BulkGeometry& g, int64_t esize) {
  if (!g.stream) return true;
  const int64_t left = g.stages - int64_t{g.ahead + 1} * g.hold;
  if (g.hold < 0 || left < 1) return false;
  if (esize == 0) return true;
  const int64_t cnt_max = ((p.D * p.HxW * esize + g.chunk - 1) / g.chunk + g.team - 1) / g.team;
  return left >= std::min<int64_t>(g.consumers / g.parts, cnt_max - g.hold);
}
template <typename T, int A>
struct BulkBwdTag {};
}  // namespace

cudaError_t launch_bulk_forward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr || g.consumers < 1 ||
      g.consumers > kBulkMaxConsumers || g.stages > kBulkMaxStages || g.chunk % 16 != 0 || g.ahead < 1 ||
      g.ahead > kBulkSlots - 2 || bulk_header_bytes(g.stages, g.consumers, false) > kBulkHeader ||
      !bulk_stream_fits(p, g, 0) || !bulk_parts_compiled(g.parts) || g.chunk % (16 * g.parts) != 0 ||
      g.consumers % g.parts != 0 || g.team < 1 || g.grid % g.team != 0)
    return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    if (p.HxW % (16 / static_cast<int64_t>(sizeof(T))) != 0 || !bulk_stream_fits(p, g, sizeof(T)))
      return cudaErrorInvalidValue;
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      auto run = [&](auto pp) -> cudaError_t {
        constexpr int P = decltype(pp)::value;
        // cooperative: every CTA waits on all others once per group
        return launch_persistent<BulkTag<T, A, P>>(bulk_forward_kernel<T, A, P>, g.grid, bulk_threads(g.consumers),
                                                  g.smem, true, stream, a, g, p.N * p.G, p.D * p.HxW,
                                                  FastDivmod(static_cast<uint32_t>(p.HxW)), static_cast<int>(p.G),
                                                  static_cast<int>(p.D));
      };
      if (g.parts == 4) return run(std::integral_constant<int, 4>{});
      return g.parts == 2 ? run(std::integral_constant<int, 2>{}) : run(std::integral_constant<int, 1>{});
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

cudaError_t launch_bulk_backward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                 cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr || a.out == nullptr || g.consumers < 1 ||
      g.consumers > kBulkMaxConsumersBwd || g.stages > kBulkMaxStages || g.chunk % 16 != 0 || g.ahead < 0 ||
      g.ahead > kBulkSlots - 2 || bulk_header_bytes(g.stages, g.consumers, true) > kBulkHeader ||
      g.grid > static_cast<unsigned>(kBulkMaxGridBwd) || !bulk_stream_fits(p, g, 0) || g.parts != 1 ||
      g.team != g.grid)
    return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    const int64_t E = g.chunk / static_cast<int64_t>(sizeof(T)), L = p.D * p.HxW;
    const int64_t nc = (L + E - 1) / E;
    // a slice within two channels: the kernel sums a slice's first and second channel
    if (p.HxW % (16 / static_cast<int64_t>(sizeof(T))) != 0 || (nc + g.grid - 1) / g.grid * E > p.HxW)
      return cudaErrorInvalidValue;
    if (!bulk_stream_fits(p, g, sizeof(T))) return cudaErrorInvalidValue;
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      return launch_persistent<BulkBwdTag<T, A>>(bulk_backward_kernel<T, A>, g.grid, bulk_threads(g.consumers), g.smem,
                                                true, stream, a, g, p.N * p.G, L,
                                                FastDivmod(static_cast<uint32_t>(p.HxW)), static_cast<int>(p.G),
                                                static_cast<int>(p.D));
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

}  // namespace gn
}  // namespace gnext
