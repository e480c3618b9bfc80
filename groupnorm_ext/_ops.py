# SPDX-License-Identifier: BSD-3-Clause
"""The fake (meta) kernels of torch.ops.gnext.*, which torch.compile and torch.library.opcheck trace with,
and the layout tag of every overload (mark_flexible_layout)."""
from __future__ import annotations

import torch

from ._library import memory_format as _memory_format
from ._library import ops


def _empty_like_input(input: torch.Tensor) -> torch.Tensor:
    return torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=_memory_format(input))


@torch.library.register_fake("gnext::group_norm")
def _group_norm_fake(input, num_groups, weight, bias, eps):
    torch._check(input.dim() >= 2, lambda: f"gnext.group_norm: input must have at least 2 dims, got {input.dim()}")
    torch._check(num_groups > 0, lambda: f"gnext.group_norm: num_groups must be positive, got {num_groups}")
    torch._check(
        input.shape[1] % num_groups == 0,
        lambda: f"gnext.group_norm: num_channels C={input.shape[1]} must be divisible by num_groups={num_groups}",
    )
    stats = input.new_empty((input.shape[0], num_groups), dtype=torch.float32)
    return _empty_like_input(input), stats, torch.empty_like(stats)


@torch.library.register_fake("gnext::group_norm_backward")
def _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask):
    pdtype = weight.dtype if weight is not None else input.dtype
    C = input.shape[1]
    dx = _empty_like_input(input) if output_mask[0] else None
    dw = input.new_empty((C,), dtype=pdtype) if output_mask[1] else None
    db = input.new_empty((C,), dtype=pdtype) if output_mask[2] else None
    return dx, dw, db


def _suggest_format(t: torch.Tensor) -> torch.memory_format:
    """at::Tensor::suggest_memory_format for 4-D tensors (the C++ op makes its outputs dense in it)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _fused_compute_format(input: torch.Tensor) -> torch.memory_format:
    """kFormat in csrc/conv_gelu_gn/conv_gelu_gn_cuda.cpp (channels_last) on CUDA; the input's on the CPU."""
    return torch.channels_last if input.device.type == "cuda" else _suggest_format(input)


def _fused_out_format(input: torch.Tensor) -> torch.memory_format:
    """The layout of the fused op's output: the input's (on CUDA, channels_last where the input is dense in
    channels_last, else NCHW: out_is_nchw in csrc/conv_gelu_gn/conv_gelu_gn_cuda.cpp)."""
    if input.device.type == "cuda":
        return torch.channels_last if input.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    return _suggest_format(input)


@torch.library.register_fake("gnext::conv_transpose2d_gelu_group_norm")
def _conv_transpose2d_gelu_group_norm_fake(input, weight, conv_bias, stride, padding, output_padding, dilation,
                                           groups, num_groups, gn_weight, gn_bias, eps, approximate):
    torch._check(input.dim() == 4, lambda: f"gnext.conv_transpose2d_gelu_group_norm: input must be 4-D, got {input.dim()}")
    torch._check(approximate in ("none", "tanh"), lambda: f"approximate must be 'none' or 'tanh', got {approximate!r}")
    N, H, W = input.shape[0], input.shape[2], input.shape[3]
    c_out = weight.shape[1] * groups
    torch._check(num_groups > 0 and c_out % num_groups == 0,
                 lambda: f"C_out={c_out} must be divisible by num_groups={num_groups}")
    kh, kw = weight.shape[2], weight.shape[3]
    ho = (H - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + output_padding[0] + 1
    wo = (W - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + output_padding[1] + 1
    z = torch.empty((N, c_out, ho, wo), dtype=input.dtype, device=input.device,
                    memory_format=_fused_compute_format(input))
    stats = input.new_empty((N, num_groups), dtype=torch.float32)
    # input_cl: the CUDA op's channels_last copy of an input not dense in channels_last; else (0,)
    if input.device.type == "cuda" and not input.is_contiguous(memory_format=torch.channels_last):
        input_cl = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=torch.channels_last)
    else:
        input_cl = input.new_empty((0,))
    out = torch.empty(z.shape, dtype=z.dtype, device=z.device, memory_format=_fused_out_format(input))
    return out, z, stats, torch.empty_like(stats), input_cl


@torch.library.register_fake("gnext::conv_transpose2d_gelu_group_norm_backward")
def _conv_transpose2d_gelu_group_norm_backward_fake(grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight,
                                                    stride, padding, output_padding, dilation, groups, num_groups,
                                                    approximate, output_mask):
    def like(t, fmt=None):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt or torch.contiguous_format)

    c_out = z.shape[1]
    pdtype = gn_weight.dtype if gn_weight is not None else z.dtype
    return (
        like(input, _fused_compute_format(input)) if output_mask[0] else None,
        like(weight, _suggest_format(weight)) if output_mask[1] else None,
        like(conv_bias) if output_mask[2] and conv_bias is not None else None,
        z.new_empty((c_out,), dtype=pdtype) if output_mask[3] else None,
        z.new_empty((c_out,), dtype=pdtype) if output_mask[4] else None,
    )


@torch.library.register_fake("gnext::group_norm_act")
def _group_norm_act_fake(input, num_groups, weight, bias, eps, activation, residual):
    torch._check(residual is None or residual.shape == input.shape,
                 lambda: f"gnext.group_norm_act: residual.shape={tuple(residual.shape)} must equal input.shape")
    return _group_norm_fake(input, num_groups, weight, bias, eps)


@torch.library.register_fake("gnext::group_norm_act_backward")
def _group_norm_act_backward_fake(grad_out, input, mean, rstd, weight, bias, num_groups, activation, output_mask):
    return _group_norm_backward_fake(grad_out, input, mean, rstd, weight, num_groups, output_mask)


@torch.library.register_fake("gnext::group_norm_act_logsumexp")
def _group_norm_act_logsumexp_fake(input, input_bias, num_groups, weight, bias, eps, activation, residual):
    torch._check(input_bias is None or tuple(input_bias.shape) == (input.shape[1],),
                 lambda: f"gnext.group_norm_act_logsumexp: input_bias must have shape (C,), got "
                         f"{tuple(input_bias.shape)}")
    _, mean, rstd = _group_norm_fake(input, num_groups, weight, bias, eps)
    out = input.new_empty((input.shape[0], 1, *input.shape[2:]))
    return out, mean, rstd


@torch.library.register_fake("gnext::group_norm_act_logsumexp_backward")
def _group_norm_act_logsumexp_backward_fake(grad_out, out, input, input_bias, mean, rstd, weight, bias, num_groups,
                                            activation, residual, output_mask):
    dx, dw, db = _group_norm_backward_fake(input, input, mean, rstd, weight, num_groups,
                                           [output_mask[0], output_mask[2], output_mask[3]])
    dib = input_bias.new_empty((input.shape[1],)) if output_mask[1] and input_bias is not None else None
    return dx, dib, dw, db


def mark_flexible_layout() -> None:
    """Tag every gnext overload with torch.Tag.flexible_layout: Inductor then hands the op its inputs in
    the layout it already has them in, instead of forcing them to the strides they had when the graph
    was traced (the default for custom ops, needs_exact_strides). Under torch.compile, Inductor runs the
    convolutions of an NCHW model in channels_last; with exact strides every gnext call between two
    convolutions cost a transposing copy of its input and another of its output (BiT training step,
    H100: 3.1 ms of transposes in an 11.6 ms step). The kernels take any layout and the fake kernels above
    give the output layout the CUDA/CPU kernels produce for every input layout, so no constraint is
    needed. The stable ABI can attach tags at definition time only from torch 2.12
    (StableLibrary::def(schema, tags)); the wheel supports 2.11, so the tag is added to the overload
    objects here, which is what torch.compile reads (OpOverload.tags)."""
    flexible = torch.Tag.flexible_layout
    for name in ops:
        packet = getattr(ops, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if flexible not in op.tags:
                op._tags = [*op.tags, flexible]
