// SPDX-License-Identifier: BSD-3-Clause
// PyTorch's own GroupNorm on gnext's kernels: CUDA kernels for aten::native_group_norm and
// aten::native_group_norm_backward, registered on demand (groupnorm_ext.enable_aten_kernels) and removed
// again (disable_aten_kernels). Everything above those two kernels stays PyTorch's: F.group_norm and
// nn.GroupNorm (also timm's and diffusers' subclasses), their checks, and the C++ autograd node
// NativeGroupNormBackward0, so a model needs no edits and its backward runs no Python. The schemas are
// ATen's (N, C, HxW as arguments; mean/rstd (N, G) in ATen's dtype: float32 for a float16/bfloat16 input
// with float32 weight or bias, else the input's), the math is gnext's (Wu & He 2018, float32 statistics).
// Only the CUDA dispatch key is taken: CPU tensors, torch.compile (Inductor decomposes the op) and
// other devices keep their kernels.
#include <memory>
#include <mutex>

#include "../common/cuda_utils.h"
#include "group_norm.h"
#include "group_norm_aten.h"
#include "group_norm_launch.h"

namespace gnext {
namespace {

constexpr const char* kFwd = "aten::native_group_norm (gnext)";
constexpr const char* kBwd = "aten::native_group_norm_backward (gnext)";

// ATen's dtype of mean/rstd (param_scalar_type of aten/src/ATen/native/group_norm.cpp).
ScalarType aten_stats_dtype(const Tensor& x, const OptTensor& w, const OptTensor& b) {
  if (x.scalar_type() == ScalarType::Float) return ScalarType::Float;
  const bool mixed = (defined(w) && w->scalar_type() == ScalarType::Float) ||
                     (defined(b) && b->scalar_type() == ScalarType::Float);
  return mixed ? ScalarType::Float : x.scalar_type();
}

// mean and rstd (n*g elements each) as (n, g) tensors of `dtype`: themselves when they have it, else converted
// in one launch on their device.
std::pair<Tensor, Tensor> cast_stats(const Tensor& mean, const Tensor& rstd, ScalarType dtype, int64_t n, int64_t g) {
  if (mean.scalar_type() == dtype && rstd.scalar_type() == dtype) return {mean, rstd};
  GNEXT_CHECK(mean.scalar_type() == rstd.scalar_type(), kBwd, ": mean (", mean.scalar_type(), ") and rstd (",
              rstd.scalar_type(), ") must have the same dtype");
  DeviceGuard guard(mean);
  const Tensor m = contig(mean), r = contig(rstd);
  Tensor mo = empty_on(m, {n, g}, dtype), ro = empty_on(m, {n, g}, dtype);
  GNEXT_CUDA_CHECK(gn::launch_cast_stats(scalar_kind(m.scalar_type()), scalar_kind(dtype), m.data_ptr(), r.data_ptr(),
                                         mo.data_ptr(), ro.data_ptr(), n * g, current_stream(m)));
  return {mo, ro};
}

// The input as (N, C, *) with ATen's N and C: itself when its first dims are N and C (F.group_norm's
// calls), else a reshape to (N, C, HxW) (direct calls with a flattened input).
Tensor as_nc(const char* op, const Tensor& input, int64_t N, int64_t C, int64_t HxW) {
  GNEXT_CHECK(input.numel() == N * C * HxW, op, ": input of shape ", shape(input), " has ", input.numel(),
              " elements, expected N*C*HxW = ", N, "*", C, "*", HxW);
  if (input.dim() >= 2 && input.size(0) == N && input.size(1) == C) return input;
  return torch::stable::reshape(input, {N, C, HxW});
}

// float64, which gnext's kernels do not take (ATen's CUDA kernel, which they replace, does): the same formula
// through ATen ops (torch.autograd.gradcheck and other float64 users keep working while enabled).
namespace f64 {
using torch::stable::detail::to;
Tensor mul(const Tensor& a, const Tensor& b) { return to<Tensor>(call_op<2>("aten::mul", "Tensor", a, b)[0]); }
Tensor add(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b, -1.0); }
Tensor sub(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b); }
Tensor mean(const Tensor& t, std::vector<int64_t> dims) {  // keepdim
  return to<Tensor>(call_op<4>("aten::mean", "dim", t, std::optional<IntArrayRef>(IntArrayRef(dims)), true,
                               std::optional<ScalarType>())[0]);
}
Tensor sum(const Tensor& t, std::vector<int64_t> dims) { return torch::stable::sum(t, IntArrayRef(dims), false); }
// (C,) as (1, C, 1, ...) of `dim` dims.
Tensor per_channel(const Tensor& p, int64_t dim) {
  std::vector<int64_t> s(static_cast<size_t>(dim), 1);
  s[1] = p.numel();
  return torch::stable::reshape(p, IntArrayRef(s));
}

void check(const char* op, const Tensor& x, const OptTensor& w, const OptTensor& b, int64_t C, int64_t group) {
  GNEXT_CHECK(group > 0 && C % group == 0, op, ": num_channels C=", C, " must be divisible by num_groups=", group);
  for (const OptTensor* p : {&w, &b})
    if (defined(*p))
      GNEXT_CHECK((*p)->numel() == C && (*p)->scalar_type() == ScalarType::Double && same_device(**p, x), op,
                  ": weight and bias must be float64 (C,) = (", C, ") tensors on the input's device, got shape ",
                  shape(**p), " ", (*p)->scalar_type());
}

std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& x, const OptTensor& w, const OptTensor& b, int64_t N,
                                           int64_t C, int64_t HxW, int64_t G, double eps) {
  check(kFwd, x, w, b, C, G);
  const Tensor xg = torch::stable::reshape(x, {N, G, C / G * HxW});
  const Tensor mu = mean(xg, {2});
  const Tensor xc = sub(xg, mu);
  const Tensor eps_t = torch::stable::full({1}, eps, ScalarType::Double, std::nullopt, x.device());
  const Tensor rstd = to<Tensor>(call_op<1>("aten::rsqrt", "", add(mean(mul(xc, xc), {2}), eps_t))[0]);
  Tensor y = torch::stable::reshape(mul(xc, rstd), x.sizes());
  if (defined(w)) y = mul(y, per_channel(*w, x.dim()));
  if (defined(b)) y = add(y, per_channel(*b, x.dim()));
  return {y, torch::stable::reshape(mu, {N, G}), torch::stable::reshape(rstd, {N, G})};
}

// dx = rstd * (dy' - mean_g(dy') - xhat * mean_g(dy' * xhat)), dy' = dy * gamma;
// dgamma = sum_{n, s} dy * xhat; dbeta = sum_{n, s} dy.
std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dy, const Tensor& x, const Tensor& mean_in,
                                            const Tensor& rstd_in, const OptTensor& w, int64_t N, int64_t C,
                                            int64_t HxW, int64_t G, const std::vector<bool>& mask) {
  check(kBwd, x, w, std::nullopt, C, G);
  const int64_t M = C / G * HxW;
  const Tensor mu = torch::stable::reshape(mean_in, {N, G, 1}), rstd = torch::stable::reshape(rstd_in, {N, G, 1});
  const Tensor xhat = mul(sub(torch::stable::reshape(x, {N, G, M}), mu), rstd);
  Tensor dx, dw, db;
  if (mask[0]) {
    const Tensor dyw = torch::stable::reshape(defined(w) ? mul(dy, per_channel(*w, x.dim())) : dy, {N, G, M});
    const Tensor t = sub(sub(dyw, mean(dyw, {2})), mul(xhat, mean(mul(dyw, xhat), {2})));
    dx = torch::stable::reshape(mul(t, rstd), x.sizes());
  }
  const Tensor dy3 = torch::stable::reshape(dy, {N, C, HxW});
  if (mask[1]) dw = sum(mul(dy3, torch::stable::reshape(xhat, {N, C, HxW})), {0, 2});
  if (mask[2]) db = sum(dy3, {0, 2});
  return {dx, dw, db};
}
}  // namespace f64

std::tuple<Tensor, Tensor, Tensor> native_group_norm_cuda(const Tensor& input, const OptTensor& weight,
                                                          const OptTensor& bias, int64_t N, int64_t C, int64_t HxW,
                                                          int64_t group, double eps) {
  const Tensor x = as_nc(kFwd, input, N, C, HxW);
  if (input.scalar_type() == ScalarType::Double) return f64::forward(input, weight, bias, N, C, HxW, group, eps);
  auto [y, mean, rstd] = group_norm_cuda_pre(kFwd, x, group, weight, bias, eps, Pointwise{});
  if (x.dim() != input.dim()) y = torch::stable::reshape(y, input.sizes());
  auto [m, r] = cast_stats(mean, rstd, aten_stats_dtype(input, weight, bias), N, group);
  return {y, m, r};
}

std::tuple<Tensor, Tensor, Tensor> native_group_norm_backward_cuda(const Tensor& grad_out, const Tensor& input,
                                                                   const Tensor& mean, const Tensor& rstd,
                                                                   const OptTensor& weight, int64_t N, int64_t C,
                                                                   int64_t HxW, int64_t group,
                                                                   std::vector<bool> output_mask) {
  const Tensor x = as_nc(kBwd, input, N, C, HxW);
  if (input.scalar_type() == ScalarType::Double)
    return f64::backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask);
  const Tensor dy = x.dim() == input.dim() ? grad_out : torch::stable::reshape(grad_out, x.sizes());
  GNEXT_CHECK(mean.numel() == N * group && rstd.numel() == N * group, kBwd, ": mean and rstd must have N*G = ",
              N * group, " elements, got shapes ", shape(mean), " and ", shape(rstd));
  const auto [m, r] = cast_stats(mean, rstd, ScalarType::Float, N, group);
  auto [dx, dw, db] = group_norm_backward_cuda_pre(kBwd, dy, x, m, r, weight, group,
                                                   mask_array<3>(kBwd, output_mask), Pointwise{});
  // ATen's schema returns Tensors: undefined where output_mask is false.
  Tensor dxt = dx ? *dx : Tensor(), dwt = dw ? *dw : Tensor(), dbt = db ? *db : Tensor();
  if (dx && x.dim() != input.dim()) dxt = torch::stable::reshape(dxt, input.sizes());
  return {dxt, dwt, dbt};
}

std::mutex registration_mutex;
std::unique_ptr<torch::stable::detail::StableLibrary> registration;  // set while enabled

}  // namespace

bool set_aten_kernels(bool enable) {
  std::lock_guard<std::mutex> lock(registration_mutex);
  const bool was = registration != nullptr;
  if (enable && !was) {
    auto lib = std::make_unique<torch::stable::detail::StableLibrary>(
        torch::stable::detail::StableLibrary::Kind::IMPL, "aten", "CUDA", __FILE__, __LINE__);
    lib->impl("native_group_norm", TORCH_BOX(&native_group_norm_cuda));
    lib->impl("native_group_norm_backward", TORCH_BOX(&native_group_norm_backward_cuda));
    registration = std::move(lib);
  } else if (!enable && was) {
    registration.reset();  // deregisters both: ATen's CUDA kernels are current again
  }
  return was;
}

bool aten_kernels_enabled() {
  std::lock_guard<std::mutex> lock(registration_mutex);
  return registration != nullptr;
}

}  // namespace gnext
