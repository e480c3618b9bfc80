// SPDX-License-Identifier: BSD-3-Clause
// The planner's choices as text, for `python -m groupnorm_ext --plan` (groupnorm_ext._C._plan): the same
// plan_forward / plan_backward the ops call, for the current GPU or for any Device.
#include "group_norm_plan_text.h"

#include <cstdio>
#include <string>

#include "../common/cuda_utils.h"
#include "group_norm_plan.h"

namespace gnext {

gn::Device plan_device();  // group_norm_cuda.cpp

namespace {

template <typename... Args>
std::string fmt(const char* f, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), f, args...);
  return buf;
}

std::string mib(int64_t bytes) {
  return bytes < (1 << 20) ? fmt("%.1f KiB", static_cast<double>(bytes) / 1024)
                           : fmt("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

const char* kernel_name(gn::Kernel k) {
  switch (k) {
    case gn::Kernel::kSmall: return "small-group";
    case gn::Kernel::kBulk: return "bulk";
    case gn::Kernel::kBulkNhwc: return "bulk channels_last";
    case gn::Kernel::kOnePass: return "one-pass";
    case gn::Kernel::kWide: return "wide";
    case gn::Kernel::kWideNhwc: return "wide channels_last";
    case gn::Kernel::kTwoPass: return "two-pass";
  }
  return "?";
}

// Kernel, geometry, and the DRAM bytes the plan moves (second reads of the two-pass kernels counted as DRAM).
std::string describe(const char* dir, bool bwd, const gn::Plan& pl, const gn::Problem& p, const gn::Request& r) {
  const int64_t tensor = p.N * p.C * p.HxW * r.esize;
  std::string s = fmt("%s: %s (%s layout)\n  why: %s\n", dir, kernel_name(pl.kernel), pl.nhwc ? "NHWC" : "NCHW", pl.why);
  int reads = bwd ? 2 : 1;
  switch (pl.kernel) {
    case gn::Kernel::kSmall: {
      const auto& g = pl.small;
      s += fmt("  grid %u CTAs x %d threads; %s per group, %d vectors of %d elements per lane (registers for %d)\n",
               g.grid, gn::kSmallThreads,
               g.lanes_log2 == gn::kSmallCtaLog2 ? "a CTA" : fmt("%d lanes", 1 << g.lanes_log2).c_str(), g.k, g.vec,
               g.kreg);
      break;
    }
    case gn::Kernel::kBulk:
    case gn::Kernel::kBulkNhwc: {
      const auto& g = pl.bulk;
      const bool images = pl.kernel == gn::Kernel::kBulkNhwc;
      const int mergers = images ? gn::kBulkNhwcMergers : 1;
      s += fmt("  grid %u persistent CTAs x %d threads (%d consumer warps, producer, publisher, %d merger(s)), %zu B "
               "shared memory; ring of %d %s of %d B (%d part(s) of 4 KiB, a consumer warp each), look-ahead %d %s; "
               "producer %s\n",
               g.grid, gn::bulk_threads(g.consumers, mergers), g.consumers, mergers, g.smem, g.stages,
               bwd ? "stages, x and dy chunks" : "chunks", g.chunk, g.parts, g.ahead, images ? "image(s)" : "group(s)",
               g.per_chunk || g.stream ? "per chunk" : "counts stages up");
      if (g.team != g.grid)
        s += fmt("  %u teams of %u CTAs: team t takes %s t, t + %u, ...\n", g.grid / g.team, g.team,
                 images ? "images" : "groups", g.grid / g.team);
      if (g.stream)
        s += fmt("  streamed: %d chunks of each slice held in shared memory, the rest read again from L2\n",
                 g.hold);
      break;
    }
    case gn::Kernel::kOnePass: {
      const auto& g = pl.onepass;
      s += fmt("  grid %u persistent CTAs x %d threads, %zu B shared memory each; %lld units of %lld tiles of %lld "
               "elements, %d stage(s)%s%s\n",
               g.grid, g.threads, g.smem, static_cast<long long>(g.units), static_cast<long long>(g.T),
               static_cast<long long>(g.tile), g.nbuf, g.ragged ? ", ragged" : "", g.early ? ", early publish" : "");
      break;
    }
    case gn::Kernel::kWide:
    case gn::Kernel::kWideNhwc: {
      const auto& g = pl.wide;
      s += fmt("  grid %u CTAs (one per SM) x %d threads, %zu B shared memory; slice %lld elements per CTA, %lld "
               "held in shared memory, look-ahead %d\n",
               g.grid, g.threads, g.smem, static_cast<long long>(g.slice), static_cast<long long>(g.held), g.ahead);
      break;
    }
    case gn::Kernel::kTwoPass: {
      const auto& g = pl.reduce;
      const bool tiles = !pl.nhwc && pl.affine.rows_per_cta == 0;
      s += fmt("  reduce: %lld chunk(s) of %lld %s, %d threads, vector %d; finalize; elementwise: grid %u x %u, %d "
               "threads%s\n",
               static_cast<long long>(g.K), static_cast<long long>(g.chunk), pl.nhwc ? "rows" : "elements", g.threads,
               g.vec, pl.affine.grid_x, pl.affine.grid_y, pl.affine.threads,
               tiles ? fmt(", tiles of %lld elements", static_cast<long long>(pl.affine.chunk)).c_str() : "");
      reads = bwd ? 4 : 2;
      break;
    }
  }
  s += fmt("  DRAM: %dR + 1W of %s = %s at most\n", reads, mib(tensor).c_str(), mib((reads + 1) * tensor).c_str());
  return s;
}

}  // namespace

std::string describe_plans(const gn::Problem& p, const gn::Request& r, const gn::Device& d, const gn::Tuning& t) {
  std::string s = fmt("problem: N=%lld C=%lld G=%lld HxW=%lld, %d-byte elements, %s%s%s%s; %s, %lld groups of %s\n",
                      static_cast<long long>(p.N), static_cast<long long>(p.C), static_cast<long long>(p.G),
                      static_cast<long long>(p.HxW), static_cast<int>(r.esize),
                      r.contiguous ? "NCHW" : "channels_last", r.act != kActIdentity ? ", output activation" : "",
                      r.residual ? ", residual" : "", r.input_shift ? ", input bias" : "",
                      mib(p.N * p.C * p.HxW * r.esize).c_str(),
                      static_cast<long long>(p.N * p.G), mib(p.D * p.HxW * r.esize).c_str());
  s += fmt("device: %d SMs, sm_%d0+, %lld KiB shared memory per SM (%lld per block), %s L2, peak DRAM %lld GB/s "
           "(persistent kernels pay: %s)\n",
           d.sms, d.major, static_cast<long long>(d.smem_per_sm / 1024), static_cast<long long>(d.smem_per_block / 1024),
           mib(d.l2_bytes).c_str(), static_cast<long long>(d.peak_gbs),
           gn::persistent_kernels_pay(d.peak_gbs) ? "yes" : "no, >= 3.8 TB/s");
  s += describe("forward", false, gn::plan_forward(p, r, d, t), p, r);
  gn::Request b = r;
  b.flat = r.contiguous;
  s += describe("backward", true, gn::plan_backward(p, b, d, t), p, r);
  return s;
}

std::array<int64_t, 7> current_plan_device() {
  const gn::Device d = plan_device();
  return {d.sms, d.major, d.smem_per_sm, d.smem_per_block, d.smem_reserved, d.l2_bytes, d.peak_gbs};
}

std::string describe_plans(const std::array<int64_t, 4>& shape, int esize, bool channels_last, int act,
                           bool residual, const std::array<int64_t, 7>& dev, bool input_bias) {
  const gn::Problem p{shape[0], shape[1], shape[2], shape[1] / shape[2], shape[3]};
  gn::Request r;
  r.esize = esize;
  r.contiguous = !channels_last || p.HxW == 1;
  r.act = act;
  r.residual = residual;
  r.input_shift = input_bias;
  const gn::Device d{static_cast<int>(dev[0]), static_cast<int>(dev[1]), dev[2], dev[3], dev[4], dev[5], dev[6]};
  return describe_plans(p, r, d, gn::tuning());
}

}  // namespace gnext
