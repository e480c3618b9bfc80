# SPDX-License-Identifier: BSD-3-Clause
"""PyTorch's own GroupNorm on gnext's CUDA kernels, with no model edits.

``enable_aten_kernels()`` registers gnext's kernels as the CUDA kernels of ``aten::native_group_norm`` and
``aten::native_group_norm_backward``, the two operators under ``torch.nn.functional.group_norm`` and
``torch.nn.GroupNorm`` (and every subclass of it: timm's ``GroupNorm``/``GroupNormAct``, diffusers' blocks).
Everything above those two kernels stays PyTorch's: the argument checks, the C++ autograd node
(``NativeGroupNormBackward0``), double backward, ``torch.func`` batching rules, CUDA-graph capture, so the
host path of a call is eager PyTorch's, with no Python frame added, while the GPU work is gnext's.
``disable_aten_kernels()`` removes them again: ATen's kernels are current once more.

What changes and what does not:

* CUDA tensors only; CPU tensors and other devices keep ATen's kernels.
* ``torch.compile`` graphs are unaffected: Inductor decomposes GroupNorm into its own kernels before these
  operators are called (use :func:`groupnorm_ext.enable_compile_fusion` there).
* ``mean``/``rstd`` (the second and third outputs of ``torch.native_group_norm``) keep ATen's dtype,
  ``(N, G)`` in float32 for a float16/bfloat16 input with float32 weight or bias, else in the input's
  dtype; gnext computes them in float32 and casts them (one small kernel; the backward casts them back).
* The output is computed as gnext computes it (Wu & He 2018; float32 Welford statistics, no float atomics:
  bitwise reproducible); the layout rules are PyTorch's (F.group_norm makes a CUDA input NCHW-contiguous
  first, and its backward makes the upstream gradient contiguous).
* float64, which gnext's kernels do not take, runs the same formula through ATen ops (``gradcheck`` keeps
  working); other dtypes raise gnext's error naming the dtype, as do C % G != 0 and a weight/bias not of
  shape (C,).
* GroupNorm + activation fusion needs gnext's own ops (:func:`groupnorm_ext.convert_group_norm_act`,
  whose autograd is Python); this path runs the activation as PyTorch does.

PyTorch prints one warning per process the first time a kernel of a registered operator is replaced
("Overriding a previously registered kernel for the same operator and the same dispatch key"). Switch
the kernels at set-up time, not while other threads run GroupNorm: the dispatcher's registration is not
synchronized with calls in flight.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from . import _C
from ._registry import ops  # noqa: F401  (the library is loaded and its ops registered first)


def enable_aten_kernels() -> bool:
    """Makes ``aten::native_group_norm`` and ``aten::native_group_norm_backward`` run gnext's kernels on
    CUDA tensors (module docstring). Idempotent.

    Returns:
        bool: whether they were already enabled.

    Raises:
        RuntimeError: gnext was built without CUDA kernels (a CPU-only build).
    """
    return _C._set_aten_kernels(True)


def disable_aten_kernels() -> bool:
    """Gives ``aten::native_group_norm`` and its backward their ATen CUDA kernels back. Idempotent.

    Returns:
        bool: whether gnext's kernels were enabled before the call.
    """
    return _C._set_aten_kernels(False)


def aten_kernels_enabled() -> bool:
    """Whether :func:`enable_aten_kernels` is in effect."""
    return _C._set_aten_kernels(None)


@contextlib.contextmanager
def aten_kernels(enabled: bool = True) -> Iterator[None]:
    """Context manager: gnext's kernels behind PyTorch's GroupNorm on (``enabled=True``) or off inside the
    block, and the previous state restored on exit (also on an exception)."""
    previous = _C._set_aten_kernels(bool(enabled))
    try:
        yield
    finally:
        _C._set_aten_kernels(previous)
