# SPDX-License-Identifier: BSD-3-Clause
"""The leaf of the package: loads the compiled library (which defines torch.ops.gnext.* and registers
their CUDA kernels through PyTorch's stable ABI) and holds the rules every other module shares: the
activation names, the output layout, and the launch planner's tuning overrides. Imports nothing else of gnext."""
from __future__ import annotations

import torch

try:
    from . import _C  # noqa: F401  (loading the library runs STABLE_TORCH_LIBRARY(gnext, ...))
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "gnext's compiled module groupnorm_ext._C is missing or does not load "
        f"({e}). Build it first: `pip install --no-build-isolation -e .` in the source tree (needs torch and, "
        "for the CUDA kernels, nvcc whose CUDA major matches torch.version.cuda); or, if you are inside the "
        "source tree after a non-editable install, run from another folder so that the installed package "
        "is imported.") from e

ops = torch.ops.gnext

# Output activations of group_norm_act, in the order of the C++ enum (csrc/common/pointwise.h).
ACTIVATIONS = ("identity", "silu", "gelu", "gelu_tanh", "relu", "tanh", "hardswish", "tanh_hardswish")


def memory_format(input: torch.Tensor) -> torch.memory_format:
    """The layout of gnext's outputs for `input`: same rule as group_norm_memory_format in
    csrc/group_norm/group_norm.h."""
    if input.is_contiguous():
        return torch.contiguous_format
    if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def tuning() -> dict[str, int]:
    """The launch planner's overrides in effect, ``{"GNEXT_ONEPASS": 1, ...}`` (-1: the planner's rule).
    Read once from the environment at the first op; :func:`set_tuning` replaces them."""
    return {name: value for name, value, _ in _C._tuning()}


def tuning_docs() -> dict[str, str]:
    """What each tuning knob does (the one table: csrc/group_norm/group_norm_tuning.h)."""
    return {name: doc for name, _, doc in _C._tuning()}


def set_tuning(knobs: dict[str, int] | None) -> dict[str, int]:
    """Replaces the planner's overrides: the defaults with ``knobs`` applied (names with or without the
    ``GNEXT_`` prefix), or ``None``: the environment's values again. Returns the previous overrides, which
    ``set_tuning(previous)`` restores. For measurements and tests, not while ops run on other threads.
    Raises ValueError for an unknown knob."""
    previous = tuning()
    if knobs is None:
        _C._set_tuning(None)
    else:
        _C._set_tuning({(k if k.startswith("GNEXT_") else "GNEXT_" + k): int(v) for k, v in knobs.items()})
    return previous
