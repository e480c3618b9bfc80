// Host glue for the GroupNorm CUDA kernels: argument checks, layout choice, launch
// configuration and dispatch. The kernels live in group_norm_kernels.cuh.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "../common/dispatch.h"
#include "group_norm.h"
#include "group_norm_kernels.cuh"

namespace gnext {
namespace {

using gn::kMaxThreads;
using gn::kUnroll;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// CTAs to aim for per launch: enough to fill every SM a few times over.
int64_t target_ctas() { return 4 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount); }

size_t max_dynamic_smem() { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }

// ------------------------------------------------------------------------------------------
// Launch configurations.

// NCHW reduction: grid (N*C rows, K chunks of `chunk` elements).
struct NchwReduceCfg {
  int64_t K, chunk;
  int threads;
};
NchwReduceCfg nchw_reduce_cfg(const GNShape& s, int V) {
  const int64_t rows = s.N * s.C;
  int64_t K = rows >= target_ctas() ? 1 : std::min(ceil_div(target_ctas(), rows), std::max<int64_t>(1, s.HxW / 4096));
  const int64_t chunk = round_up(ceil_div(s.HxW, K), V);
  K = ceil_div(s.HxW, chunk);
  const int threads = static_cast<int>(std::clamp<int64_t>(round_up(ceil_div(chunk / V, kUnroll), 32), 32, kMaxThreads));
  return {K, chunk, threads};
}

// NCHW elementwise pass: long rows split in chunks, short rows packed rows_per_cta to a CTA.
struct NchwAffineCfg {
  dim3 grid;
  int threads, rows_per_cta;
  int64_t chunk;
};
NchwAffineCfg nchw_affine_cfg(const GNShape& s, int V) {
  const int64_t rows = s.N * s.C, hwv = s.HxW / V;
  constexpr int64_t kVecsPerCta = kMaxThreads * kUnroll;
  int64_t rows_per_cta = std::max<int64_t>(1, kVecsPerCta / hwv);
  rows_per_cta = std::min(rows_per_cta, std::max<int64_t>(1, rows / target_ctas()));
  if (rows_per_cta > 1) {
    const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, round_up(rows_per_cta * hwv, 32)));
    return {dim3(static_cast<unsigned>(ceil_div(rows, rows_per_cta))), threads, static_cast<int>(rows_per_cta), s.HxW};
  }
  int64_t K = rows >= target_ctas() ? 1 : std::min(ceil_div(target_ctas(), rows), std::max<int64_t>(1, hwv / kVecsPerCta));
  const int64_t chunk = round_up(ceil_div(s.HxW, K), V);
  K = ceil_div(s.HxW, chunk);
  const int threads = static_cast<int>(std::clamp<int64_t>(round_up(ceil_div(chunk / V, kUnroll), 32), 32, kMaxThreads));
  return {dim3(static_cast<unsigned>(rows), static_cast<unsigned>(K)), threads, 1, chunk};
}

// NHWC (N, rows = HxW, C): grid (N, K ranges of rchunk rows); a thread owns channel vectors
// t % tpr (+ tpr ...) and rows t / tpr (+ rpi ...).
struct NhwcCfg {
  int64_t K, rchunk;
  int tpr, rpi, threads;
};
NhwcCfg nhwc_cfg(const GNShape& s, int V) {
  constexpr int kThreads = 256;
  const int CV = static_cast<int>(s.C / V);
  const int tpr = std::min(CV, kThreads);
  const int rpi = std::max(1, kThreads / tpr);
  const int threads = static_cast<int>(round_up(tpr * rpi, 32));
  // Enough CTAs to fill the GPU, each with a few full row sweeps, and few enough partials
  // that the per-group finalize (D*K merges) stays cheap.
  int64_t K = ceil_div(target_ctas(), s.N);
  K = std::min(K, ceil_div(s.HxW, static_cast<int64_t>(rpi) * kUnroll));
  K = std::min(K, std::max<int64_t>(1, (int64_t{1} << 15) / s.D));
  K = std::max<int64_t>(K, 1);
  const int64_t rchunk = ceil_div(s.HxW, K);
  return {ceil_div(s.HxW, rchunk), rchunk, tpr, rpi, threads};
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Whether the NHWC reduction's shared memory (rpi * C states) fits.
template <typename State>
bool nhwc_fits(const GNShape& s, int V) {
  const NhwcCfg cfg = nhwc_cfg(s, V);
  return static_cast<size_t>(cfg.rpi) * s.C * sizeof(State) <= max_dynamic_smem();
}

// ------------------------------------------------------------------------------------------
// Reduction (per-channel partials) for either layout; returns where partials of (n, c, k) live.
template <typename T, int V, typename R>
gn::PartialLayout launch_reduce(bool nhwc, const GNShape& s, const T* x, const T* dy, const float* mean, Tensor& buf) {
  using State = typename R::State;
  constexpr int64_t kFloats = sizeof(State) / sizeof(float);
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, at::cuda::current_device());
  if (nhwc) {
    const NhwcCfg cfg = nhwc_cfg(s, V);
    buf = at::empty({s.N * cfg.K * s.C * kFloats}, fopts);
    const size_t smem = static_cast<size_t>(cfg.rpi) * s.C * sizeof(State);
    auto kernel = gn::reduce_nhwc_kernel<T, V, R>;
    set_smem(kernel, smem);
    kernel<<<dim3(s.N, cfg.K), cfg.threads, smem, stream>>>(x, dy, mean, reinterpret_cast<State*>(buf.data_ptr<float>()),
                                                            s.HxW, cfg.rchunk, s.C, s.D, s.G, cfg.tpr, cfg.rpi);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {cfg.K, cfg.K * s.C, 1, s.C};
  }
  const NchwReduceCfg cfg = nchw_reduce_cfg(s, V);
  buf = at::empty({s.N * s.C * cfg.K * kFloats}, fopts);
  gn::reduce_nchw_kernel<T, V, R><<<dim3(s.N * s.C, cfg.K), cfg.threads, 0, stream>>>(
      x, dy, mean, reinterpret_cast<State*>(buf.data_ptr<float>()), s.HxW, cfg.chunk, s.C, s.D, s.G);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {cfg.K, s.C * cfg.K, cfg.K, 1};
}

// Elementwise pass out = coef.y*(x - coef.x) [+ coef.z*dy] + coef.w for either layout.
template <typename T, int V, bool HasDy>
void launch_affine(bool nhwc, const GNShape& s, const T* x, const T* dy, T* out, const float4* coef) {
  auto stream = at::cuda::getCurrentCUDAStream();
  if (nhwc) {
    const NhwcCfg cfg = nhwc_cfg(s, V);
    gn::affine_nhwc_kernel<T, V, HasDy><<<dim3(s.N, cfg.K), cfg.threads, 0, stream>>>(
        x, dy, out, coef, s.HxW, cfg.rchunk, s.C, cfg.tpr, cfg.rpi);
  } else {
    const NchwAffineCfg cfg = nchw_affine_cfg(s, V);
    gn::affine_nchw_kernel<T, V, HasDy><<<cfg.grid, cfg.threads, 0, stream>>>(
        x, dy, out, coef, s.N * s.C, s.HxW, cfg.chunk, cfg.rows_per_cta, FastDivmod(s.HxW / V));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f with a value of the parameter element type: float32, or the input's type T.
template <typename T, typename F>
void dispatch_param(at::ScalarType t, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else {
    f(T{});
  }
}

template <typename W>
const W* ptr_or_null(const OptTensor& t) {
  return defined(t) ? t->data_ptr<W>() : nullptr;
}

// Layout the kernels run in: NHWC for channels_last input, and for HxW == 1 (where (N, C) memory
// is the same in both); NCHW otherwise, or when the NHWC shared memory would not fit.
template <typename State, typename T>
bool use_nhwc(const Tensor& x, const GNShape& s, std::initializer_list<const void*> ptrs) {
  if (x.is_contiguous() && s.HxW != 1) return false;
  return nhwc_fits<State>(s, vector_width<T>(s.C, ptrs));
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> group_norm_cuda(const Tensor& input, int64_t num_groups, const OptTensor& weight,
                                                   const OptTensor& bias, double eps) {
  const char* op = "gnext.group_norm";
  const GNShape s = check_group_norm_args(op, input, num_groups, weight, bias);
  c10::cuda::CUDAGuard guard(input.device());
  const Tensor x_in = dense_input(input);
  Tensor out = at::empty_like(x_in);
  Tensor mean = at::empty({s.N, s.G}, input.options().dtype(at::kFloat));
  Tensor rstd = at::empty_like(mean);
  if (input.numel() == 0) {  // statistics of an empty group are undefined
    mean.fill_(std::numeric_limits<float>::quiet_NaN());
    rstd.fill_(std::numeric_limits<float>::quiet_NaN());
    return {out, mean, rstd};
  }
  const OptTensor w = defined(weight) ? OptTensor(weight->contiguous()) : std::nullopt;
  const OptTensor b = defined(bias) ? OptTensor(bias->contiguous()) : std::nullopt;
  Tensor coef = at::empty({s.N, s.C, 4}, mean.options());
  GNEXT_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, [&] {
    using T = scalar_t;
    const bool nhwc = use_nhwc<WelfordState, T>(x_in, s, {x_in.data_ptr(), out.data_ptr()});
    // Channels_last input too wide for the NHWC kernels' shared memory runs in NCHW.
    const Tensor x = nhwc || x_in.is_contiguous() ? x_in : x_in.contiguous();
    Tensor y = x.is_same(x_in) ? out : at::empty_like(x);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const int V = vector_width<T>(nhwc ? s.C : s.HxW, {xp, yp});
    Tensor partial;
    auto run = [&](auto vtag) {
      constexpr int kV = decltype(vtag)::value;
      const gn::PartialLayout L = launch_reduce<T, kV, gn::MomentsReducer>(nhwc, s, xp, nullptr, nullptr, partial);
      const auto wdtype = defined(w) ? w->scalar_type() : defined(b) ? b->scalar_type() : at::kFloat;
      dispatch_param<T>(wdtype, [&](auto wtag) {
        using W = decltype(wtag);
        gn::finalize_forward_kernel<W><<<s.N * s.G, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
            reinterpret_cast<const WelfordState*>(partial.data_ptr<float>()), L, ptr_or_null<W>(w), ptr_or_null<W>(b),
            mean.data_ptr<float>(), rstd.data_ptr<float>(), reinterpret_cast<float4*>(coef.data_ptr<float>()), s.C,
            s.G, static_cast<float>(eps));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      launch_affine<T, kV, false>(nhwc, s, xp, nullptr, yp, reinterpret_cast<const float4*>(coef.data_ptr<float>()));
    };
    if (V == 1) {
      run(std::integral_constant<int, 1>{});
    } else {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    }
    if (!y.is_same(out)) out.copy_(y);
  });
  return {out, mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cuda(const Tensor& grad_out, const Tensor& input,
                                                                     const Tensor& mean, const Tensor& rstd,
                                                                     const OptTensor& weight, int64_t num_groups,
                                                                     std::array<bool, 3> output_mask) {
  const char* op = "gnext.group_norm_backward";
  const GNShape s = check_group_norm_args(op, input, num_groups, weight, std::nullopt);
  check_group_norm_backward_args(op, grad_out, input, mean, rstd, s);
  c10::cuda::CUDAGuard guard(input.device());
  const auto pdtype = param_grad_dtype(input, weight);
  const bool need_params = output_mask[1] || output_mask[2];
  OptTensor dx, dgamma, dbeta;
  if (output_mask[1]) dgamma = at::empty({s.C}, input.options().dtype(pdtype));
  if (output_mask[2]) dbeta = at::empty({s.C}, input.options().dtype(pdtype));
  const Tensor x_in = dense_input(input);
  if (output_mask[0]) dx = at::empty_like(x_in);
  if (input.numel() == 0) {
    if (dgamma) dgamma->zero_();
    if (dbeta) dbeta->zero_();
    return {dx, dgamma, dbeta};
  }
  if (!output_mask[0] && !need_params) return {dx, dgamma, dbeta};
  const Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const OptTensor w = defined(weight) ? OptTensor(weight->contiguous()) : std::nullopt;
  GNEXT_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, [&] {
    using T = scalar_t;
    const Tensor dy_in = grad_out.contiguous(group_norm_memory_format(x_in));
    const bool nhwc = use_nhwc<float2, T>(x_in, s, {x_in.data_ptr(), dy_in.data_ptr(), dx ? dx->data_ptr() : nullptr});
    const Tensor x = nhwc || x_in.is_contiguous() ? x_in : x_in.contiguous();
    const Tensor dy = x.is_same(x_in) ? dy_in : grad_out.contiguous();
    Tensor dx_work = !dx || x.is_same(x_in) ? (dx ? *dx : Tensor()) : at::empty_like(x);
    const T* xp = x.data_ptr<T>();
    const T* dyp = dy.data_ptr<T>();
    T* dxp = dx_work.defined() ? dx_work.data_ptr<T>() : nullptr;
    const int V = vector_width<T>(nhwc ? s.C : s.HxW, {xp, dyp, dxp});
    Tensor partial;
    Tensor dsum = need_params ? at::empty({s.N, s.C, 2}, mean_c.options()) : Tensor();
    Tensor coef = output_mask[0] ? at::empty({s.N, s.C, 4}, mean_c.options()) : Tensor();
    auto stream = at::cuda::getCurrentCUDAStream();
    auto run = [&](auto vtag) {
      constexpr int kV = decltype(vtag)::value;
      const gn::PartialLayout L =
          launch_reduce<T, kV, gn::GradReducer>(nhwc, s, xp, dyp, mean_c.data_ptr<float>(), partial);
      dispatch_param<T>(defined(w) ? w->scalar_type() : at::kFloat, [&](auto wtag) {
        using W = decltype(wtag);
        gn::finalize_backward_kernel<W><<<s.N * s.G, 256, 0, stream>>>(
            reinterpret_cast<const float2*>(partial.data_ptr<float>()), L, mean_c.data_ptr<float>(),
            rstd_c.data_ptr<float>(), ptr_or_null<W>(w),
            need_params ? reinterpret_cast<float2*>(dsum.data_ptr<float>()) : nullptr,
            output_mask[0] ? reinterpret_cast<float4*>(coef.data_ptr<float>()) : nullptr, s.C, s.G, s.HxW);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      if (need_params) {
        dispatch_param<T>(pdtype, [&](auto ptag) {
          using P = decltype(ptag);
          gn::gamma_beta_backward_kernel<P><<<ceil_div(s.C, 256), 256, 0, stream>>>(
              reinterpret_cast<const float2*>(dsum.data_ptr<float>()), rstd_c.data_ptr<float>(),
              dgamma ? dgamma->data_ptr<P>() : nullptr, dbeta ? dbeta->data_ptr<P>() : nullptr, s.N, s.C, s.G);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
      if (output_mask[0])
        launch_affine<T, kV, true>(nhwc, s, xp, dyp, dxp, reinterpret_cast<const float4*>(coef.data_ptr<float>()));
    };
    if (V == 1) {
      run(std::integral_constant<int, 1>{});
    } else {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    }
    if (dx && !dx_work.is_same(*dx)) dx->copy_(dx_work);
  });
  return {dx, dgamma, dbeta};
}

TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("group_norm", &group_norm_cuda);
  m.impl("group_norm_backward", &group_norm_backward_cuda);
}

}  // namespace gnext
