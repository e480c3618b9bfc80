"""Functional API of gnext, mirroring torch.nn.functional."""
from __future__ import annotations

from typing import Optional

import torch

from ._ops import ops


def group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    r"""Group Normalization (Wu & He, "Group Normalization", ECCV 2018), a drop-in for
    :func:`torch.nn.functional.group_norm`.

    For each sample n and group g of ``D = C / num_groups`` consecutive channels::

        mean[n, g] = (1 / (D * HxW)) * sum_{c in g, s} x[n, c, s]
        var[n, g]  = (1 / (D * HxW)) * sum_{c in g, s} (x[n, c, s] - mean[n, g])^2     (biased)
        y[n, c, s] = (x[n, c, s] - mean[n, g]) / sqrt(var[n, g] + eps) * weight[c] + bias[c]

    Statistics are accumulated in float32 (Welford / Chan merges, no float atomics, so results
    are bitwise reproducible) whatever the input dtype.

    Args:
        input: ``(N, C, *)`` tensor, any number of trailing spatial dims (none included);
            float32, float16 or bfloat16; contiguous, channels_last / channels_last_3d (kept in
            the output) or any strides (made contiguous first).
        num_groups: G, a positive divisor of C.
        weight, bias: optional ``(C,)`` tensors, dtype of ``input`` or float32, same device.
        eps: added to the variance, unitless.

    Returns:
        Tensor of ``input``'s shape, dtype and memory format.

    Raises:
        RuntimeError: ``input.dim() < 2``; C not divisible by num_groups; num_groups <= 0;
            weight/bias not of shape ``(C,)``, on another device or of another dtype; unsupported
            dtype (integer, bool, complex, float64).

    Differentiable in input, weight and bias (torch.ops.gnext.group_norm_backward), and traceable
    by ``torch.compile(fullgraph=True)``.
    """
    return ops.group_norm(input, num_groups, weight, bias, eps)[0]
