// SPDX-License-Identifier: BSD-3-Clause
// The host side of gnext is written against PyTorch's LibTorch stable ABI (torch/csrc/stable, built
// with TORCH_TARGET_VERSION = 2.11, see setup.py): the compiled module calls libtorch only through its
// C shim, so one build loads on every torch release from 2.11 on. This header gathers what the ops
// need on top of torch::stable: error checks with readable messages, dtype/shape/device printing,
// memory-format tests from strides, and allocation in a memory format.
#pragma once
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/MemoryFormat.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

// torch 2.11's headers name the shim's error check TORCH_ERROR_CODE_CHECK; later releases add
// STABLE_TORCH_ERROR_CODE_CHECK. One name here so the sources build against every torch >= 2.11.
#if !defined(STABLE_TORCH_ERROR_CODE_CHECK)
#define STABLE_TORCH_ERROR_CODE_CHECK TORCH_ERROR_CODE_CHECK
#endif

namespace gnext {

using Tensor = torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;
using ScalarType = torch::headeronly::ScalarType;
using MemoryFormat = torch::headeronly::MemoryFormat;
using IntArrayRef = torch::headeronly::IntHeaderOnlyArrayRef;

// Raises RuntimeError (in Python) with the streamed arguments as its message.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw std::runtime_error(os.str());
}
#define GNEXT_CHECK(cond, ...)                  \
  do {                                          \
    if (!(cond)) ::gnext::fail(__VA_ARGS__);    \
  } while (0)

inline bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }

// Printable shape "[2, 3]" and device "cuda:0" / "cpu" for messages.
struct Shape {
  std::vector<int64_t> v;
};
inline Shape shape(IntArrayRef s) { return {std::vector<int64_t>(s.begin(), s.end())}; }
inline Shape shape(const Tensor& t) { return shape(t.sizes()); }
inline std::ostream& operator<<(std::ostream& os, const Shape& s) {
  os << '[';
  for (size_t i = 0; i < s.v.size(); ++i) os << (i ? ", " : "") << s.v[i];
  return os << ']';
}
struct DeviceName {
  const Tensor& t;
};
inline DeviceName device_name(const Tensor& t) { return {t}; }
inline std::ostream& operator<<(std::ostream& os, const DeviceName& d) {
  if (d.t.is_cuda()) return os << "cuda:" << static_cast<int>(d.t.get_device_index());
  if (d.t.is_cpu()) return os << "cpu";
  return os << "device " << static_cast<int>(d.t.get_device_index());
}
inline bool same_device(const Tensor& a, const Tensor& b) { return a.device() == b.device(); }
inline bool same_shape(IntArrayRef a, IntArrayRef b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Dense in the given memory format (at::Tensor::is_contiguous(memory_format), from the strides:
// dimensions of size 1 may have any stride).
inline bool is_dense_in(const Tensor& t, MemoryFormat fmt) {
  if (fmt == MemoryFormat::Contiguous) return t.is_contiguous();
  const int64_t d = t.dim();
  if ((fmt == MemoryFormat::ChannelsLast && d != 4) || (fmt == MemoryFormat::ChannelsLast3d && d != 5)) return false;
  std::vector<int64_t> order{1};  // innermost first: C, then the spatial dims last to first, then N
  for (int64_t i = d - 1; i >= 2; --i) order.push_back(i);
  order.push_back(0);
  int64_t expected = 1;
  for (int64_t i : order) {
    const int64_t n = t.size(i);
    if (n != 1 && t.stride(i) != expected) return false;
    expected *= n;
  }
  return true;
}

// at::Tensor::suggest_memory_format for the formats gnext produces: channels_last(_3d) when dense in
// it and not contiguous, else contiguous.
inline MemoryFormat suggest_format(const Tensor& t) {
  if (t.is_contiguous()) return MemoryFormat::Contiguous;
  if (is_dense_in(t, MemoryFormat::ChannelsLast)) return MemoryFormat::ChannelsLast;
  if (is_dense_in(t, MemoryFormat::ChannelsLast3d)) return MemoryFormat::ChannelsLast3d;
  return MemoryFormat::Contiguous;
}

// New tensors on t's device, dense in `fmt`. Through the C shim's aoti_torch_empty_strided (a direct
// at::empty_strided call): torch::stable::empty goes through torch_call_dispatcher, which looks the
// operator up by name on every call and cost ~8 us of host time per allocation on the H100 host.
inline Tensor empty_on(const Tensor& like, IntArrayRef sizes, ScalarType dtype,
                       MemoryFormat fmt = MemoryFormat::Contiguous) {
  const int64_t d = static_cast<int64_t>(sizes.size());
  GNEXT_CHECK(d <= 8, "gnext: empty_on supports up to 8 dims, got ", d);
  std::array<int64_t, 8> strides{};
  const bool cl = (fmt == MemoryFormat::ChannelsLast && d == 4) || (fmt == MemoryFormat::ChannelsLast3d && d == 5);
  int64_t step = 1;
  if (cl) {  // C innermost, then the spatial dims last to first, then N
    strides[1] = step, step *= std::max<int64_t>(sizes[1], 1);
    for (int64_t i = d - 1; i >= 2; --i) strides[i] = step, step *= std::max<int64_t>(sizes[i], 1);
    strides[0] = step;
  } else {
    for (int64_t i = d - 1; i >= 0; --i) strides[i] = step, step *= std::max<int64_t>(sizes[i], 1);
  }
  int32_t device_type = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  const int32_t dt = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  AtenTensorHandle h = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(d, sizes.data(), strides.data(), dt, device_type,
                                                         like.get_device_index(), &h));
  return Tensor(h);
}
inline Tensor empty_as(const Tensor& t, MemoryFormat fmt) { return empty_on(t, t.sizes(), t.scalar_type(), fmt); }
inline Tensor zeros_on(const Tensor& like, IntArrayRef sizes, ScalarType dtype) {
  Tensor z = empty_on(like, sizes, dtype);
  torch::stable::zero_(z);
  return z;
}
// t itself when dense in fmt, else a copy that is.
inline Tensor dense_in(const Tensor& t, MemoryFormat fmt) {
  return is_dense_in(t, fmt) ? t : torch::stable::contiguous(t, fmt);
}
inline Tensor contig(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }
inline Tensor to_dtype(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}
inline void copy_into(Tensor& dst, const Tensor& src) { torch::stable::copy_(dst, src); }
inline void fill(Tensor& t, double v) { torch::stable::fill_(t, v); }

// Calls a registered operator by name through the dispatcher (for ATen ops torch::stable does not
// wrap); the stack's first entries hold the outputs afterwards (take them with detail::to).
template <size_t NStack, class... Args>
std::array<StableIValue, NStack> call_op(const char* name, const char* overload, const Args&... args) {
  static_assert(NStack >= sizeof...(Args), "call_op: stack smaller than the arguments");
  std::array<StableIValue, NStack> stack{torch::stable::detail::from(args)...};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return stack;
}

template <class T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}
inline void* ptr_or_null(const OptTensor& t) { return defined(t) ? t->data_ptr() : nullptr; }

}  // namespace gnext
