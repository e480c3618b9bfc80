// SPDX-License-Identifier: BSD-3-Clause
// Launcher of the bulk GroupNorm forward (group_norm_bulk.cuh); dispatch and launch only.
// No ATen, no message formatting here (see group_norm_launch.h); errors return as cudaError_t.
#include "group_norm_bulk.cuh"
#include "group_norm_dispatch.cuh"

namespace gnext {
namespace gn {

namespace {
template <typename T, int A>
struct BulkTag {};
}  // namespace

cudaError_t launch_bulk_forward(ScalarKind t, const Problem& p, const BulkGeometry& g, const OnePassArgs& a,
                                cudaStream_t stream) {
  if (pw_pre(a.pw.mode) != kPreNone || a.counters == nullptr || g.consumers < 1 ||
      g.consumers > kBulkMaxConsumers || g.stages > kBulkMaxStages || g.chunk % 16 != 0 || g.ahead < 1 ||
      g.ahead > kBulkSlots - 2)
    return cudaErrorInvalidValue;
  return with_scalar(t, [&](auto tt) -> cudaError_t {
    using T = decltype(tt);
    if (p.HxW % (16 / static_cast<int64_t>(sizeof(T))) != 0) return cudaErrorInvalidValue;
    auto go = [&](auto aa) -> cudaError_t {
      constexpr int A = decltype(aa)::value;
      // cooperative: every CTA waits on all others once per group
      return launch_persistent<BulkTag<T, A>>(bulk_forward_kernel<T, A>, g.grid, (g.consumers + 3) * 32, g.smem,
                                             true, stream, a, g, p.N * p.G, p.D * p.HxW,
                                             FastDivmod(static_cast<uint32_t>(p.HxW)), static_cast<int>(p.G),
                                             static_cast<int>(p.D));
    };
    return with_int<0, kActCount>(pw_act(a.pw.mode), go);
  });
}

}  // namespace gn
}  // namespace gnext
