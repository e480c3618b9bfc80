// dtype dispatch for gnext kernels: float32, float16, bfloat16 only (no double/complex
// instantiations), and vector width selection.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>

#define GNEXT_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                       \
  [&] {                                                                                   \
    switch (TYPE) {                                                                       \
      case at::kFloat: {                                                                  \
        using scalar_t = float;                                                           \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kHalf: {                                                                   \
        using scalar_t = at::Half;                                                        \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kBFloat16: {                                                               \
        using scalar_t = at::BFloat16;                                                    \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      default:                                                                            \
        TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE,                            \
                    " (expected float32, float16 or bfloat16)");                          \
    }                                                                                     \
  }()

namespace gnext {

// Widest vector (elements per 16-byte access) usable when every row has `inner` elements and
// every pointer is 16-byte aligned; 1 otherwise.
template <typename T>
int vector_width(int64_t inner, std::initializer_list<const void*> ptrs) {
  constexpr int kMax = 16 / sizeof(T);
  if (inner % kMax != 0) return 1;
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return kMax;
}

}  // namespace gnext
