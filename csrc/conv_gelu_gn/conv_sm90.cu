// Hopper kernels of the fused ConvTranspose2d + GELU + GroupNorm op (stage 2), see conv_sm90.h.
// The conv is a CUTLASS 3 implicit GEMM (TMA im2col loads, warp-specialized wgmma mainloop, TF32);
// gnext only supplies its epilogue: an epilogue visitor tree (EVT) built from CUTLASS's nodes that
// stores z = acc and, from the same registers, per-tile column sums of a = GELU(z + bias) and a^2.
#include "conv_sm90.h"

#include "../common/device_utils.cuh"

#if defined(GNEXT_WITH_CUTLASS)
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/conv/convnd_problem_shape.hpp>
#include <cutlass/conv/device/conv_universal_adapter.hpp>
#include <cutlass/conv/dispatch_policy.hpp>
#include <cutlass/conv/kernel/conv_universal.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#endif

// Tile and pipeline, from a sweep on the H100 at L2#19 (conv_stats alone, ms): 4 stages of K = 32
// 3.91; 3 stages 4.46; 2 stages 4.56; 5 stages 5.53; as many stages as fit 4.92; K = 64 per stage
// 6.8-6.9; 64-row tiles 5.06. (More shared memory per CTA costs the second CTA per SM, which is
// what overlaps one CTA's epilogue with another's mainloop in this non-persistent kernel.)
#ifndef GNEXT_CONV_STAGES
#define GNEXT_CONV_STAGES 4  // smem pipeline stages of the conv mainloop (0: as many as fit)
#endif
#ifndef GNEXT_CONV_TILE_K
#define GNEXT_CONV_TILE_K 32  // GEMM K (input channels x taps) per stage
#endif

namespace gnext {
namespace conv_sm90 {

namespace {

__global__ void flip_filter_kernel(const float* __restrict__ w, float* __restrict__ f, int C_in, int C_out, int R,
                                   int S) {
  // f[k][r][s][c] = w[c][k][R-1-r][S-1-s]
  const int64_t total = int64_t(C_in) * C_out * R * S;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % C_in);
    int64_t t = i / C_in;
    const int s = int(t % S);
    t /= S;
    const int r = int(t % R);
    const int k = int(t / R);
    f[i] = w[((int64_t(c) * C_out + k) * R + (R - 1 - r)) * S + (S - 1 - s)];
  }
}

// Per (n, g): sums of a = GELU(z + bias) and a^2 from the tiles inside image n (partials) and from z
// for the rows of tiles that straddle the image's first / last row; then mean, rstd and coef.
template <int P>
__global__ void __launch_bounds__(256) stats_finalize_kernel(ConvProblem p, int G, int64_t ldp, const float* __restrict__ psum,
                                                             const float* __restrict__ psq,
                                                             const float* __restrict__ z,
                                                             const float* __restrict__ bias,
                                                             const float* __restrict__ gamma,
                                                             const float* __restrict__ beta, float eps,
                                                             float* __restrict__ mean, float* __restrict__ rstd,
                                                             float* __restrict__ coef) {
  const int n = blockIdx.x, g = blockIdx.y;
  const int D = p.K / G;
  const int64_t PQ = int64_t(p.P) * p.Q;
  const int64_t row0 = n * PQ, row1 = row0 + PQ;
  const int64_t t0 = (row0 + kTileM - 1) / kTileM, t1 = row1 / kTileM;  // whole tiles [t0, t1)
  double s = 0.0, q = 0.0;
  const int64_t items = t1 > t0 ? (t1 - t0) * D : 0;
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    const int64_t t = t0 + i / D;
    const int64_t c = int64_t(g) * D + i % D;
    s += psum[t * ldp + c];
    q += psq[t * ldp + c];
  }
  // Rows outside whole tiles: [row0, t0*TM) and [max(t1*TM, t0*TM), row1), recomputed from z.
  const int64_t head_end = t1 >= t0 ? t0 * kTileM : row1;
  const int64_t tail_begin = t1 >= t0 ? t1 * kTileM : row1;
  const int64_t head = head_end - row0, tail = row1 - tail_begin;
  for (int64_t i = threadIdx.x; i < (head + tail) * D; i += blockDim.x) {
    const int64_t r = i / D, c = int64_t(g) * D + i % D;
    const int64_t row = r < head ? row0 + r : tail_begin + (r - head);
    const float a = pre_apply<P>(z[row * p.K + c], bias ? bias[c] : 0.f);
    s += a;
    q += double(a) * a;
  }
  __shared__ double2 scratch[33];
  const double2 tot = block_reduce<Sum2dOp>(make_double2(s, q), scratch);
  const double cnt = double(PQ) * D;
  const double m = tot.x / cnt;
  const float mu = float(m), rs = float(1.0 / sqrt(fmax(tot.y / cnt - m * m, 0.0) + double(eps)));
  if (threadIdx.x == 0) {
    mean[n * G + g] = mu;
    rstd[n * G + g] = rs;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const int c = g * D + d;
    float4 v;
    v.x = mu;
    v.y = rs * (gamma ? gamma[c] : 1.f);
    v.z = 0.f;
    v.w = beta ? beta[c] : 0.f;
    reinterpret_cast<float4*>(coef)[int64_t(n) * p.K + c] = v;
  }
}

}  // namespace

cudaError_t flip_filter(const float* weight, float* filter, int C_in, int C_out, int R, int S, cudaStream_t stream) {
  const int64_t total = int64_t(C_in) * C_out * R * S;
  const int blocks = int((total + 255) / 256 < 1024 ? (total + 255) / 256 : 1024);
  flip_filter_kernel<<<blocks, 256, 0, stream>>>(weight, filter, C_in, C_out, R, S);
  return cudaGetLastError();
}

cudaError_t stats_finalize(const ConvProblem& p, int G, const float* partial_sum, const float* partial_sq,
                           const float* z, const float* bias, int gelu_kind, const float* gamma, const float* beta,
                           float eps, float* mean, float* rstd, float* coef, cudaStream_t stream) {
  const dim3 grid(p.N, G);
  if (gelu_kind == kPreBiasGeluTanh)
    stats_finalize_kernel<kPreBiasGeluTanh><<<grid, 256, 0, stream>>>(p, G, padded_channels(p), partial_sum, partial_sq, z, bias, gamma,
                                                                      beta, eps, mean, rstd, coef);
  else
    stats_finalize_kernel<kPreBiasGelu><<<grid, 256, 0, stream>>>(p, G, padded_channels(p), partial_sum, partial_sq, z, bias, gamma, beta,
                                                                  eps, mean, rstd, coef);
  return cudaGetLastError();
}

bool supports(const ConvProblem& p) {
  // TMA: 16-byte aligned rows of C and K floats; the GEMM's K (= R*S*C) walks C in steps of 32.
  if (p.C % 32 != 0 || p.K % 4 != 0) return false;
  // TMA im2col coordinates and the GEMM's M are 32-bit.
  const int64_t M = int64_t(p.N) * p.P * p.Q;
  if (M >= (int64_t(1) << 31) || int64_t(p.N) * p.H * p.W >= (int64_t(1) << 31)) return false;
  if (p.R > 8 || p.S > 8 || p.pad_h >= p.R || p.pad_w >= p.S) return false;
  return M > 0;
}

#if defined(GNEXT_WITH_CUTLASS)

namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

using TileShape = Shape<Int<kTileM>, Int<kTileN>, Shape<Int<GNEXT_CONV_TILE_K>>>;
using ClusterShape = Shape<_1, _1, _1>;

// EVT compute functors; Sm90Compute instantiates them with Array<float, FragmentSize>.
template <int P>
struct BiasGelu {
  template <class A>
  struct Fn {
    CUTLASS_DEVICE A operator()(A const& acc, A const& bias) const {
      A r;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < A::kElements; ++i) r[i] = pre_apply<P>(acc[i], bias[i]);
      return r;
    }
  };
};
template <class A>
struct Square {
  CUTLASS_DEVICE A operator()(A const& a) const {
    A r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < A::kElements; ++i) r[i] = a[i] * a[i];
    return r;
  }
};
template <class A>
struct PassFirst {  // the tree's root: stores its first child (z), after the second (statistics) ran
  CUTLASS_DEVICE A operator()(A const& first, A const&) const { return first; }
};

// Per-tile column sums (non-final: partial[tile][channel], no atomics, deterministic). The two
// reductions cost 0.52 ms of the kernel's 3.91 ms at L2#19 (3.39 ms without them). VisitCheckOOB stays
// on: rows past N*P*Q would be harmless (stats_finalize recomputes the last tile's rows from z), but
// the unchecked variant measured slower (4.83 ms).
using TileColumnSum = fusion::Sm90RowReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float,
                                               float, kRound, Stride<_0, _1, _0>, 4, /*EnableNullptr=*/false,
                                               /*FinalReduction=*/false>;
using Acc = fusion::Sm90AccFetch;
using BiasRow = fusion::Sm90RowBroadcast<0, TileShape, float, float>;  // bias[channel]

template <int P>
using Gelu = fusion::Sm90EVT<fusion::Sm90Compute<BiasGelu<P>::template Fn, float, float, kRound>, Acc, BiasRow>;
template <int P>
using SumA = fusion::Sm90EVT<TileColumnSum, Gelu<P>>;  // passes a through
template <int P>
using SumSq = fusion::Sm90EVT<TileColumnSum, fusion::Sm90EVT<fusion::Sm90Compute<Square, float, float, kRound>, SumA<P>>>;
template <int P>
using Root = fusion::Sm90EVT<fusion::Sm90Compute<PassFirst, float, float, kRound>, Acc, SumSq<P>>;

template <int P>
struct Kernel {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::TensorNHWC, 4, float,
      cutlass::layout::TensorNHWC, 4, cutlass::epilogue::TmaWarpSpecialized, Root<P>>::CollectiveOp;
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop, float,
      cutlass::layout::TensorNHWC, 4, float, cutlass::layout::TensorNHWC, 4, float, TileShape, ClusterShape,
      std::conditional_t<GNEXT_CONV_STAGES == 0,
                         cutlass::conv::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
                         cutlass::conv::collective::StageCount<GNEXT_CONV_STAGES>>,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  using ProblemShape = cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kFprop, 2>;
  using Op = cutlass::conv::kernel::ConvUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::conv::device::ConvUniversalAdapter<Op>;
};

template <int P>
cudaError_t run(const ConvProblem& p, const float* x, const float* filter, const float* bias, float* z, float* psum,
                float* psq, cudaStream_t stream) {
  using K = Kernel<P>;
  using Device = typename K::Device;
  typename K::ProblemShape shape(cutlass::conv::Mode::kCrossCorrelation, {p.N, p.H, p.W, p.C}, {p.K, p.R, p.S, p.C},
                                 {p.pad_h, p.pad_w}, {p.pad_h, p.pad_w}, {1, 1}, {1, 1}, 1);
  using StrideD = typename Device::ConvKernel::StrideD;
  StrideD stride_d{};
  cute::for_each(cute::make_seq<cute::rank<0>(StrideD{})>{}, [&](auto i) {
    cute::get<0, i>(stride_d) = shape.stride_C[K::ProblemShape::RankT - 2 - i];
  });
  // Fusion arguments mirror the tree: {children..., node}.
  using BiasArgs = typename BiasRow::Arguments;
  using SumArgs = typename TileColumnSum::Arguments;
  typename Root<P>::Arguments fusion_args{
      {},                                                                          // Acc
      {{{{{}, BiasArgs{bias, 0.f, {}}, {}}, SumArgs{psum, 0.f, {}}}, {}}, SumArgs{psq, 0.f, {}}},  // SumSq
      {}};                                                                         // PassFirst
  typename Device::Arguments args{shape, {x, filter}, {fusion_args, nullptr, stride_d, z, stride_d}};
  Device op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
  if (Device::get_workspace_size(args) != 0) return cudaErrorNotSupported;  // this tree needs none
  if (op.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
  if (op.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();  // read once: the call also clears it
    return e != cudaSuccess ? e : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace

// The kernel image must be real sm_90a code: a build whose only Hopper code is PTX of an older arch
// would JIT CUTLASS's guarded kernel into a stub.
bool available() {
  static const bool ok = [] {
    cudaFuncAttributes a{};
    if (cudaFuncGetAttributes(&a, cutlass::device_kernel<typename Kernel<kPreBiasGelu>::Op>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.ptxVersion == 90;
  }();
  return ok;
}

cudaError_t conv_stats(const ConvProblem& p, const float* x, const float* filter, const float* bias, int gelu_kind,
                       float* z, float* partial_sum, float* partial_sq, cudaStream_t stream) {
  if (!supports(p)) return cudaErrorNotSupported;
  return gelu_kind == kPreBiasGeluTanh
             ? run<kPreBiasGeluTanh>(p, x, filter, bias, z, partial_sum, partial_sq, stream)
             : run<kPreBiasGelu>(p, x, filter, bias, z, partial_sum, partial_sq, stream);
}

#else  // built without CUTLASS: the op uses its ATen/cuDNN conv path

bool available() { return false; }

cudaError_t conv_stats(const ConvProblem&, const float*, const float*, const float*, int, float*, float*, float*,
                       cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace conv_sm90
}  // namespace gnext
