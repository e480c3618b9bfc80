// SPDX-License-Identifier: BSD-3-Clause
// CUDA registration of group_norm_act: gnext's GroupNorm kernels with the activation (+ residual)
// as their compile-time epilogue (csrc/group_norm, common/pointwise.h).
#include <string>

#include "../common/cuda_utils.h"
#include "group_norm_act.h"

namespace gnext {
namespace {

// The forward epilogue: act(.) + residual.
Pointwise forward_pointwise(const char* op, const std::string& activation, const OptTensor& residual) {
  Pointwise pw;
  pw.act = parse_activation(op, activation);
  pw.residual = residual;
  return pw;
}

// The backward's act' at the GroupNorm's output, which it recomputes: that needs the GroupNorm's bias.
Pointwise backward_pointwise(const char* op, const std::string& activation, const OptTensor& bias) {
  Pointwise pw;
  pw.act = parse_activation(op, activation);
  pw.gn_bias = bias;
  return pw;
}

std::tuple<Tensor, Tensor, Tensor> group_norm_act_cuda(const Tensor& input, int64_t num_groups,
                                                       const OptTensor& weight, const OptTensor& bias, double eps,
                                                       const std::string& activation, const OptTensor& residual,
                                                       const OptTensor& input_bias) {
  constexpr const char* op = "gnext.group_norm_act";
  Pointwise pw = forward_pointwise(op, activation, residual);
  pw.input_bias = input_bias;
  return group_norm_cuda_pre(op, input, num_groups, weight, bias, eps, pw);
}

std::tuple<Tensor, Tensor, Tensor> group_norm_act_pad_cuda(const Tensor& input, int64_t num_groups,
                                                           const OptTensor& weight, const OptTensor& bias, double eps,
                                                           const std::string& activation,
                                                           const std::vector<int64_t>& pad, const std::string& mode,
                                                           double value, const OptTensor& input_bias) {
  constexpr const char* op = "gnext.group_norm_act_pad";
  GNEXT_CHECK(mode == "replicate" || mode == "constant", op, ": mode must be 'replicate' or 'constant', got mode='",
              mode, "'");
  return group_norm_pad_cuda_pre(op, input, num_groups, weight, bias, eps, forward_pointwise(op, activation, {}), pad,
                                 mode == "replicate", value, input_bias);
}

std::tuple<Tensor, Tensor, Tensor> group_norm_act_modulate_cuda(const Tensor& input, int64_t num_groups,
                                                                const OptTensor& weight, const OptTensor& bias,
                                                                double eps, const Tensor& scale, const Tensor& shift,
                                                                const std::string& activation,
                                                                const OptTensor& input_bias) {
  constexpr const char* op = "gnext.group_norm_act_modulate";
  return group_norm_modulate_cuda_pre(op, input, num_groups, weight, bias, eps, scale, shift,
                                      forward_pointwise(op, activation, {}), nullptr, input_bias);
}

std::tuple<Tensor, Tensor> group_norm_act_modulate_into_cuda(const Tensor& input, int64_t num_groups,
                                                             const OptTensor& weight, const OptTensor& bias,
                                                             double eps, const Tensor& scale, const Tensor& shift,
                                                             const std::string& activation, const Tensor& out,
                                                             const OptTensor& input_bias) {
  constexpr const char* op = "gnext.group_norm_act_modulate_into";
  auto r = group_norm_modulate_cuda_pre(op, input, num_groups, weight, bias, eps, scale, shift,
                                        forward_pointwise(op, activation, {}), &out, input_bias);
  return {std::get<1>(r), std::get<2>(r)};
}

// out's `frames` front frames: the cache, or copies of frame `frames` (the first output frame). Each (n, c) row of
// out is (frames + T) * HW elements, so the front is a strided 2-D block, one cudaMemcpy2DAsync (a frame at a time
// for the copies) rather than an element-wise strided copy_ (docs/decisions/compile-fusion.md).
void copy_front_frames(Tensor& out, int64_t frames, int64_t T, const OptTensor& cache) {
  const int64_t rows = out.size(0) * out.size(1), plane = out.size(3) * out.size(4) * out.element_size();
  const size_t pitch = static_cast<size_t>((frames + T) * plane);
  char* dst = static_cast<char*>(out.data_ptr());
  const cudaStream_t stream = current_stream(out);
  if (defined(cache)) {
    const Tensor c = contig(*cache);
    GNEXT_CUDA_CHECK(cudaMemcpy2DAsync(dst, pitch, c.data_ptr(), static_cast<size_t>(frames * plane),
                                       static_cast<size_t>(frames * plane), static_cast<size_t>(rows),
                                       cudaMemcpyDeviceToDevice, stream));
    return;
  }
  for (int64_t f = 0; f < frames; ++f)
    GNEXT_CUDA_CHECK(cudaMemcpy2DAsync(dst + f * plane, pitch, dst + frames * plane, pitch, static_cast<size_t>(plane),
                                       static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream));
}

// The modulated norm writes its T frames straight into the buffer after the `frames` front ones, which are copied in
// after it (the cache, or the first output frame broadcast): no full-size output to concatenate.
std::tuple<Tensor, Tensor, Tensor> group_norm_act_modulate_cat_cuda(const Tensor& input, int64_t num_groups,
                                                                    const OptTensor& weight, const OptTensor& bias,
                                                                    double eps, const Tensor& scale,
                                                                    const Tensor& shift, const std::string& activation,
                                                                    int64_t frames, const OptTensor& cache,
                                                                    const OptTensor& input_bias) {
  constexpr const char* op = "gnext.group_norm_act_modulate_cat";
  GNEXT_CHECK(input.dim() == 5, op, ": input must be 5-D (N, C, T, H, W), got input.shape=", shape(input));
  GNEXT_CHECK(frames >= 0, op, ": frames must be >= 0, got frames=", frames);
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
  const int64_t T = sizes[2];
  if (defined(cache)) {
    sizes[2] = frames;
    GNEXT_CHECK(same_shape(cache->sizes(), sizes), op, ": cache.shape=", shape(*cache), " must be (N, C, frames, H, W)"
                " = ", Shape{sizes});
    check_dtype_device_like_input(op, "cache", *cache, input);
  } else {
    GNEXT_CHECK(frames == 0 || T > 0, op, ": without a cache, frames=", frames, " copies of the first frame need "
                "input frames, got input.shape=", shape(input));
  }
  sizes[2] = frames + T;
  Tensor out = empty_on(input, sizes, input.scalar_type());
  Tensor body = torch::stable::narrow(out, 2, frames, T);
  auto r = group_norm_modulate_cuda_pre(op, input, num_groups, weight, bias, eps, scale, shift,
                                        forward_pointwise(op, activation, {}), &body, input_bias);
  if (frames > 0 && out.numel() > 0) copy_front_frames(out, frames, T, cache);
  return {out, std::get<1>(r), std::get<2>(r)};
}

std::tuple<OptTensor, OptTensor, OptTensor> group_norm_act_backward_cuda(
    const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& rstd, const OptTensor& weight,
    const OptTensor& bias, int64_t num_groups, const std::string& activation, const std::vector<bool>& output_mask) {
  constexpr const char* op = "gnext.group_norm_act_backward";
  return group_norm_backward_cuda_pre(op, grad_out, input, mean, rstd, weight, num_groups,
                                      mask_array<3>(op, output_mask), backward_pointwise(op, activation, bias));
}

Tensor group_norm_act_apply_cuda(const Tensor& input, const Tensor& mean, const Tensor& rstd, int64_t num_groups,
                                 const OptTensor& weight, const OptTensor& bias, const std::string& activation,
                                 const OptTensor& residual) {
  constexpr const char* op = "gnext.group_norm_act_apply";
  return group_norm_apply_cuda_pre(op, input, mean, rstd, num_groups, weight, bias,
                                   forward_pointwise(op, activation, residual));
}

Tensor group_norm_act_apply_backward_sums_cuda(const Tensor& grad_out, const Tensor& input, const Tensor& mean,
                                               const Tensor& rstd, const OptTensor& weight, const OptTensor& bias,
                                               int64_t num_groups, const std::string& activation) {
  constexpr const char* op = "gnext.group_norm_act_apply_backward_sums";
  return group_norm_backward_sums_cuda_pre(op, grad_out, input, mean, rstd, weight, num_groups,
                                           backward_pointwise(op, activation, bias));
}

Tensor group_norm_act_apply_backward_cuda(const Tensor& grad_out, const Tensor& input, const Tensor& mean,
                                          const Tensor& rstd, const OptTensor& weight, const OptTensor& bias,
                                          const Tensor& group_sums, int64_t num_groups,
                                          const std::string& activation) {
  constexpr const char* op = "gnext.group_norm_act_apply_backward";
  return group_norm_backward_apply_cuda_pre(op, grad_out, input, mean, rstd, weight, group_sums, num_groups,
                                            backward_pointwise(op, activation, bias));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  // Each with its twin of no Autograd kernel (csrc/gnext.cpp).
  for (const char* suffix : {"", "_no_autograd"}) {
    const std::string s = suffix;
    m.impl(("group_norm_act" + s).c_str(), TORCH_BOX(&group_norm_act_cuda));
    m.impl(("group_norm_act_backward" + s).c_str(), TORCH_BOX(&group_norm_act_backward_cuda));
    m.impl(("group_norm_act_pad" + s).c_str(), TORCH_BOX(&group_norm_act_pad_cuda));
    m.impl(("group_norm_act_modulate" + s).c_str(), TORCH_BOX(&group_norm_act_modulate_cuda));
    m.impl(("group_norm_act_modulate_cat" + s).c_str(), TORCH_BOX(&group_norm_act_modulate_cat_cuda));
  }
  m.impl("group_norm_act_modulate_into", TORCH_BOX(&group_norm_act_modulate_into_cuda));
  m.impl("group_norm_act_apply", TORCH_BOX(&group_norm_act_apply_cuda));
  m.impl("group_norm_act_apply_backward_sums", TORCH_BOX(&group_norm_act_apply_backward_sums_cuda));
  m.impl("group_norm_act_apply_backward", TORCH_BOX(&group_norm_act_apply_backward_cuda));
}

}  // namespace gnext
