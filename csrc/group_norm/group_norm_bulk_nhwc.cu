// SPDX-License-Identifier: BSD-3-Clause
// Launcher of the channels_last bulk GroupNorm forward (group_norm_bulk_nhwc.cuh); dispatch and launch only.
// No ATen, no message formatting here (see group_norm_launch.h); errors return as cudaError_t.
#include <type_traits>

#include "group_norm_bulk_nhwc.cuh"
#include "group_norm_dispatch.cuh"
#include "group_norm_plan.h"  // bulk_nhwc_slots, kBulkChunk

namespace gnext {
namespace gn {

namespace {
template <typename T, int A>
struct BulkNhwcTag {};
}  // namespace

cudaError_t launch_bulk_nhwc_forward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                     cudaStream_t stream) {
  const int esize = t == ScalarKind::Float ? 4 : 2;
  const int M = bulk_nhwc_slots(p, esize);
  if (M == 0 || pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr || g.consumers < 1 ||
      g.consumers > kBulkMaxConsumers || g.stages > kBulkMaxStages || g.chunk % kBulkChunk != 0 || g.ahead < 1 ||
      g.ahead > kBulkSlots - 2 || g.header < bulk_nhwc_header_bytes(g.consumers, p.G, p.C) ||
      g.smem < g.header + static_cast<size_t>(g.stages) * g.chunk || g.parts != g.chunk / kBulkChunk ||
      g.consumers % (g.parts * M) != 0 || g.team < 1 || g.grid % g.team != 0 || (g.stream && g.hold < 0))
    return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      // cooperative: every CTA of a team waits on the others once per image
      return launch_persistent<BulkNhwcTag<T, A>>(
          bulk_nhwc_forward_kernel<T, A>, g.grid, bulk_threads(g.consumers, kBulkNhwcMergers), g.smem, true, stream, a,
          g, p.N, p.C * p.HxW, static_cast<int>(p.C), static_cast<int>(p.G), static_cast<int>(p.D));
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

}  // namespace gn
}  // namespace gnext
