# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm with a spatial modulation, then an activation: out = act(GroupNorm(x + input_bias[c]) * scale + shift),
scale and shift tensors of x's shape, or (4-D and 5-D x) of smaller last two sizes, upsampled to x's by nearest
neighbour as F.interpolate(mode="nearest") does (a spatially conditioned norm: CogVideoX's decoder convolves both
from the latents, Zhu et al. 2022, "MoVQ"); group_norm_act_modulate_into writes the same into a given tensor. The
ops' fake kernels, CPU kernels and autograd (and group_norm_act_modulate_cat's: the output behind a causal convolution's
front frames, torch.cat along dim 2); their schemas are in csrc/gnext.cpp and their CUDA kernels (the
statistics pass, then one pass that reads x, scale and shift and writes out) in csrc/group_norm/group_norm_modulate.cu.
The backward recomputes n = GroupNorm(x + input_bias) from mean/rstd, takes dy' = dy * act'(n * scale + shift),
returns dscale = dy' * n and dshift = dy', and runs GroupNorm's backward on dy' * scale (input_bias's gradient: the
input's, summed per channel); smaller scale and shift are upsampled for it, and their gradients summed back over
each source element (the adjoint of the upsampling: downsample_grad)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _autograd, _cpu
from .._autograd import _call_backward, _cast
from .._cpu import _check, _check_like_input, act_backward, apply_act, biased_input, check_group_norm_args, \
    check_input_bias, check_same_as_input, group_norm_of_biased, input_bias_grad, parse_activation


def _check_one(op, name, t, input):
    """Whether t (scale or shift) is smaller than input: input's shape, or for 4-D and 5-D inputs smaller last two
    sizes (at least 1); input's dtype and device (as the CUDA op checks them)."""
    d = input.dim()
    up, ok = False, t.dim() == d
    for i in range(d) if ok else ():
        if t.shape[i] == input.shape[i]:
            continue
        up = True
        ok = ok and d in (4, 5) and i >= d - 2 and 1 <= t.shape[i] < input.shape[i]
    _check(ok, lambda: f"{op}: {name}.shape={list(t.shape)} must equal input.shape={list(input.shape)} or, for a "
                       "4-D or 5-D input, differ only in smaller last two sizes (nearest upsampling)")
    _check(not up or math.prod(input.shape[2:]) < 2 ** 31 - 4096,
           lambda: f"{op}: {name} smaller than input needs input's per-channel plane below 2^31 elements, got "
                   f"{list(input.shape)}")
    _check_like_input(op, name, t, input)
    return up


def check_modulation(op, input, scale, shift):
    """scale and shift: input's shape, or both the same smaller (h, w) (see _check_one); returns whether smaller."""
    up = _check_one(op, "scale", scale, input)
    _check(_check_one(op, "shift", shift, input) == up and scale.shape == shift.shape,
           lambda: f"{op}: shift.shape={list(shift.shape)} must equal scale.shape={list(scale.shape)}")
    return up


def upsample(t, input):
    """t at input's size by nearest neighbour (F.interpolate(mode="nearest")); t itself where the sizes match."""
    return t if t.shape == input.shape else F.interpolate(t, size=input.shape[2:], mode="nearest")


def _pow2_factor(big, small):
    """big / small where it is a power of two (then F.interpolate's nearest source of output i, floor(i * (float)small
    / big), is exactly i // factor), else None."""
    f = big // small
    return f if f * small == big and f & (f - 1) == 0 else None


def downsample_grad(g, t):
    """The adjoint of upsample(t, g): g summed over the elements that read each element of t. Power-of-two factors
    (the latents' 2x, 4x, 8x) sum blocks of a reshape; others take ATen's upsample_nearest backward, which for a 5-D
    g with symbolic sizes fails PyTorch's own IntList assert (compiled with dynamic shapes)."""
    if g is None or g.shape == t.shape:
        return g
    (h, w), (H, W) = t.shape[-2:], g.shape[-2:]
    fh, fw = _pow2_factor(H, h), _pow2_factor(W, w)
    if fh is not None and fw is not None:
        d = g.dim()
        return g.reshape(*g.shape[:-2], h, fh, w, fw).sum((d - 1, d + 1)).to(t.dtype)
    fn = torch.ops.aten.upsample_nearest3d_backward if t.dim() == 5 else torch.ops.aten.upsample_nearest2d_backward
    return fn(g, list(g.shape[2:]), list(t.shape)).to(t.dtype)


@torch.library.register_fake("gnext::group_norm_act_modulate")
def _modulate_fake(input, num_groups, weight, bias, eps, scale, shift, activation, input_bias=None):
    op = "gnext.group_norm_act_modulate"
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_modulation(op, input, scale, shift)
    check_input_bias(op, input, input_bias)
    N, G = input.shape[0], num_groups
    return (input.new_empty(input.shape), input.new_empty((N, G), dtype=torch.float32),
            input.new_empty((N, G), dtype=torch.float32))


def group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation, input_bias=None):
    op = "gnext.group_norm_act_modulate"
    act = parse_activation(op, activation)
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_modulation(op, input, scale, shift)
    check_input_bias(op, input, input_bias)
    n, mean, rstd = group_norm_of_biased(op, input, num_groups, weight, bias, eps, input_bias)
    scale, shift = upsample(scale, input), upsample(shift, input)
    out = apply_act(torch.addcmul(shift.float(), n.float(), scale.float()), act)
    return out.to(input.dtype).contiguous(), mean, rstd


def check_rows_out(op, out, input):
    """out of group_norm_act_modulate_into: input's shape, dtype and device, each (n, c) plane contiguous and the
    planes apart (as the CUDA op checks it)."""
    check_same_as_input(op, "out", out, input)
    plane, packed = 1, True
    for i in range(out.dim() - 1, 1, -1):
        packed = packed and (out.shape[i] == 1 or out.stride(i) == plane)
        plane *= out.shape[i]
    N, C = out.shape[0], out.shape[1]
    apart = (C <= 1 or out.stride(1) >= plane) and (N <= 1 or out.stride(0) >= (C - 1) * out.stride(1) + plane)
    _check(out.numel() == 0 or (packed and apart),
           lambda: f"{op}: out must have each (n, c) plane contiguous and the planes apart (e.g. a slice along dim 2 "
                   f"of a contiguous tensor); got shape {list(out.shape)} and strides {list(out.stride())}")


@torch.library.register_fake("gnext::group_norm_act_modulate_into")
def _modulate_into_fake(input, num_groups, weight, bias, eps, scale, shift, activation, out, input_bias=None):
    op = "gnext.group_norm_act_modulate_into"
    check_group_norm_args(op, input, num_groups, weight, bias)
    check_modulation(op, input, scale, shift)
    check_input_bias(op, input, input_bias)
    check_rows_out(op, out, input)
    N = input.shape[0]
    return (input.new_empty((N, num_groups), dtype=torch.float32),
            input.new_empty((N, num_groups), dtype=torch.float32))


def group_norm_act_modulate_into(input, num_groups, weight, bias, eps, scale, shift, activation, out,
                                 input_bias=None):
    op = "gnext.group_norm_act_modulate_into"
    check_rows_out(op, out, input)
    y, mean, rstd = group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation,
                                            input_bias)
    out.copy_(y)
    return mean, rstd


def check_cat(op, input, frames, cache):
    """group_norm_act_modulate_cat's own arguments (as the CUDA op checks them): a 5-D input, frames >= 0, and cache
    None (then input has frames to copy where frames > 0) or (N, C, frames, H, W) of input's dtype and device."""
    _check(input.dim() == 5, lambda: f"{op}: input must be 5-D (N, C, T, H, W), got input.shape={list(input.shape)}")
    _check(frames >= 0, lambda: f"{op}: frames must be >= 0, got frames={frames}")
    if cache is None:
        _check(frames == 0 or input.shape[2] > 0,
               lambda: f"{op}: without a cache, frames={frames} copies of the first frame need input frames, got "
                       f"input.shape={list(input.shape)}")
        return
    want = [input.shape[0], input.shape[1], frames, *input.shape[3:]]
    _check(list(cache.shape) == want,
           lambda: f"{op}: cache.shape={list(cache.shape)} must be (N, C, frames, H, W) = {want}")
    _check_like_input(op, "cache", cache, input)


def _cat_front(y, frames, cache):
    """torch.cat([cache, y], 2), or [y[:, :, :1]] * frames before y."""
    front = cache if cache is not None else y[:, :, :1].expand(-1, -1, frames, -1, -1)
    return torch.cat([front, y], dim=2)


@torch.library.register_fake("gnext::group_norm_act_modulate_cat")
def _modulate_cat_fake(input, num_groups, weight, bias, eps, scale, shift, activation, frames, cache,
                       input_bias=None):
    op = "gnext.group_norm_act_modulate_cat"
    check_cat(op, input, frames, cache)
    out, mean, rstd = _modulate_fake(input, num_groups, weight, bias, eps, scale, shift, activation, input_bias)
    N, C, T, H, W = input.shape
    return out.new_empty((N, C, frames + T, H, W)), mean, rstd


def group_norm_act_modulate_cat(input, num_groups, weight, bias, eps, scale, shift, activation, frames, cache,
                                input_bias=None):
    op = "gnext.group_norm_act_modulate_cat"
    check_cat(op, input, frames, cache)
    y, mean, rstd = group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation,
                                            input_bias)
    return _cat_front(y, frames, cache), mean, rstd


# group_norm_act_modulate(input, num_groups, weight, bias, eps, scale, shift, activation, input_bias)
#     -> (out, mean, rstd)
def _modulate_save(ctx, inputs, output):
    input, num_groups, weight, bias, _, scale, shift, activation = inputs[:8]
    input_bias = inputs[8] if len(inputs) > 8 else None
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, scale, shift, mean, rstd, input_bias)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _modulate_grads(ctx, need, grad_out):
    """In the input's dtype, as eager autograd computes the same chain: float32 copies of these full-size tensors
    were 3x slower (docs/decisions/modulated-output.md)."""
    input, weight, bias, scale, shift, mean, rstd, input_bias = ctx.saved_tensors
    none = (None,) * 9
    if grad_out is None or not any(need):
        return none
    input = biased_input(input, input_bias)  # GroupNorm of x + b: its backward in terms of x + b
    need_b = len(need) > 8 and need[8]
    # n = GroupNorm(x) (with its affine), recomputed from mean/rstd.
    n = _call_backward(torch.ops.gnext.group_norm_act_apply.default, input, mean, rstd, ctx.num_groups, weight, bias,
                       "identity", None)
    g = grad_out
    small_scale, small_shift = scale, shift
    scale, shift = upsample(scale, input), upsample(shift, input)
    if ctx.activation != "identity":
        g = act_backward(g.contiguous(), torch.addcmul(shift, n, scale), ctx.activation)
    dscale = downsample_grad(g * n, small_scale) if need[5] else None
    dshift = downsample_grad(g, small_shift) if need[6] else None
    mask = [need[0] or need_b, need[2], need[3]]
    dx = dw = db = None
    if any(mask):
        dx, dw, db = _call_backward(torch.ops.gnext.group_norm_backward.default, g * scale, input, mean, rstd, weight,
                                    ctx.num_groups, mask)
    dib = input_bias_grad(dx, input_bias) if need_b else None
    return (dx if need[0] else None), None, dw, _cast(db, ctx.bias_dtype), None, dscale, dshift, None, dib


# group_norm_act_modulate_cat(input, num_groups, weight, bias, eps, scale, shift, activation, frames, cache,
#     input_bias) -> (out, mean, rstd): group_norm_act_modulate's gradients from the frames after the front ones, plus
#     the front's (summed into the first frame without a cache; the cache's own otherwise).
def _modulate_cat_save(ctx, inputs, output):
    frames, cache = inputs[8], inputs[9]
    input_bias = inputs[10] if len(inputs) > 10 else None
    _modulate_save(ctx, (*inputs[:8], input_bias), output)
    ctx.frames, ctx.cached = frames, cache is not None


def _modulate_cat_grads(ctx, need, grad_out):
    if grad_out is None:
        return (None,) * 11
    k = ctx.frames
    g = grad_out[:, :, k:]
    if not ctx.cached and k > 0:
        g = g.clone()
        g[:, :, :1] += grad_out[:, :, :k].sum(dim=2, keepdim=True)
    need_mod = (*need[:8], need[10] if len(need) > 10 else False)
    grads = _modulate_grads(ctx, need_mod, g) if any(need_mod) else (None,) * 9
    dcache = grad_out[:, :, :k] if ctx.cached and need[9] else None
    return (*grads[:8], None, dcache, grads[8])


_cpu.register(group_norm_act_modulate, group_norm_act_modulate_into, group_norm_act_modulate_cat)
_autograd.register("group_norm_act_modulate", _modulate_save, _modulate_grads, backward_op=False)
_autograd.register_no_autograd("group_norm_act_modulate", _modulate_fake, group_norm_act_modulate)
_autograd.register("group_norm_act_modulate_cat", _modulate_cat_save, _modulate_cat_grads, backward_op=False)
_autograd.register_no_autograd("group_norm_act_modulate_cat", _modulate_cat_fake, group_norm_act_modulate_cat)
_autograd.register_not_differentiable("group_norm_act_modulate_into",
                                      now="it writes into out, which autograd does not record; call "
                                          "group_norm_act_modulate")
