# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm + activation written into a padded output: out = F.pad(act(GroupNorm(x + input_bias[c])), pad, mode,
value), the input of a convolution that pads by itself (video VAEs' causal 3-D convolutions: replicate padding);
input_bias, where given, is the bias of the convolution that wrote x. The op's fake kernel, CPU kernel and autograd;
its schema is in csrc/gnext.cpp and its CUDA kernels (the statistics pass, then one pass that writes every padded
element) in csrc/group_norm/group_norm_pad.cu. The backward folds the padding's gradient back onto the elements it
copied (replicate) or drops it (constant), then runs group_norm_act_backward on x + input_bias (input_bias's
gradient: the input's, summed per channel)."""
from __future__ import annotations

import torch

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import _check, apply_act, biased_input, check_group_norm_args, check_input_bias, group_norm_of_biased, \
    input_bias_grad, parse_activation

MODES = ("replicate", "constant")


def check_pad_args(op, input, pad, mode):
    """The output's sizes for F.pad's `pad` (2 values per padded spatial dim, the last dim first, >= 0), raising
    as the CUDA kernel does (csrc/group_norm/group_norm.h, check_pad_args)."""
    _check(mode in MODES, lambda: f"{op}: mode must be 'replicate' or 'constant', got mode='{mode}'")
    sd = input.dim() - 2
    _check(1 <= sd <= 3, lambda: f"{op}: a padded output needs input of shape (N, C, *) with 1 to 3 spatial dims, "
                                 f"got input.shape={list(input.shape)}")
    pad = [int(p) for p in pad]
    _check(0 < len(pad) <= 2 * sd and len(pad) % 2 == 0,
           lambda: f"{op}: pad must hold 2 values (before, after) per padded spatial dim, the last dim first, at most "
                   f"{2 * sd} for input.shape={list(input.shape)}, got pad={pad}")
    sizes = list(input.shape)
    for k in range(len(pad) // 2):
        lo, hi = pad[2 * k], pad[2 * k + 1]
        _check(0 <= lo < 2 ** 20 and 0 <= hi < 2 ** 20, lambda: f"{op}: pad values must be in [0, 2^20), got pad={pad}")
        d = input.dim() - 1 - k
        _check(mode != "replicate" or sizes[d] > 0,
               lambda: f"{op}: replicate padding needs the padded dims non-empty, got input.shape={list(input.shape)} "
                       f"and pad={pad}")
        sizes[d] += lo + hi
    plane = sizes[-1] * (sizes[-2] if sd >= 2 else 1)
    _check(plane < 2 ** 31, lambda: f"{op}: the padded output's last two dims must hold fewer than 2^31 elements, "
                                    f"got output shape {sizes}")
    return sizes


def _replicate(y, pad):
    """F.pad(y, pad, 'replicate') for any number of padded trailing dims (F.pad takes only spatial-dims-many)."""
    for k in range(len(pad) // 2):
        d = y.dim() - 1 - k
        n = y.shape[d]
        idx = torch.arange(-pad[2 * k], n + pad[2 * k + 1], device=y.device).clamp_(0, n - 1)
        y = y.index_select(d, idx)
    return y


def pad_output(y, pad, mode, value):
    """F.pad(y, pad, mode, value), contiguous: the op's result from act(group_norm(x)) (CPU kernel, float64 path)."""
    out = _replicate(y, pad) if mode == "replicate" else torch.nn.functional.pad(y, pad, value=float(value))
    return out.contiguous()


def unpad_grad(grad, pad, mode):
    """The gradient of the unpadded tensor from that of F.pad(., pad, mode): the interior, plus (replicate) the sums
    over each halo added onto the edge it copies."""
    for k in range(len(pad) // 2):
        d = grad.dim() - 1 - k
        lo, hi = pad[2 * k], pad[2 * k + 1]
        n = grad.shape[d] - lo - hi
        inner = grad.narrow(d, lo, n)
        if mode == "replicate" and (lo or hi):
            inner = inner.clone()
            if lo:
                inner.narrow(d, 0, 1).add_(grad.narrow(d, 0, lo).sum(d, keepdim=True))
            if hi:
                inner.narrow(d, n - 1, 1).add_(grad.narrow(d, lo + n, hi).sum(d, keepdim=True))
        grad = inner
    return grad.contiguous()


@torch.library.register_fake("gnext::group_norm_act_pad")
def _group_norm_act_pad_fake(input, num_groups, weight, bias, eps, activation, pad, mode, value, input_bias=None):
    sizes = check_pad_args("gnext.group_norm_act_pad", input, pad, mode)
    check_input_bias("gnext.group_norm_act_pad", input, input_bias)
    N, G = input.shape[0], num_groups
    return (input.new_empty(sizes), input.new_empty((N, G), dtype=torch.float32),
            input.new_empty((N, G), dtype=torch.float32))


def group_norm_act_pad(input, num_groups, weight, bias, eps, activation, pad, mode, value, input_bias=None):
    op = "gnext.group_norm_act_pad"
    act = parse_activation(op, activation)
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_pad_args(op, input, pad, mode)
    check_input_bias(op, input, input_bias)
    n, mean, rstd = group_norm_of_biased(op, input, num_groups, weight, bias, eps, input_bias)
    out = apply_act(n, act, inplace=True).to(input.dtype)
    return pad_output(out, [int(p) for p in pad], mode, value), mean, rstd


# group_norm_act_pad(input, num_groups, weight, bias, eps, activation, pad, mode, value, input_bias)
#     -> (out, mean, rstd)
def _pad_save(ctx, inputs, output):
    input, num_groups, weight, bias, _, activation, pad, mode, _ = inputs[:9]
    input_bias = inputs[9] if len(inputs) > 9 else None
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd, input_bias)
    ctx.num_groups, ctx.activation, ctx.pad, ctx.mode = num_groups, activation, [int(p) for p in pad], mode
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _pad_grads(ctx, need, grad_out):
    input, weight, bias, mean, rstd, input_bias = ctx.saved_tensors
    need_b = len(need) > 9 and need[9] and input_bias is not None
    mask = [need[0] or need_b, need[2], need[3]]
    if grad_out is None or not any(mask):
        return (None,) * 10
    input = biased_input(input, input_bias)  # GroupNorm of x + b: its backward in terms of x + b
    g = unpad_grad(grad_out, ctx.pad, ctx.mode)
    dx, dw, db = _call_backward(torch.ops.gnext.group_norm_act_backward.default, g, input, mean, rstd, weight, bias,
                                ctx.num_groups, ctx.activation, mask)
    dib = input_bias_grad(dx, input_bias) if need_b else None
    return (dx if need[0] else None), None, dw, _cast(db, ctx.bias_dtype), None, None, None, None, None, dib


_cpu.register(group_norm_act_pad)
_autograd.register("group_norm_act_pad", _pad_save, _pad_grads, backward_op=False)
_autograd.register_no_autograd("group_norm_act_pad", _group_norm_act_pad_fake, group_norm_act_pad)
