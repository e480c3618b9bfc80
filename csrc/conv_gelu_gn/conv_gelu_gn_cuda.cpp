// Fused ConvTranspose2d + GELU + GroupNorm (KernelBench L2#19), CUDA:
//   z = conv_transpose2d(input, weight)            (no bias)
//   a = GELU(z + conv_bias[c])                     (erf, or the tanh approximation)
//   out = GroupNorm(a; num_groups, gn_weight, gn_bias, eps)   (Wu & He 2018)
// Two forward paths, one contract (z, mean, rstd are saved; `a` is never written):
//  * default: the conv through ATen/cuDNN, then bias + GELU + GroupNorm in gnext's GroupNorm kernels
//    as an input prologue (statistics pass over z, then the elementwise pass).
//  * GNEXT_CONV=cutlass, on Hopper, float32 with TF32 allowed, stride 1 / dilation 1 / groups 1
//    (conv_sm90.h): gnext's own implicit-GEMM conv (CUTLASS) whose epilogue stores z and emits
//    per-tile sums of a and a^2; a finalize kernel turns them into mean/rstd; one elementwise pass.
//    Opt-in: on the H100 at L2#19 its conv + epilogue (3.9 ms) costs more than cuDNN's conv plus the
//    statistics pass it saves (2.9 + 0.9 ms).
// The backward runs the GroupNorm backward with the GELU backward fused (one kernel family writes dz),
// then the conv's data and weight gradients through ATen. An input that is not channels_last is
// transposed once: the forward returns that copy (input_cl) and autograd hands it to the backward as
// its `input`, whose weight gradient needs it in channels_last. The output has the input's layout: an
// input dense in channels_last gives a channels_last out, any other an NCHW-contiguous one, written by the
// elementwise pass itself (PwArgs::out_nchw: a shared-memory tile per CTA, no extra pass); an NCHW
// upstream gradient is read in place by the backward (PwArgs::dy_nchw). CPU kernels and autograd:
// groupnorm_ext/_cpu.py, _autograd.py.
#include <Python.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../common/cuda_utils.h"
#include "../group_norm/group_norm.h"
#include "conv_sm90.h"
#include "layout.h"

namespace gnext {
namespace {

using torch::stable::detail::to;

// The op computes in channels_last on CUDA, where cuDNN's channels_last transposed-conv kernels
// beat NCHW by more than the layout change costs (H100, L2#19: conv 2.87 vs 6.18 ms,
// docs/kernels.md); z and grad_input are channels_last, out has the input's layout (out_is_nchw).
constexpr MemoryFormat kFormat = MemoryFormat::ChannelsLast;

constexpr const char* kOp = "gnext.conv_transpose2d_gelu_group_norm";
constexpr const char* kBwdOp = "gnext.conv_transpose2d_gelu_group_norm_backward";

int prologue_kind(const char* op, const std::string& approximate) {
  GNEXT_CHECK(approximate == "none" || approximate == "tanh", op,
              ": approximate must be 'none' or 'tanh' (as in F.gelu), got '", approximate, "'");
  return approximate == "tanh" ? kPreBiasGeluTanh : kPreBiasGelu;
}

void check_conv_args(const char* op, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                     const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                     const std::vector<int64_t>& output_padding, const std::vector<int64_t>& dilation,
                     int64_t groups) {
  GNEXT_CHECK(input.dim() == 4, op, ": input must be (N, C_in, H, W), got input.dim()=", input.dim(), " (shape ",
              shape(input), ")");
  GNEXT_CHECK(is_supported_dtype(input.scalar_type()), op,
              ": input dtype must be float32, float16 or bfloat16, got ", input.scalar_type());
  GNEXT_CHECK(weight.dim() == 4, op, ": weight must be (C_in, C_out / groups, kH, kW), got shape ", shape(weight));
  GNEXT_CHECK(weight.scalar_type() == input.scalar_type(), op, ": weight dtype (", weight.scalar_type(),
              ") must equal input dtype (", input.scalar_type(), ")");
  GNEXT_CHECK(same_device(weight, input), op, ": weight is on ", device_name(weight), " but input is on ",
              device_name(input));
  GNEXT_CHECK(groups > 0 && input.size(1) % groups == 0 && weight.size(0) == input.size(1), op,
              ": weight.shape[0]=", weight.size(0), " must equal C_in=", input.size(1),
              " and C_in must be divisible by groups=", groups);
  const std::pair<const std::vector<int64_t>*, const char*> lists[] = {
      {&stride, "stride"}, {&padding, "padding"}, {&output_padding, "output_padding"}, {&dilation, "dilation"}};
  for (const auto& [l, name] : lists)
    GNEXT_CHECK(l->size() == 2, op, ": ", name, " must have 2 elements, got ", Shape{*l});
  const int64_t c_out = weight.size(1) * groups;
  if (defined(conv_bias)) {
    GNEXT_CHECK(conv_bias->dim() == 1 && conv_bias->size(0) == c_out, op, ": conv_bias must have shape (C_out,) = (",
                c_out, "), got ", shape(*conv_bias));
    GNEXT_CHECK(same_device(*conv_bias, input), op, ": conv_bias is on ", device_name(*conv_bias),
                " but input is on ", device_name(input));
    GNEXT_CHECK(conv_bias->scalar_type() == input.scalar_type(), op, ": conv_bias dtype (",
                conv_bias->scalar_type(), ") must equal input dtype (", input.scalar_type(), ")");
  }
}

Pointwise make_prologue(const char* op, const OptTensor& conv_bias, const std::string& approximate) {
  Pointwise pro;
  pro.kind = prologue_kind(op, approximate);
  if (defined(conv_bias)) pro.bias = contig(*conv_bias);
  return pro;
}

using IntList = std::vector<int64_t>;

// input dense in kFormat: NCHW-contiguous 4-D input through gnext's transpose kernel (faster than
// ATen's copy at L2#19's size), other strides through ATen.
Tensor input_in_kformat(const Tensor& input) {
  if (is_dense_in(input, kFormat)) return input;
  if (!input.is_contiguous() || input.dim() != 4 || input.numel() == 0 || input.size(0) > 65535)
    return dense_in(input, kFormat);
  Tensor out = empty_as(input, kFormat);
  GNEXT_CUDA_CHECK(layout::nchw_to_nhwc(input.data_ptr(), out.data_ptr(), input.size(0), input.size(1),
                                        input.size(2) * input.size(3), int(input.element_size()),
                                        current_stream(input)));
  return out;
}

// torch.backends.cudnn.allow_tf32, which PyTorch's convs follow and so does gnext's own conv. The
// stable ABI has no accessor: read it through the interpreter (torch._C._get_cudnn_allow_tf32);
// PyTorch's default (True) when there is no interpreter or no such function.
bool cudnn_allow_tf32() {
  if (!Py_IsInitialized()) return true;
  const PyGILState_STATE gil = PyGILState_Ensure();
  bool allow = true;
  if (PyObject* mod = PyImport_ImportModule("torch._C")) {
    if (PyObject* r = PyObject_CallMethod(mod, "_get_cudnn_allow_tf32", nullptr)) {
      allow = PyObject_IsTrue(r) == 1;
      Py_DECREF(r);
    }
    Py_DECREF(mod);
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(gil);
  return allow;
}

// Which forward runs: GNEXT_CONV=cutlass selects the Hopper conv (stage 2) where it applies; the
// default is the ATen/cuDNN conv (stage 1), which measured faster on the H100 at L2#19 (docs/kernels.md).
bool conv_backend_cutlass() {
  const char* v = std::getenv("GNEXT_CONV");
  return v != nullptr && std::strcmp(v, "cutlass") == 0;
}

// The Hopper conv's problem, or nullopt when the op must take the ATen path.
std::optional<conv_sm90::ConvProblem> sm90_problem(const Tensor& input, const Tensor& weight, const IntList& stride,
                                                   const IntList& padding, const IntList& output_padding,
                                                   const IntList& dilation, int64_t groups) {
  // The opt-in first: the default path reads one environment variable and nothing else here.
  if (!conv_backend_cutlass() || input.scalar_type() != ScalarType::Float || groups != 1) return std::nullopt;
  for (int i = 0; i < 2; ++i)
    if (stride[i] != 1 || dilation[i] != 1 || output_padding[i] != 0) return std::nullopt;
  const DeviceProps& prop = device_props();
  if (prop.major != 9 || prop.minor != 0 || !conv_sm90::available() || !cudnn_allow_tf32()) return std::nullopt;
  const int64_t R = weight.size(2), S = weight.size(3);
  if (padding[0] > R - 1 || padding[1] > S - 1) return std::nullopt;
  for (int64_t d = 0; d < 4; ++d)
    if (input.size(d) > INT32_MAX || weight.size(d) > INT32_MAX) return std::nullopt;
  conv_sm90::ConvProblem p{};
  p.N = int(input.size(0)), p.C = int(input.size(1)), p.H = int(input.size(2)), p.W = int(input.size(3));
  p.K = int(weight.size(1)), p.R = int(R), p.S = int(S);
  p.pad_h = int(R - 1 - padding[0]), p.pad_w = int(S - 1 - padding[1]);  // the equivalent forward conv
  p.P = int(input.size(2) + R - 1 - 2 * padding[0]), p.Q = int(input.size(3) + S - 1 - 2 * padding[1]);
  if (!conv_sm90::supports(p)) return std::nullopt;
  return p;
}

// The op's out is NCHW-contiguous unless the input is dense in kFormat (the rule of the fake kernel in
// groupnorm_ext/_ops.py, _fused_out_format).
bool out_is_nchw(const Tensor& input) { return !is_dense_in(input, kFormat); }

// The op's input_cl output: x (the input in kFormat) where the input was not dense in kFormat, else an
// empty (0,) tensor (the rule of the fake kernel in groupnorm_ext/_ops.py).
Tensor input_cl_output(const Tensor& input, const Tensor& x) {
  return is_dense_in(input, kFormat) ? empty_on(input, {0}, input.scalar_type()) : x;
}

using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;  // out, z, mean, rstd, input_cl

// Forward on the Hopper conv: returns (out, z, mean, rstd, input_cl) like the ATen path.
Outputs fused_sm90(const conv_sm90::ConvProblem& p, const Tensor& input,
                                                      const Tensor& weight, int64_t num_groups,
                                                      const OptTensor& gn_weight, const OptTensor& gn_bias,
                                                      double eps, const Pointwise& pro) {
  const Tensor z = empty_on(input, {int64_t(p.N), int64_t(p.K), int64_t(p.P), int64_t(p.Q)}, ScalarType::Float, kFormat);
  const GNShape s = check_group_norm_args(kOp, z, num_groups, gn_weight, gn_bias);
  const Tensor x_cl = input_in_kformat(input);
  Tensor x = x_cl;
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) {  // TMA needs 16-byte aligned rows
    Tensor aligned = empty_as(x, kFormat);
    copy_into(aligned, x);
    x = aligned;
  }
  const cudaStream_t stream = current_stream(input);
  Tensor filter = empty_on(input, {weight.size(1), weight.size(2), weight.size(3), weight.size(0)}, ScalarType::Float);
  GNEXT_CUDA_CHECK(conv_sm90::flip_filter(ptr<float>(contig(weight)), ptr<float>(filter), int(weight.size(0)),
                                          int(weight.size(1)), p.R, p.S, stream));
  const int64_t T = conv_sm90::num_tiles(p), ldp = conv_sm90::padded_channels(p);
  Tensor partial = empty_on(input, {2, T, ldp}, ScalarType::Float);
  float* psum = ptr<float>(partial);
  float* psq = psum + T * ldp;
  const float* bias = defined(pro.bias) ? ptr<float>(*pro.bias) : nullptr;  // float32, like input (checked)
  GNEXT_CUDA_CHECK(conv_sm90::conv_stats(p, ptr<float>(x), ptr<float>(filter), bias, pro.kind, ptr<float>(z), psum,
                                         psq, stream));
  Tensor mean = empty_on(input, {s.N, s.G}, ScalarType::Float);
  Tensor rstd = empty_on(input, {s.N, s.G}, ScalarType::Float);
  Tensor coef = empty_on(input, {s.N, s.C, 4}, ScalarType::Float);
  // gn_weight / gn_bias: float32 here (input's dtype or float32, checked above)
  const OptTensor gw = defined(gn_weight) ? OptTensor(contig(*gn_weight)) : std::nullopt;
  const OptTensor gb = defined(gn_bias) ? OptTensor(contig(*gn_bias)) : std::nullopt;
  GNEXT_CUDA_CHECK(conv_sm90::stats_finalize(p, int(num_groups), psum, psq, ptr<float>(z), bias, pro.kind,
                                             defined(gw) ? ptr<float>(*gw) : nullptr,
                                             defined(gb) ? ptr<float>(*gb) : nullptr, static_cast<float>(eps),
                                             ptr<float>(mean), ptr<float>(rstd), ptr<float>(coef), stream));
  Tensor out = group_norm_affine_cuda(z, s, coef, pro, out_is_nchw(input));
  return {out, z, mean, rstd, input_cl_output(input, x_cl)};
}

Outputs fused_cuda(const Tensor& input, const Tensor& weight,
                                                      const OptTensor& conv_bias, IntList stride, IntList padding,
                                                      IntList output_padding, IntList dilation, int64_t groups,
                                                      int64_t num_groups, const OptTensor& gn_weight,
                                                      const OptTensor& gn_bias, double eps, std::string approximate) {
  check_conv_args(kOp, input, weight, conv_bias, stride, padding, output_padding, dilation, groups);
  const Pointwise pro = make_prologue(kOp, conv_bias, approximate);
  DeviceGuard guard(input);
  if (input.numel() > 0) {
    if (const auto p = sm90_problem(input, weight, stride, padding, output_padding, dilation, groups))
      return fused_sm90(*p, input, weight, num_groups, gn_weight, gn_bias, eps, pro);  // conv bias: pro.bias
  }
  // The conv (cuDNN picks its algorithm; TF32 per torch.backends.cudnn.allow_tf32) in kFormat; z is
  // made dense in it so the fake kernel (groupnorm_ext/_ops.py) knows its strides.
  const OptTensor no_bias;
  const Tensor x_cl = input_in_kformat(input);
  auto st = call_op<8>("aten::conv_transpose2d", "input", x_cl, weight, no_bias,
                       IntArrayRef(stride), IntArrayRef(padding), IntArrayRef(output_padding), groups,
                       IntArrayRef(dilation));
  const Tensor z = dense_in(to<Tensor>(st[0]), kFormat);
  auto [out, mean, rstd] = group_norm_cuda_pre(kOp, z, num_groups, gn_weight, gn_bias, eps, pro, out_is_nchw(input));
  return {out, z, mean, rstd, input_cl_output(input, x_cl)};
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> fused_backward_cuda(
    const Tensor& grad_out, const Tensor& input, const Tensor& weight, const OptTensor& conv_bias, const Tensor& z,
    const Tensor& mean, const Tensor& rstd, const OptTensor& gn_weight, IntList stride, IntList padding,
    IntList output_padding, IntList dilation, int64_t groups, int64_t num_groups, std::string approximate,
    std::vector<bool> mask_list) {
  const std::array<bool, 5> output_mask = mask_array<5>(kBwdOp, mask_list);
  check_conv_args(kBwdOp, input, weight, conv_bias, stride, padding, output_padding, dilation, groups);
  const Pointwise pro = make_prologue(kBwdOp, conv_bias, approximate);
  DeviceGuard guard(input);
  const bool need_dz = output_mask[0] || output_mask[1] || (output_mask[2] && defined(conv_bias));
  auto [dz, dgw, dgb] = group_norm_backward_cuda_pre(kBwdOp, grad_out, z, mean, rstd, gn_weight, num_groups,
                                                     {need_dz, output_mask[3], output_mask[4]}, pro);
  OptTensor dinput, dweight, dbias;
  if (output_mask[2] && defined(conv_bias)) {
    const Tensor s = torch::stable::sum(*dz, IntList{0, 2, 3}, false, ScalarType::Float);
    dbias = to_dtype(s, conv_bias->scalar_type());
  }
  if (output_mask[0] || output_mask[1]) {
    const std::optional<IntList> bias_sizes;
    const bool mask[3] = {output_mask[0], output_mask[1], false};
    auto st = call_op<11>("aten::convolution_backward", "", dense_in(*dz, kFormat), input_in_kformat(input), weight,
                          bias_sizes, IntArrayRef(stride), IntArrayRef(padding), IntArrayRef(dilation),
                          /*transposed=*/true, IntArrayRef(output_padding), groups,
                          torch::headeronly::HeaderOnlyArrayRef<bool>(mask, 3));
    Tensor gi = to<Tensor>(st[0]), gw = to<Tensor>(st[1]), gb = to<Tensor>(st[2]);
    if (output_mask[0]) dinput = dense_in(gi, kFormat);
    if (output_mask[1]) dweight = dense_in(gw, suggest_format(weight));
  }
  return {dinput, dweight, dbias, dgw, dgb};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gnext, CUDA, m) {
  m.impl("conv_transpose2d_gelu_group_norm", TORCH_BOX(&fused_cuda));
  m.impl("conv_transpose2d_gelu_group_norm_backward", TORCH_BOX(&fused_backward_cuda));
}

}  // namespace gnext
