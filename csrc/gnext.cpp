// SPDX-License-Identifier: BSD-3-Clause
// The one schema file of gnext: every operator's signature lives here.
// The CUDA implementations register themselves next to their host glue (csrc/<op family>/*_cuda.cpp);
// CPU kernels, autograd and fake (meta) kernels are registered from Python (groupnorm_ext/_cpu.py,
// _autograd.py, _ops.py). Everything in C++ goes through PyTorch's stable ABI (common/stable.h).
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <cstdlib>
#include <exception>
#include <string>

#include "group_norm/group_norm_tuning.h"
#ifdef USE_CUDA
#include "group_norm/group_norm_aten.h"
#include "group_norm/group_norm_plan_text.h"
#endif

STABLE_TORCH_LIBRARY(gnext, m) {
  // The ops that compiled models call most are defined twice, with one signature: <op>, and <op>_no_autograd, which
  // has the same kernels and no Autograd kernel. <op>'s Autograd kernel is Python (groupnorm_ext/_autograd.py: the
  // stable ABI has no C++ autograd) and costs 6-12 us of host time per call on an H100, also where no gradient is
  // needed; PyTorch's C++ autograd fallback passes <op>_no_autograd through. Graphs that AOTAutograd has
  // differentiated already call the latter, and so do the Python calls that record no gradient
  // (groupnorm_ext/compile_fusion.py, _autograd.py; docs/decisions/compile-fusion.md).
  auto def_twice = [&m](const std::string& name, const char* signature) {
    m.def((name + signature).c_str());
    m.def((name + "_no_autograd" + signature).c_str());
  };
  // GroupNorm forward (Wu & He 2018). input (N, C, *); mean/rstd are (N, G) float32.
  def_twice(
      "group_norm", "(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps)"
      " -> (Tensor out, Tensor mean, Tensor rstd)");
  // GroupNorm backward. output_mask selects (grad_input, grad_weight, grad_bias).
  def_twice(
      "group_norm_backward", "(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " int num_groups, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)");
  // out = act(GroupNorm(input + input_bias[c])) + residual, act one of identity, silu, gelu, gelu_tanh, relu, tanh,
  // hardswish, tanh_hardswish (hardswish(tanh(.))); residual of input's shape or None; input_bias (C,) or None (the
  // bias of the convolution that wrote input, run without it); mean/rstd (N, G) float32, of input + input_bias.
  def_twice(
      "group_norm_act", "(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps, str activation,"
      " Tensor? residual, Tensor? input_bias=None) -> (Tensor out, Tensor mean, Tensor rstd)");
  // out = F.pad(act(GroupNorm(input + input_bias[c])), pad, mode, value), the padded tensor written in one pass after
  // the statistics (the input of a convolution that pads by itself, e.g. a causal 3-D one); mode "replicate" or
  // "constant"; pad as F.pad takes it (the last spatial dim first); input_bias (C,) or None (the bias of the
  // convolution that wrote input). Contiguous out; mean/rstd (N, G) float32, of input + input_bias.
  def_twice(
      "group_norm_act_pad", "(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps, str activation,"
      " int[] pad, str mode, float value, Tensor? input_bias=None) -> (Tensor out, Tensor mean, Tensor rstd)");
  // Its backward (the residual's gradient is grad_out itself). output_mask: (input, weight, bias).
  def_twice(
      "group_norm_act_backward", "(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " Tensor? bias, int num_groups, str activation, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)");
  // out = act(GroupNorm(input + input_bias[c]) * scale + shift), scale and shift of input's dtype and shape, or
  // (4-D, 5-D) of smaller (h, w) read by nearest upsampling (a spatially conditioned norm, e.g. CogVideoX's decoder),
  // in one pass after the statistics; input_bias (C,) or None (a convolution's bias, which input does not hold).
  // Contiguous out; mean/rstd (N, G) float32, of input + input_bias.
  def_twice(
      "group_norm_act_modulate", "(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps, Tensor scale,"
      " Tensor shift, str activation, Tensor? input_bias=None) -> (Tensor out, Tensor mean, Tensor rstd)");
  // group_norm_act_modulate's out y of a 5-D input behind `frames` frames along dim 2: torch.cat([cache, y], 2), or
  // without a cache torch.cat([y[:, :, :1]] * frames + [y], 2) (the input of a causal convolution that concatenates
  // its cached frames, or copies of the first, before its input: CogVideoX's). cache (N, C, frames, H, W) of input's
  // dtype or None. Contiguous out (N, C, frames + T, H, W); mean/rstd (N, G) float32, of input + input_bias.
  def_twice(
      "group_norm_act_modulate_cat", "(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps,"
      " Tensor scale, Tensor shift, str activation, int frames, Tensor? cache, Tensor? input_bias=None)"
      " -> (Tensor out, Tensor mean, Tensor rstd)");
  // The same written into out (input's shape and dtype, each (n, c) plane contiguous: e.g. the frames after the
  // cached ones in a causal convolution's input buffer). Not differentiable; mean/rstd (N, G) float32.
  m.def(
      "group_norm_act_modulate_into(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps,"
      " Tensor scale, Tensor shift, str activation, Tensor(a!) out, Tensor? input_bias=None)"
      " -> (Tensor mean, Tensor rstd)");
  // Moments of a shard of a tensor split over ranks: (3, N, G) float64 (count, mean, M2) per (n, g), the input
  // read once; and Chan's merge of the ranks' moments gathered into (world, 3, N, G): mean, rstd = 1/sqrt(M2/count +
  // eps) (N, G) float32 and count (N, G) float64.
  m.def("group_norm_moments(Tensor input, int num_groups) -> Tensor");
  m.def("group_norm_moments_merge(Tensor moments, float eps) -> (Tensor mean, Tensor rstd, Tensor count)");
  // The normalize pass from given statistics (mean, rstd (N, G) float32, e.g. merged across the ranks holding
  // shards of one tensor): out = act((input - mean) * rstd * weight + bias) + residual.
  m.def(
      "group_norm_act_apply(Tensor input, Tensor mean, Tensor rstd, int num_groups, Tensor? weight, Tensor? bias,"
      " str activation, Tensor? residual) -> Tensor");
  // Its backward in two passes around the caller's merge: the per-channel sums (N, C, 2) float32
  // (sum dy'*(input - mean), sum dy'), dy' = grad_out * act'; then grad_input from group_sums (N, G, 2) float32,
  // the group means of weight*dy'*(input - mean) and weight*dy' over the whole tensor.
  m.def(
      "group_norm_act_apply_backward_sums(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " Tensor? bias, int num_groups, str activation) -> Tensor");
  m.def(
      "group_norm_act_apply_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " Tensor? bias, Tensor group_sums, int num_groups, str activation) -> Tensor");
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
  if (enable != 1) return PyBool_FromLong(0);  // query, or off: they never were on
  PyErr_SetString(PyExc_RuntimeError, "gnext was built without CUDA: there are no CUDA kernels to give ATen");
  return nullptr;
#endif
}

// _tuning() -> [(env name, value, doc)]: the process's Tuning (group_norm/group_norm_tuning.h).
static PyObject* tuning_py(PyObject*, PyObject*) {
  const gnext::gn::Tuning& t = gnext::gn::tuning();
  PyObject* list = PyList_New(0);
  if (list == nullptr) return nullptr;
  for (const auto& f : gnext::gn::kTuningFields) {
    PyObject* item = Py_BuildValue("(sis)", f.env, t.*f.field, f.doc);
    if (item == nullptr || PyList_Append(list, item) != 0) {
      Py_XDECREF(item);
      Py_DECREF(list);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return list;
}

// _set_tuning(knobs: dict[str, int] | None): the defaults with `knobs` (GNEXT_* names) applied, or None: the
// environment's values again. Not while ops run on other threads.
static PyObject* set_tuning_py(PyObject*, PyObject* arg) {
  using gnext::gn::Tuning;
  if (arg == Py_None) {
    gnext::gn::set_tuning(gnext::gn::tuning_from([](const char* n) { return std::getenv(n); }));
    Py_RETURN_NONE;
  }
  if (!PyDict_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "_set_tuning: knobs must be a dict {'GNEXT_...': int} or None");
    return nullptr;
  }
  Tuning t{};
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(arg, &pos, &key, &value)) {
    const char* name = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, nullptr) : nullptr;
    if (name == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_set_tuning: knob names must be str");
      return nullptr;
    }
    int Tuning::*field = nullptr;
    for (const auto& f : gnext::gn::kTuningFields)
      if (std::string(name) == f.env) field = f.field;
    if (field == nullptr) {
      PyErr_Format(PyExc_ValueError, "_set_tuning: unknown knob '%s' (python -m groupnorm_ext --info lists them)",
                   name);
      return nullptr;
    }
    const long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) return nullptr;
    t.*field = static_cast<int>(v);
  }
  gnext::gn::set_tuning(t);
  Py_RETURN_NONE;
}

// _plan((N, C, G, HxW), esize, channels_last, act, residual, device[, input_bias]) -> str: the forward and backward
// plans (input_bias: the forward with an input shift) for
// `device`, a 7-tuple (SMs, CC major, shared memory per SM, per block, reserved per block, L2 bytes, peak GB/s),
// or None: the current CUDA device. _device() -> that 7-tuple of the current CUDA device.
static PyObject* plan_py(PyObject*, PyObject* args) {
  long long N, C, G, HxW;
  int esize, cl, act, residual, input_bias = 0;
  PyObject* dev = nullptr;
  if (!PyArg_ParseTuple(args, "(LLLL)ipipO|p", &N, &C, &G, &HxW, &esize, &cl, &act, &residual, &dev, &input_bias))
    return nullptr;
#ifdef USE_CUDA
  try {
    std::array<int64_t, 7> d{};
    if (dev == Py_None) {
      d = gnext::current_plan_device();
    } else {
      long long v[7];
      if (!PyArg_ParseTuple(dev, "LLLLLLL", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6])) return nullptr;
      for (int i = 0; i < 7; ++i) d[i] = v[i];
    }
    const std::string text =
        gnext::describe_plans({N, C, G, HxW}, esize, cl != 0, act, residual != 0, d, input_bias != 0);
    return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
#else
  (void)N, (void)C, (void)G, (void)HxW, (void)esize, (void)cl, (void)act, (void)residual, (void)dev, (void)input_bias;
  PyErr_SetString(PyExc_RuntimeError, "gnext was built without CUDA: there is no CUDA planner");
  return nullptr;
#endif
}

static PyObject* device_py(PyObject*, PyObject*) {
#ifdef USE_CUDA
  try {
    const std::array<int64_t, 7> d = gnext::current_plan_device();
    return Py_BuildValue("(LLLLLLL)", static_cast<long long>(d[0]), static_cast<long long>(d[1]),
                         static_cast<long long>(d[2]), static_cast<long long>(d[3]), static_cast<long long>(d[4]),
                         static_cast<long long>(d[5]), static_cast<long long>(d[6]));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
#else
  PyErr_SetString(PyExc_RuntimeError, "gnext was built without CUDA");
  return nullptr;
#endif
}

// The Python module `groupnorm_ext._C`: importing it loads this library, which runs the registrations above.
extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"_set_aten_kernels", set_aten_kernels_py, METH_O,
       "gnext's CUDA kernels for aten::native_group_norm(_backward) on (True), off (False) or unchanged (None); "
       "returns the previous state."},
      {"_tuning", tuning_py, METH_NOARGS, "[(GNEXT_* name, value, doc)] of the process's tuning."},
      {"_set_tuning", set_tuning_py, METH_O, "Tuning from {GNEXT_* name: int} over the defaults, or None: the environment's."},
      {"_plan", plan_py, METH_VARARGS, "The planner's forward and backward plans as text."},
      {"_device", device_py, METH_NOARGS, "The current CUDA device as the planner sees it (7 ints)."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
