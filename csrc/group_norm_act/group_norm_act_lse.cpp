// SPDX-License-Identifier: BSD-3-Clause
// group_norm_act_logsumexp: argument checks (CUDA: group_norm_act_lse_cuda.cpp; the CPU kernels in
// groupnorm_ext/_cpu.py raise the same messages).
#include <vector>

#include "group_norm_act.h"

namespace gnext {

Problem check_lse_args(const char* op, const Tensor& input, const OptTensor& input_bias, int64_t num_groups,
                       const OptTensor& weight, const OptTensor& bias) {
  const Problem s = check_group_norm_args(op, input, num_groups, weight, bias);
  check_input_bias(op, input, input_bias);
  return s;
}

std::vector<int64_t> lse_out_shape(const Tensor& input) {
  const IntArrayRef sz = input.sizes();
  std::vector<int64_t> out(sz.begin(), sz.end());
  out[1] = 1;
  return out;
}

void check_lse_backward_args(const char* op, const Problem& s, const Tensor& input, const Tensor& grad_out,
                             const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const auto want = lse_out_shape(input);
  const std::pair<const Tensor*, const char*> outs[] = {{&grad_out, "grad_out"}, {&out, "out"}};
  for (const auto& [t, name] : outs) {
    GNEXT_CHECK(same_shape(t->sizes(), want), op, ": ", name, ".shape=", shape(*t), " must be (N, 1, *) = ",
                Shape{want});
    GNEXT_CHECK(t->scalar_type() == input.scalar_type(), op, ": ", name, " dtype (", t->scalar_type(),
                ") must equal input dtype (", input.scalar_type(), ")");
    GNEXT_CHECK(same_device(*t, input), op, ": ", name, " is on ", device_name(*t), " but input is on ",
                device_name(input));
  }
  const std::pair<const Tensor*, const char*> stats[] = {{&mean, "mean"}, {&rstd, "rstd"}};
  for (const auto& [t, name] : stats) {
    GNEXT_CHECK(t->scalar_type() == ScalarType::Float && t->numel() == s.N * s.G, op, ": ", name,
                " must be float32 with N*G=", s.N * s.G, " elements, got ", t->scalar_type(), " of shape ",
                shape(*t));
    GNEXT_CHECK(same_device(*t, input), op, ": ", name, " is on ", device_name(*t), " but input is on ",
                device_name(input));
  }
}

}  // namespace gnext
