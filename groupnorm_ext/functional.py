# SPDX-License-Identifier: BSD-3-Clause
"""Functional API of gnext, mirroring torch.nn.functional."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._library import ACTIVATIONS  # noqa: F401  (re-exported: the names group_norm_act takes)
from ._registry import ops  # noqa: F401  (the compiled library, fake and CPU kernels, autograd)
from . import _cpu
from ._autograd import eager as _eager
from .ops import group_norm_act_pad as _pad_op
from .ops import group_norm_act_modulate as _modulate_op

_group_norm = _eager["group_norm"]
_group_norm_act = _eager["group_norm_act"]
_group_norm_act_logsumexp = _eager["group_norm_act_logsumexp"]
_group_norm_act_pad = _eager["group_norm_act_pad"]
_group_norm_act_modulate = _eager["group_norm_act_modulate"]
_conv_transpose2d_gelu_group_norm = _eager["conv_transpose2d_gelu_group_norm"]


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
            float32, float16 or bfloat16 (float64 runs ATen's ``F.group_norm``); contiguous,
            channels_last / channels_last_3d (kept in
            the output) or any strides (made contiguous first).
        num_groups: G, a positive divisor of C.
        weight, bias: optional ``(C,)`` tensors, dtype of ``input`` or float32, same device.
        eps: added to the variance, unitless.

    Returns:
        Tensor of ``input``'s shape, dtype and memory format.

    Raises:
        RuntimeError: ``input.dim() < 2``; C not divisible by num_groups; num_groups <= 0;
            weight/bias not of shape ``(C,)``, on another device or of another dtype; unsupported
            dtype (integer, bool, complex).

    Differentiable in input, weight and bias (torch.ops.gnext.group_norm_backward), and traceable
    by ``torch.compile(fullgraph=True)``.
    """
    if input.dtype == torch.float64:  # gnext's kernels are float32-accumulating; float64 keeps ATen's
        return torch.nn.functional.group_norm(input, num_groups, weight, bias, eps)
    return _group_norm(input, num_groups, weight, bias, eps)


def conv_transpose2d_gelu_group_norm(
    input: torch.Tensor,
    weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    num_groups: int,
    gn_weight: Optional[torch.Tensor] = None,
    gn_bias: Optional[torch.Tensor] = None,
    stride=1,
    padding=0,
    output_padding=0,
    dilation=1,
    groups: int = 1,
    eps: float = 1e-5,
    approximate: str = "none",
) -> torch.Tensor:
    r"""``group_norm(gelu(conv_transpose2d(input, weight, conv_bias)))`` in one op (KernelBench L2#19).

    Same result as ``F.group_norm(F.gelu(F.conv_transpose2d(input, weight, conv_bias, stride,
    padding, output_padding, groups, dilation), approximate=approximate), num_groups, gn_weight,
    gn_bias, eps)`` (GroupNorm: Wu & He 2018, biased variance; GELU: ``x * Phi(x)``, or its tanh
    approximation). The transposed convolution runs in ATen/cuDNN without its bias and follows
    ``torch.backends.cudnn.allow_tf32`` for float32 like PyTorch. On CUDA the conv runs in
    channels_last, where cuDNN's transposed conv is 2x faster on the H100 (an NCHW input costs one
    layout copy); the output has the input's layout, as the unfused modules would give it: NCHW for an
    NCHW input (written by the normalizing pass itself), channels_last for a channels_last one.
    grad_input is channels_last on CUDA. On the CPU the input's layout is kept. The bias add, GELU and GroupNorm
    then run in gnext's GroupNorm kernels as an input prologue: the activation ``gelu(z + b)`` is
    never written to memory. The backward fuses the GroupNorm and GELU backward in one kernel family,
    then computes the conv's input and weight gradients through ATen.

    Args:
        input: ``(N, C_in, H, W)``, float32/float16/bfloat16.
        weight: ``(C_in, C_out / groups, kH, kW)``, input's dtype and device.
        conv_bias: ``(C_out,)`` or None.
        num_groups: G, a divisor of C_out.
        gn_weight, gn_bias: ``(C_out,)`` or None (input's dtype or float32).
        stride, padding, output_padding, dilation: int or pair, as in ``F.conv_transpose2d``.
        groups: conv groups. eps: added to the variance. approximate: ``"none"`` or ``"tanh"``.

    Returns:
        ``(N, C_out, H_out, W_out)``, ``H_out = (H - 1) * stride - 2 * padding + dilation * (kH - 1)
        + output_padding + 1``; channels_last if the input is channels_last, else NCHW-contiguous.

    Raises:
        RuntimeError: bad shapes, dtypes or devices (the message names the argument), C_out not
        divisible by num_groups, ``approximate`` not ``"none"``/``"tanh"``.
    """
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
    return _conv_transpose2d_gelu_group_norm(
        input, weight, conv_bias, pair(stride), pair(padding), pair(output_padding), pair(dilation), groups,
        num_groups, gn_weight, gn_bias, eps, approximate)



def group_norm_act(
    input: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    activation: str = "silu",
    residual: Optional[torch.Tensor] = None,
    *,
    input_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""``act(group_norm(input + input_bias[c])) + residual`` in one op: GroupNorm (Wu & He 2018, as
    :func:`group_norm`) with the activation and the residual add as an epilogue of the same kernels,
    so the normalized tensor is never written to memory.

    Args:
        input, num_groups, weight, bias, eps: as :func:`group_norm`.
        activation: one of ``identity``, ``silu``, ``gelu`` (erf), ``gelu_tanh``, ``relu``, ``tanh``,
            ``hardswish``, ``tanh_hardswish`` (``hardswish(tanh(.))``, KernelBench L2#92), with
            PyTorch's formulas.
        residual: optional tensor of ``input``'s shape, dtype and device, added after the activation.
        input_bias: ``(C,)`` tensor of ``input``'s dtype or float32, or None: the op normalizes
            ``input + input_bias[c]`` (the bias of the convolution that wrote ``input``, run without it),
            read as ``input`` is, so that no pass adds it first; the sum is taken in float32. On CUDA this
            takes the two-pass kernels, or the wide channels_last one where it applies.

    Returns:
        Tensor of ``input``'s shape, dtype and memory format.

    Raises:
        RuntimeError: as :func:`group_norm`; unknown activation; residual of another shape, dtype or
        device; ``input_bias`` of another shape, dtype or device.

    Differentiable in input, weight, bias, residual and input_bias; traceable by
    ``torch.compile(fullgraph=True)``.
    """
    if input.dtype == torch.float64:  # ATen's ops, as group_norm
        act = _cpu.parse_activation("gnext.group_norm_act", activation)
        _cpu.check_input_bias("gnext.group_norm_act", input, input_bias)
        input = _cpu.biased_input(input, input_bias)
        out = _cpu.apply_act(torch.nn.functional.group_norm(input, num_groups, weight, bias, eps), act)
        return out if residual is None else out + residual
    return _group_norm_act(input, num_groups, weight, bias, eps, activation, residual, input_bias)


def group_norm_act_pad(
    input: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    activation: str = "silu",
    pad: Sequence[int] = (1, 1, 1, 1),
    mode: str = "replicate",
    value: float = 0.0,
    input_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""``F.pad(act(group_norm(input + input_bias[c])), pad, mode, value)`` in one op: the padded input of a
    convolution that pads by itself, such as the causal 3-D convolutions of video VAEs (HunyuanVideo pads
    ``(1, 1, 1, 1, 2, 0)`` by replication before each ``conv3d``).

    GroupNorm as :func:`group_norm` (Wu & He 2018), the activation as :func:`group_norm_act`. On CUDA
    the statistics pass reads ``input`` once and a second pass writes every element of the padded output,
    halo included, from its source element (replicate: the nearest element of ``input`` along each padded
    dim; constant: ``value``), so neither the normalized tensor nor the padding pass exists
    (2 reads + 1 write of the tensor, against 2 + 2 for ``F.pad`` after :func:`group_norm_act`).

    Args:
        input, num_groups, weight, bias, eps: as :func:`group_norm`; ``input`` has 1 to 3 spatial dims
            (3-D to 5-D); a channels_last input is made contiguous first.
        activation: as :func:`group_norm_act`.
        pad: as :func:`torch.nn.functional.pad`: (before, after) per padded spatial dim, the last dim
            first, 2 to 2 x (spatial dims) values, each >= 0, in elements.
        mode: ``"replicate"`` or ``"constant"``.
        value: the constant mode's fill value (after the activation; it is not normalized).
        input_bias: ``(C,)`` tensor of ``input``'s dtype or float32, or None: the op normalizes
            ``input + input_bias[c]`` (the bias of the convolution that wrote ``input``, run without it),
            read as ``input`` is; ``mean``/``rstd`` are those of the sum (float32 addition).

    Returns:
        Contiguous tensor of ``input``'s dtype: ``input``'s shape with each padded dim grown by its two
        pad values.

    Raises:
        RuntimeError: as :func:`group_norm_act`; ``mode`` not one of the two; ``pad`` of odd length, empty,
            longer than 2 x (spatial dims) or with negative values; replicate padding of an empty dim;
            ``input_bias`` of another shape, dtype or device.

    Differentiable in input, weight, bias and input_bias (the padding's gradient is folded onto the elements
    it copied); traceable by ``torch.compile(fullgraph=True)``.
    """
    pad = [int(p) for p in pad]
    if input.dtype == torch.float64:  # ATen's ops, as group_norm
        act = _cpu.parse_activation("gnext.group_norm_act_pad", activation)
        _pad_op.check_pad_args("gnext.group_norm_act_pad", input, pad, mode)
        _cpu.check_input_bias("gnext.group_norm_act_pad", input, input_bias)
        input = _cpu.biased_input(input, input_bias)
        out = _cpu.apply_act(torch.nn.functional.group_norm(input, num_groups, weight, bias, eps), act)
        return _pad_op.pad_output(out, pad, mode, value)
    return _group_norm_act_pad(input, num_groups, weight, bias, eps, activation, pad, mode, value, input_bias)


def group_norm_act_modulate(
    input: torch.Tensor,
    num_groups: int,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    activation: str = "identity",
    *,
    out: Optional[torch.Tensor] = None,
    input_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""``act(group_norm(input) * scale + shift)`` in one op, with ``scale`` and ``shift`` tensors of ``input``'s
    shape, or of smaller height and width that are upsampled by nearest neighbour: a spatially conditioned GroupNorm
    (Zhu et al. 2022, MoVQ), as in CogVideoX's decoder, where both are convolved from the latents and an activation
    follows.

    GroupNorm as :func:`group_norm` (Wu & He 2018)::

        out[n, c, s] = act(group_norm(input)[n, c, s] * up(scale)[n, c, s] + up(shift)[n, c, s])

    with ``up(t) = F.interpolate(t, size=input.shape[2:], mode="nearest")`` where ``t`` is smaller (the same source
    element per output element as PyTorch's ``nearest`` mode), else ``t``.

    On CUDA the statistics pass reads ``input`` once, then one pass reads ``input``, ``scale`` and ``shift`` and
    writes ``out`` (4 reads + 1 write of the tensor with full-size ``scale`` and ``shift``; 2 reads + 1 write and
    the small tensors when they are smaller, which are never upsampled in memory; unfused, the group norm, the
    product, the sum and the activation take 9 passes).

    Args:
        input, num_groups, weight, bias, eps: as :func:`group_norm`; a channels_last input is made contiguous first.
        scale, shift: tensors of ``input``'s dtype and device and the same shape, either ``input``'s shape or, for a
            4-D ``(N, C, H, W)`` or 5-D ``(N, C, D, H, W)`` input, ``(N, C, h, w)`` or ``(N, C, D, h, w)`` with
            ``1 <= h <= H`` and ``1 <= w <= W`` (any strides; copied to contiguous).
        activation: as :func:`group_norm_act` (default ``"identity"``: no activation).
        out: where to write the result instead of a new tensor: ``input``'s shape, dtype and device, each
            ``(n, c)`` plane contiguous and no two overlapping, e.g. ``buf[:, :, k:]`` of a contiguous ``buf`` whose
            first ``k`` frames hold something else (a causal convolution's cached frames). Not differentiable:
            with ``out``, no argument may require grad while grad mode is on.
        input_bias: ``(C,)`` tensor of ``input``'s dtype or float32, or None: the op normalizes
            ``input + input_bias[c]`` (a convolution's bias that ``input`` does not hold yet), read as ``input`` is
            (the bias shifts the statistics and the per-channel coefficients). Differentiable.

    Returns:
        Contiguous tensor of ``input``'s shape and dtype, or ``out``.

    Raises:
        RuntimeError: as :func:`group_norm_act`; ``scale`` or ``shift`` of another dtype or device, of a shape
        other than the above, or of shapes that differ from each other; smaller ``scale`` and ``shift`` with a
        per-channel plane ``D * H * W`` of ``2**31 - 4096`` elements or more; ``out`` of another shape, dtype or
        device, or with planes that are not contiguous or overlap; ``out`` where a gradient is needed.

    Differentiable in input, weight, bias, scale and shift; traceable by ``torch.compile(fullgraph=True)``.
    """
    if input.dtype == torch.float64:  # ATen's ops, as group_norm
        act = _cpu.parse_activation("gnext.group_norm_act_modulate", activation)
        _modulate_op.check_modulation("gnext.group_norm_act_modulate", input, scale, shift)
        _cpu.check_input_bias("gnext.group_norm_act_modulate", input, input_bias)
        input = _cpu.biased_input(input, input_bias)
        n = torch.nn.functional.group_norm(input, num_groups, weight, bias, eps)
        scale, shift = _modulate_op.upsample(scale, input), _modulate_op.upsample(shift, input)
        y = _cpu.apply_act(torch.addcmul(shift, n, scale), act).contiguous()
        if out is None:
            return y
        _modulate_op.check_rows_out("gnext.group_norm_act_modulate_into", out, input)
        return out.copy_(y)
    if out is not None:
        torch.ops.gnext.group_norm_act_modulate_into(input, num_groups, weight, bias, eps, scale, shift, activation,
                                                     out, input_bias)
        return out
    return _group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation, input_bias)


def group_norm_act_logsumexp(
    input: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    activation: str = "tanh_hardswish",
    residual: bool = True,
    input_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""``torch.logsumexp(v + act(group_norm(v)), dim=1, keepdim=True)`` with
    ``v = input + input_bias[c]``, in one op: the tail of KernelBench L2#92 (Conv2d, GroupNorm, Tanh,
    HardSwish, residual add, LogSumExp over channels), with ``input`` the conv output *without* its bias
    and ``input_bias`` the conv bias (adding it here saves cuDNN's separate bias pass).

    Per sample n and pixel s, with GroupNorm as in :func:`group_norm` (Wu & He 2018)::

        v[n, c, s]  = input[n, c, s] + input_bias[c]
        r[n, c, s]  = [residual] v[n, c, s] + act(group_norm(v)[n, c, s])
        out[n, 0, s] = log(sum_c exp(r[n, c, s]))          (computed with a running max, as torch.logsumexp)

    On CUDA: the GroupNorm statistics of v (one read of input), then one kernel that normalizes,
    activates, adds the residual and reduces over the C channels of each pixel, so the (N, C, *) result
    of the activation is never written. The backward recomputes r from mean/rstd and ``out``.

    Args:
        input: (N, C, *) float32, float16 or bfloat16, any memory format (channels_last is read in place).
        num_groups, weight, bias, eps: GroupNorm's, as :func:`group_norm`.
        activation: as :func:`group_norm_act` (default ``tanh_hardswish``, i.e. ``hardswish(tanh(.))``).
        residual: add ``v`` before the logsumexp (L2#92's ``x_conv + x_hard_swish``).
        input_bias: optional (C,) tensor of ``input``'s dtype or float32 added to every channel first.

    Returns:
        Tensor (N, 1, *) of ``input``'s dtype (logsumexp over dim 1 with ``keepdim=True``).

    Raises:
        RuntimeError: as :func:`group_norm`; unknown activation; input_bias of another shape or device.

    Differentiable in input, input_bias, weight and bias; traceable by ``torch.compile(fullgraph=True)``.
    """
    return _group_norm_act_logsumexp(input, input_bias, num_groups, weight, bias, eps, activation, residual)
