// Argument checks and layout rules shared by the CPU and CUDA GroupNorm implementations.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <array>
#include <tuple>

namespace gnext {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Sizes of a GroupNorm problem: input (N, C, *spatial), HxW = prod(spatial), D = C / G.
struct GNShape {
  int64_t N, C, G, D, HxW;
};

inline bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checks input/num_groups/weight/bias and returns the problem sizes. `op` names the caller in messages.
inline GNShape check_group_norm_args(const char* op, const Tensor& input, int64_t num_groups,
                                     const OptTensor& weight, const OptTensor& bias) {
  TORCH_CHECK(input.dim() >= 2, op, ": input must have shape (N, C, *) with at least 2 dims, got input.dim()=",
              input.dim(), " (shape ", input.sizes(), ")");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  TORCH_CHECK(num_groups > 0, op, ": num_groups must be positive, got num_groups=", num_groups);
  const int64_t N = input.size(0), C = input.size(1);
  TORCH_CHECK(C % num_groups == 0, op, ": num_channels C=", C, " must be divisible by num_groups=",
              num_groups, " (input shape ", input.sizes(), ")");
  const std::pair<const OptTensor*, const char*> params[] = {{&weight, "weight"}, {&bias, "bias"}};
  for (const auto& [p, name] : params) {
    if (!defined(*p)) continue;
    const Tensor& t = **p;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must have shape (C,) = (", C, "), got ",
                name, ".shape=", t.sizes());
    TORCH_CHECK(t.device() == input.device(), op, ": ", name, " is on ", t.device(),
                " but input is on ", input.device());
    TORCH_CHECK(t.scalar_type() == input.scalar_type() || t.scalar_type() == at::kFloat, op, ": ", name,
                " dtype must match input (", input.scalar_type(), ") or be float32, got ", t.scalar_type());
  }
  if (defined(weight) && defined(bias)) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), op, ": weight (", weight->scalar_type(),
                ") and bias (", bias->scalar_type(), ") must have the same dtype");
  }
  int64_t HxW = 1;
  for (int64_t d = 2; d < input.dim(); ++d) HxW *= input.size(d);
  return {N, C, num_groups, C / num_groups, HxW};
}

// Checks the extra arguments of the backward op.
inline void check_group_norm_backward_args(const char* op, const Tensor& grad_out, const Tensor& input,
                                           const Tensor& mean, const Tensor& rstd, const GNShape& s) {
  TORCH_CHECK(grad_out.sizes() == input.sizes(), op, ": grad_out.shape=", grad_out.sizes(),
              " must equal input.shape=", input.sizes());
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(), op, ": grad_out dtype (", grad_out.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  TORCH_CHECK(grad_out.device() == input.device(), op, ": grad_out is on ", grad_out.device(),
              " but input is on ", input.device());
  const std::pair<const Tensor*, const char*> stats[] = {{&mean, "mean"}, {&rstd, "rstd"}};
  for (const auto& [t, name] : stats) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t->scalar_type());
    TORCH_CHECK(t->numel() == s.N * s.G, op, ": ", name, " must have N*G=", s.N * s.G, " elements, got shape ",
                t->sizes());
    TORCH_CHECK(t->device() == input.device(), op, ": ", name, " is on ", t->device(), " but input is on ",
                input.device());
  }
}

// Memory layout a kernel works on. The output keeps the input's memory format:
// NCHW-contiguous in -> contiguous out; channels_last(_3d) in -> channels_last(_3d) out;
// any other strides are first made contiguous. (The fake kernel in _ops.py follows the same rule.)
inline at::MemoryFormat group_norm_memory_format(const Tensor& input) {
  if (input.is_contiguous()) return at::MemoryFormat::Contiguous;
  if (input.dim() == 4 && input.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (input.dim() == 5 && input.is_contiguous(at::MemoryFormat::ChannelsLast3d))
    return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

// Returns `input` with dense strides in group_norm_memory_format(input) (a copy only for other strides).
inline Tensor dense_input(const Tensor& input) {
  const auto fmt = group_norm_memory_format(input);
  return fmt == at::MemoryFormat::Contiguous ? input.contiguous() : input;
}

// Dtype of grad_weight / grad_bias: the weight's, else the input's.
inline at::ScalarType param_grad_dtype(const Tensor& input, const OptTensor& weight) {
  return defined(weight) ? weight->scalar_type() : input.scalar_type();
}

std::tuple<Tensor, Tensor, Tensor> group_norm_cpu(const Tensor& input, int64_t num_groups, const OptTensor& weight,
                                                  const OptTensor& bias, double eps);
std::tuple<OptTensor, OptTensor, OptTensor> group_norm_backward_cpu(const Tensor& grad_out, const Tensor& input,
                                                                    const Tensor& mean, const Tensor& rstd,
                                                                    const OptTensor& weight, int64_t num_groups,
                                                                    std::array<bool, 3> output_mask);

}  // namespace gnext
