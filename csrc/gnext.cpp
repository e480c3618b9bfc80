// The one schema file of gnext: every operator's signature lives here.
// The CUDA implementations register themselves next to their host glue (csrc/<op family>/*_cuda.cpp);
// CPU kernels, autograd and fake (meta) kernels are registered from Python (groupnorm_ext/_cpu.py,
// _autograd.py, _ops.py). Everything in C++ goes through PyTorch's stable ABI (common/stable.h).
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <exception>

#ifdef USE_CUDA
#include "group_norm/group_norm_aten.h"
#endif

STABLE_TORCH_LIBRARY(gnext, m) {
  // GroupNorm forward (Wu & He 2018). input (N, C, *); mean/rstd are (N, G) float32.
  m.def(
      "group_norm(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps)"
      " -> (Tensor out, Tensor mean, Tensor rstd)");
  // GroupNorm backward. output_mask selects (grad_input, grad_weight, grad_bias).
  m.def(
      "group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " int num_groups, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)");
  // out = act(GroupNorm(input)) + residual, act one of identity, silu, gelu, gelu_tanh, relu, tanh,
  // hardswish, tanh_hardswish (hardswish(tanh(.))); residual of input's shape or None.
  m.def(
      "group_norm_act(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps, str activation,"
      " Tensor? residual) -> (Tensor out, Tensor mean, Tensor rstd)");
  // Its backward (the residual's gradient is grad_out itself). output_mask: (input, weight, bias).
  m.def(
      "group_norm_act_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " Tensor? bias, int num_groups, str activation, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)");
  // out = logsumexp over dim 1 (keepdim) of [residual ? v : 0] + act(GroupNorm(v)), v = input + input_bias[c]
  // (KernelBench L2#92 after its conv); out is (N, 1, *) of input's dtype, mean/rstd (N, G) float32 of v.
  m.def(
      "group_norm_act_logsumexp(Tensor input, Tensor? input_bias, int num_groups, Tensor? weight, Tensor? bias,"
      " float eps, str activation, bool residual) -> (Tensor out, Tensor mean, Tensor rstd)");
  // Its backward. output_mask selects (grad_input, grad_input_bias, grad_weight, grad_bias).
  m.def(
      "group_norm_act_logsumexp_backward(Tensor grad_out, Tensor out, Tensor input, Tensor? input_bias,"
      " Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, int num_groups, str activation, bool residual,"
      " bool[4] output_mask) -> (Tensor?, Tensor?, Tensor?, Tensor?)");
  // out = GroupNorm(GELU(conv_transpose2d(input, weight) + conv_bias)). z is the conv output
  // without bias, saved with mean/rstd ((N, num_groups) float32) for the backward. input_cl: the
  // input in channels_last where the CUDA op made that copy (input not dense in channels_last), so the
  // backward's weight gradient reads it instead of transposing the input again; else an empty (0,)
  // tensor (channels_last input, and on the CPU).
  m.def(
      "conv_transpose2d_gelu_group_norm(Tensor input, Tensor weight, Tensor? conv_bias, int[2] stride,"
      " int[2] padding, int[2] output_padding, int[2] dilation, int groups, int num_groups, Tensor? gn_weight,"
      " Tensor? gn_bias, float eps, str approximate)"
      " -> (Tensor out, Tensor z, Tensor mean, Tensor rstd, Tensor input_cl)");
  // Its backward. output_mask selects (grad_input, grad_weight, grad_conv_bias, grad_gn_weight, grad_gn_bias).
  m.def(
      "conv_transpose2d_gelu_group_norm_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? conv_bias,"
      " Tensor z, Tensor mean, Tensor rstd, Tensor? gn_weight, int[2] stride, int[2] padding,"
      " int[2] output_padding, int[2] dilation, int groups, int num_groups, str approximate, bool[5] output_mask)"
      " -> (Tensor?, Tensor?, Tensor?, Tensor?, Tensor?)");
}

// _set_aten_kernels(enable: bool | None) -> bool: gnext's CUDA kernels behind aten::native_group_norm and its
// backward on (True) or off (False), or unchanged (None); returns the previous state
// (groupnorm_ext.enable_aten_kernels).
static PyObject* set_aten_kernels_py(PyObject*, PyObject* arg) {
  const int enable = arg == Py_None ? -2 : PyObject_IsTrue(arg);
  if (enable == -1) return nullptr;
#ifdef USE_CUDA
  try {
    if (enable == -2) return PyBool_FromLong(gnext::aten_kernels_enabled());
    return PyBool_FromLong(gnext::set_aten_kernels(enable != 0));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
#else
  if (enable == -2) return PyBool_FromLong(0);
  PyErr_SetString(PyExc_RuntimeError, "gnext was built without CUDA: there are no CUDA kernels to give ATen");
  return nullptr;
#endif
}

// The Python module `groupnorm_ext._C`: importing it loads this library, which runs the registrations above.
extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"_set_aten_kernels", set_aten_kernels_py, METH_O,
       "gnext's CUDA kernels for aten::native_group_norm(_backward) on (True), off (False) or unchanged (None); "
       "returns the previous state."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
