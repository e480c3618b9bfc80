// The one schema file of gnext: every operator's signature lives here.
// Implementations register themselves per dispatch key next to their kernels
// (csrc/<op family>/*_cpu.cpp, *_cuda.cu); fake (meta) kernels and autograd are
// registered from Python in groupnorm_ext/_ops.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(gnext, m) {
  // GroupNorm forward (Wu & He 2018). input (N, C, *); mean/rstd are (N, G) float32.
  m.def(
      "group_norm(Tensor input, int num_groups, Tensor? weight, Tensor? bias, float eps)"
      " -> (Tensor out, Tensor mean, Tensor rstd)");
  // GroupNorm backward. output_mask selects (grad_input, grad_weight, grad_bias).
  m.def(
      "group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " int num_groups, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)");
}

// An importable (empty) Python module, so `import groupnorm_ext._C` loads this
// library and runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
