// SPDX-License-Identifier: BSD-3-Clause
// Whether this module carries device code (SASS, or PTX the driver can JIT) for the current GPU:
// a kernel of its own, compiled for the same arch list as every other kernel of the module, is asked
// for its attributes. Used once per device by check_device_supported (cuda_utils.h).
#include <cuda_runtime.h>

namespace gnext {
namespace {
__global__ void probe_kernel() {}
}  // namespace

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, probe_kernel);
  if (e != cudaSuccess) (void)cudaGetLastError();  // clear it: the caller raises its own message
  return e;
}

}  // namespace gnext
