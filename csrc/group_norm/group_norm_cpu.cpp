// GroupNorm on the CPU, composed of ATen ops with float32 accumulation. It is the
// reference-quality fallback (correct first); the fast path is the CUDA one.
#include <torch/library.h>

#include "group_norm.h"

namespace gnext {
namespace {

// (N, C, *) -> (N, G, D, HxW) float32 view in NCHW order (copies channels_last input).
Tensor grouped_float(const Tensor& t, const GNShape& s) {
  return t.to(at::kFloat).contiguous().view({s.N, s.G, s.D, s.HxW});
}

Tensor param_grouped(const OptTensor& p, const GNShape& s) {
  return p->to(at::kFloat).view({1, s.G, s.D, 1});
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> group_norm_cpu(const Tensor& input, int64_t num_groups, const OptTensor& weight,
                                                  const OptTensor& bias, double eps) {
  const GNShape s = check_group_norm_args("gnext.group_norm", input, num_groups, weight, bias);
  const auto fmt = group_norm_memory_format(input);
  Tensor out = at::empty(input.sizes(), input.options().memory_format(fmt));
  Tensor mean = at::empty({s.N, s.G}, input.options().dtype(at::kFloat));
  Tensor rstd = at::empty_like(mean);
  if (input.numel() == 0) {
    fill_empty_stats(mean, rstd);
    return {out, mean, rstd};
  }
  const Tensor x = grouped_float(input, s);
  auto [var, mu] = at::var_mean(x, {2, 3}, /*correction=*/0, /*keepdim=*/true);
  const Tensor r = (var + eps).rsqrt();
  Tensor y = (x - mu) * r;
  if (defined(weight)) y = y * param_grouped(weight, s);
  if (defined(bias)) y = y + param_grouped(bias, s);
  out.copy_(y.view(input.sizes()));
  mean.copy_(mu.view({s.N, s.G}));
  rstd.copy_(r.view({s.N, s.G}));
  return {out, mean, rstd};
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cpu(const Tensor& grad_out, const Tensor& input,
                                                                    const Tensor& mean, const Tensor& rstd,
                                                                    const OptTensor& weight, int64_t num_groups,
                                                                    std::array<bool, 3> output_mask) {
  const GNShape s = check_group_norm_backward_args("gnext.group_norm_backward", grad_out, input, mean, rstd,
                                                   weight, num_groups);
  auto [dx, dgamma, dbeta] = alloc_backward_outputs(input, s, weight, output_mask);
  if (input.numel() == 0) return {dx, dgamma, dbeta};
  const Tensor x = grouped_float(input, s), dy = grouped_float(grad_out, s);
  const Tensor mu = mean.to(at::kFloat).reshape({s.N, s.G, 1, 1});
  const Tensor r = rstd.to(at::kFloat).reshape({s.N, s.G, 1, 1});
  const Tensor xc = x - mu;
  // Per (n, c): sum of dy * (x - mean) and of dy over HxW.
  const Tensor dsc = (dy * xc).sum(3, /*keepdim=*/true);  // (N, G, D, 1)
  const Tensor dbc = dy.sum(3, /*keepdim=*/true);
  if (dgamma) dgamma->copy_((dsc * r).sum(0).reshape({s.C}));
  if (dbeta) dbeta->copy_(dbc.sum(0).reshape({s.C}));
  if (output_mask[0]) {
    const Tensor gamma = defined(weight) ? param_grouped(weight, s) : at::ones({1, s.G, s.D, 1}, x.options());
    const double inv_count = 1.0 / static_cast<double>(s.D * s.HxW);
    const Tensor sum1 = (gamma * dsc).sum({2, 3}, /*keepdim=*/true);  // (N, G, 1, 1)
    const Tensor sum2 = (gamma * dbc).sum({2, 3}, /*keepdim=*/true);
    // dx = rstd*gamma*dy + c2*(x - mean) + c3, c2 = -rstd^3*sum1/(D*HxW), c3 = -rstd*sum2/(D*HxW).
    const Tensor c2 = -r.pow(3) * sum1 * inv_count;
    const Tensor c3 = -r * sum2 * inv_count;
    dx->copy_((r * gamma * dy + c2 * xc + c3).view(input.sizes()));
  }
  return {dx, dgamma, dbeta};
}

TORCH_LIBRARY_IMPL(gnext, CPU, m) {
  m.impl("group_norm", &group_norm_cpu);
  m.impl("group_norm_backward", &group_norm_backward_cpu);
}

}  // namespace gnext
