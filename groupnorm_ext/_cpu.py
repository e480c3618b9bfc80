# SPDX-License-Identifier: BSD-3-Clause
"""What the CPU kernels of torch.ops.gnext.* share (each op's own kernel is in ops/<op>.py): the argument
checks, GroupNorm forward and backward on ATen's CPU kernels (centred float32 math at large means), the
activations and their derivatives. They are Python because the compiled module uses only PyTorch's stable ABI
(csrc/common/stable.h), which offers no ATen math.

The argument checks raise the same messages as the CUDA implementations (csrc/group_norm/group_norm.h,
csrc/group_norm_act/group_norm_act_lse.cpp, csrc/conv_gelu_gn/conv_gelu_gn_cuda.cpp); tests/test_errors.py
runs every message on both devices.

GroupNorm (Wu & He 2018): out = (x - mean[n, g]) * rstd[n, g] * weight[c] + bias[c], with mean and
the biased variance over the D = C / G channels x HxW elements of each group, rstd = 1 / sqrt(var + eps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._library import ACTIVATIONS as _ACTIVATIONS
from ._library import memory_format as _memory_format

_DTYPE_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
                torch.int32: "Int", torch.int64: "Long", torch.int16: "Short", torch.int8: "Char",
                torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat"}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dt(t: torch.Tensor | torch.dtype) -> str:
    """The dtype as c10 prints it (the C++ messages' spelling)."""
    d = t if isinstance(t, torch.dtype) else t.dtype
    return _DTYPE_NAMES.get(d, str(d))


def _check(cond: bool, msg) -> None:
    if not cond:
        raise RuntimeError(msg() if callable(msg) else msg)


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


# ------------------------------------------------------------------------------------------------
# Checks (same rules and messages as C++)

def _check_like_input(op, name, t, input):
    """t must have input's dtype and device."""
    _check(t.dtype == input.dtype, lambda: f"{op}: {name} dtype ({_dt(t)}) must equal input dtype ({_dt(input)})")
    _check(t.device == input.device, lambda: f"{op}: {name} is on {t.device} but input is on {input.device}")


def check_group_norm_args(op, input, num_groups, weight, bias):
    """Returns (N, C, G, D, HxW)."""
    _check(input.dim() >= 2, lambda: f"{op}: input must have shape (N, C, *) with at least 2 dims, got "
                                     f"input.dim()={input.dim()} (shape {_shape(input)})")
    _check(input.dtype in _FLOAT_DTYPES,
           lambda: f"{op}: input dtype must be float32, float16 or bfloat16, got {_dt(input)}")
    _check(num_groups > 0, lambda: f"{op}: num_groups must be positive, got num_groups={num_groups}")
    N, C = input.shape[0], input.shape[1]
    _check(C % num_groups == 0, lambda: f"{op}: num_channels C={C} must be divisible by num_groups={num_groups} "
                                        f"(input shape {_shape(input)})")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        _check(t.dim() == 1 and t.shape[0] == C,
               lambda: f"{op}: {name} must have shape (C,) = ({C}), got {name}.shape={_shape(t)}")
        _check(t.device == input.device, lambda: f"{op}: {name} is on {t.device} but input is on {input.device}")
        _check(t.dtype == input.dtype or t.dtype == torch.float32,
               lambda: f"{op}: {name} dtype must match input ({_dt(input)}) or be float32, got {_dt(t)}")
    if weight is not None and bias is not None:
        _check(weight.dtype == bias.dtype,
               lambda: f"{op}: weight ({_dt(weight)}) and bias ({_dt(bias)}) must have the same dtype")
    HxW = 1
    for d in input.shape[2:]:
        HxW *= d
    return N, C, num_groups, C // num_groups, HxW


def check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups):
    s = check_group_norm_args(op, input, num_groups, weight, None)
    _check(grad_out.shape == input.shape,
           lambda: f"{op}: grad_out.shape={_shape(grad_out)} must equal input.shape={_shape(input)}")
    _check_like_input(op, "grad_out", grad_out, input)
    check_stats_args(op, s, input, mean, rstd)
    return s


def check_stats_args(op, s, input, mean, rstd):
    """mean / rstd: float32 with N*G elements on input's device."""
    N, G = s[0], s[2]
    for t, name in ((mean, "mean"), (rstd, "rstd")):
        _check(t.dtype == torch.float32, lambda: f"{op}: {name} must be float32, got {_dt(t)}")
        _check(t.numel() == N * G, lambda: f"{op}: {name} must have N*G={N * G} elements, got shape {_shape(t)}")
        _check(t.device == input.device, lambda: f"{op}: {name} is on {t.device} but input is on {input.device}")


def check_same_as_input(op, name, t, input):
    """t (the residual, a modulation's scale or shift) must have input's shape, dtype and device."""
    _check(t.shape == input.shape, lambda: f"{op}: {name}.shape={_shape(t)} must equal input.shape={_shape(input)}")
    _check_like_input(op, name, t, input)


def check_residual(op, input, residual):
    if residual is not None:
        check_same_as_input(op, "residual", residual, input)


def parse_activation(op, activation):
    _check(activation in _ACTIVATIONS, lambda: f"{op}: activation must be one of {', '.join(_ACTIVATIONS)}; "
                                               f"got '{activation}'")
    return activation


def check_input_bias(op, input, input_bias):
    """input_bias (a per-channel bias that input does not hold yet): None, or (C,) of input's dtype or float32 on
    input's device."""
    if input_bias is None:
        return
    b, C = input_bias, input.shape[1]
    _check(b.dim() == 1 and b.shape[0] == C,
           lambda: f"{op}: input_bias must have shape (C,) = ({C}), got input_bias.shape={_shape(b)}")
    _check(b.device == input.device, lambda: f"{op}: input_bias is on {b.device} but input is on {input.device}")
    _check(b.dtype == input.dtype or b.dtype == torch.float32,
           lambda: f"{op}: input_bias dtype must match input ({_dt(input)}) or be float32, got {_dt(b)}")


def channel_view(b, input):
    """b (C,) viewed to broadcast over input (N, C, *)."""
    return b.view((1, -1) + (1,) * (input.dim() - 2))


def group_norm_of_biased(op, input, num_groups, weight, bias, eps, input_bias):
    """_group_norm of input + input_bias[c] (of input where None), the sum and the parameters in float32, as the
    CUDA kernels add it."""
    if input_bias is None:
        return _group_norm(op, input, num_groups, weight, bias, eps)
    x = input.float() + channel_view(input_bias.float(), input)
    w, b = (None if t is None else t.float() for t in (weight, bias))
    return _group_norm(op, x, num_groups, w, b, eps)


def biased_input(input, input_bias):
    """input + input_bias[c] in input's dtype (as eager's convolution output holds its bias), for the backward
    ops, which recompute the normalized values from it; input itself where None."""
    return input if input_bias is None else input + channel_view(input_bias.to(input.dtype), input)


def input_bias_grad(dx, input_bias):
    """The gradient of input_bias from that of input + input_bias[c]: dx summed over all but the channel, in the
    bias's dtype."""
    return dx.sum(dim=[d for d in range(dx.dim()) if d != 1], dtype=torch.float32).to(input_bias.dtype)


def check_lse_args(op, input, input_bias, num_groups, weight, bias):
    s = check_group_norm_args(op, input, num_groups, weight, bias)
    check_input_bias(op, input, input_bias)
    return s


def _lse_out_shape(input):
    return [input.shape[0], 1, *input.shape[2:]]


def check_lse_backward_args(op, s, input, grad_out, out, mean, rstd):
    want = _lse_out_shape(input)
    for t, name in ((grad_out, "grad_out"), (out, "out")):
        _check(list(t.shape) == want, lambda: f"{op}: {name}.shape={_shape(t)} must be (N, 1, *) = {want}")
        _check_like_input(op, name, t, input)
    NG = s[0] * s[2]
    for t, name in ((mean, "mean"), (rstd, "rstd")):
        _check(t.dtype == torch.float32 and t.numel() == NG,
               lambda: f"{op}: {name} must be float32 with N*G={NG} elements, got {_dt(t)} of shape {_shape(t)}")
        _check(t.device == input.device, lambda: f"{op}: {name} is on {t.device} but input is on {input.device}")


def check_conv_args(op, input, weight, conv_bias, stride, padding, output_padding, dilation, groups):
    _check(input.dim() == 4, lambda: f"{op}: input must be (N, C_in, H, W), got input.dim()={input.dim()} "
                                     f"(shape {_shape(input)})")
    _check(input.dtype in _FLOAT_DTYPES,
           lambda: f"{op}: input dtype must be float32, float16 or bfloat16, got {_dt(input)}")
    _check(weight.dim() == 4, lambda: f"{op}: weight must be (C_in, C_out / groups, kH, kW), got shape "
                                      f"{_shape(weight)}")
    _check_like_input(op, "weight", weight, input)
    _check(groups > 0 and input.shape[1] % groups == 0 and weight.shape[0] == input.shape[1],
           lambda: f"{op}: weight.shape[0]={weight.shape[0]} must equal C_in={input.shape[1]} and C_in must be "
                   f"divisible by groups={groups}")
    for lst, name in ((stride, "stride"), (padding, "padding"), (output_padding, "output_padding"),
                      (dilation, "dilation")):
        _check(len(lst) == 2, lambda: f"{op}: {name} must have 2 elements, got {list(lst)}")
    c_out = weight.shape[1] * groups
    if conv_bias is not None:
        _check(conv_bias.dim() == 1 and conv_bias.shape[0] == c_out,
               lambda: f"{op}: conv_bias must have shape (C_out,) = ({c_out}), got {_shape(conv_bias)}")
        _check_like_input(op, "conv_bias", conv_bias, input)


def _gelu_approximate(op, approximate):
    _check(approximate in ("none", "tanh"),
           lambda: f"{op}: approximate must be 'none' or 'tanh' (as in F.gelu), got '{approximate}'")
    return approximate


def _param_grad_dtype(input, weight):
    return weight.dtype if weight is not None else input.dtype


# ------------------------------------------------------------------------------------------------
# Composites


def _aten_stat_params(input, C):
    """Unit weight/bias for ATen's CPU kernels, float32 for 16-bit inputs: its statistics then come back float32
    (gnext's contract) and its math runs in float32."""
    pdt = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    return torch.ones(C, dtype=pdt), torch.zeros(C, dtype=pdt)


def _canonical(t, fmt):
    """t with the canonical strides of its layout `fmt` (a view). A tensor dense in a layout may carry any stride on
    a dim of size 1 (a reshape of a transpose at N = 1: (64, 1, 512, 64) for 1x64x4x8 channels_last); ATen's CPU
    GroupNorm in torch 2.11 then finds it contiguous in neither layout and raises."""
    canon = torch.empty(t.shape, device="meta", memory_format=fmt).stride()
    return t if t.stride() == canon else t.as_strided(t.shape, canon)


def _aten_input(t):
    """t as ATen's CPU GroupNorm kernels take it: NCHW-contiguous. (Their channels_last forward computes the
    variance as E[x^2] - E[x]^2, which cancels at large means: rstd off by 300x at mean 1e4, std 1.)"""
    return t.contiguous()


# ATen's CPU GroupNorm computes out = x * a + b and its backward sums dy * x: both cancel where a group's mean is
# large against its spread, losing about 2^-24 * |mean| * rstd of relative precision. Up to _ATEN_MAX_SHIFT
# (|mean| * rstd, any group) that is below 4e-6 and ATen's kernels run as they are (eager's speed); beyond it
# gnext centres x first. Channels_last takes ATen's kernels only to 8: its forward's variance is E[x^2] - E[x]^2,
# whose error grows with the square, and its backward's dgamma errs ~3x NCHW's at the same shift (4.6e-6 at 8).
_ATEN_MAX_SHIFT = 64.0
_ATEN_MAX_SHIFT_CL = 8.0


def _shift(mean, rstd):
    """max over groups of |mean| * rstd (NaN where a statistic is NaN or there is no group: never below a limit)."""
    return float((mean.float().abs() * rstd.float()).max()) if mean.numel() else float("nan")


def _group_norm(op, input, num_groups, weight, bias, eps):
    """ATen's CPU GroupNorm (vectorized, Welford statistics) with float32 parameters, so that mean/rstd come back
    float32; where a group's mean is large against its spread (_ATEN_MAX_SHIFT), out = (x - mean) * (rstd *
    gamma) + beta in float32 instead: ATen's x * a + b cancels there (a constant group gave beta +- 3e-5 at mean
    7, rstd 316). gnext's contract: mean/rstd (N, G) float32, out in _memory_format(input)."""
    s = check_group_norm_args(op, input, num_groups, weight, bias)
    N, C, G, D, HxW = s
    fmt = _memory_format(input)
    if input.numel() == 0:
        nan = torch.full((N, G), float("nan"))
        return torch.empty(input.shape, dtype=input.dtype, memory_format=fmt), nan, nan.clone()
    w, b = _aten_stat_params(input, C)
    cl = fmt != torch.contiguous_format
    if input.is_contiguous() or cl:
        input = _canonical(input, fmt)
        wf = w if weight is None else weight.float()
        bf = b if bias is None else bias.float()
        out, mu, r = torch.ops.aten.native_group_norm(input, wf, bf, N, C, HxW, G, eps)
        if _shift(mu, r) <= (_ATEN_MAX_SHIFT_CL if cl else _ATEN_MAX_SHIFT):
            return out.contiguous(memory_format=fmt), mu.float(), r.float()
    if cl or not input.is_contiguous():  # statistics from the NCHW kernel (Welford; its CL one is not)
        _, mu, r = torch.ops.aten.native_group_norm(_aten_input(input), w, b, N, C, HxW, G, eps)
    mu, r = mu.float(), r.float()
    y = _normalized(input.float(), s, mu, r, weight, bias)
    out = torch.empty(input.shape, dtype=input.dtype, memory_format=fmt)
    out.copy_(y)
    return out, mu, r


def _group_norm_backward(op, grad_out, input, mean, rstd, weight, num_groups, output_mask):
    """ATen's CPU GroupNorm backward on gnext's float32 mean/rstd, NCHW or channels_last (whose dgamma's error is
    ~3x NCHW's at the same shift, hence its lower limit); beyond _ATEN_MAX_SHIFT(_CL) fed x - mean (float32) and a
    zero mean instead: its formulas use sum(dy * x) and x * c2 + c3, which cancel at large means
    (grad_weight off by 2e-2 at mean 1000 where the exact value is 0); the gradients depend on x only through
    x - mean."""
    s = check_group_norm_backward_args(op, grad_out, input, mean, rstd, weight, num_groups)
    N, C, G, D, HxW = s
    pdtype = _param_grad_dtype(input, weight)
    fmt = _memory_format(input)
    if input.numel() == 0:
        zeros = lambda wanted: torch.zeros(C, dtype=pdtype) if wanted else None  # noqa: E731
        dx = torch.empty(input.shape, dtype=input.dtype, memory_format=fmt) if output_mask[0] else None
        return dx, zeros(output_mask[1]), zeros(output_mask[2])
    w = torch.ones(C) if weight is None else weight.float()
    mask = [output_mask[0], output_mask[1], output_mask[2]]
    cl = fmt != torch.contiguous_format
    if (input.is_contiguous() or cl) and _shift(mean, rstd) <= (_ATEN_MAX_SHIFT_CL if cl else _ATEN_MAX_SHIFT):
        dx, dgamma, dbeta = torch.ops.aten.native_group_norm_backward(
            _canonical(grad_out.contiguous(memory_format=fmt), fmt), _canonical(input, fmt),
            mean.float().contiguous(), rstd.float().contiguous(), w, N, C, HxW, G, mask)
    else:
        xc = (input.float().reshape(N, G, -1) - mean.float().reshape(N, G, 1)).reshape(input.shape).contiguous()
        dx, dgamma, dbeta = torch.ops.aten.native_group_norm_backward(
            grad_out.float().contiguous(), xc, torch.zeros(N, G), rstd.float().contiguous(), w, N, C, HxW, G, mask)
    if dx is not None:
        # A group of one element normalizes to 0 whatever x is: grad_input is exactly 0 (as on CUDA).
        dx = torch.zeros_like(dx) if D * HxW == 1 else dx
        dx = dx.to(input.dtype).contiguous(memory_format=fmt)
    return dx, None if dgamma is None else dgamma.to(pdtype), None if dbeta is None else dbeta.to(pdtype)


def apply_act(n, act, inplace=False):
    """act(n); with inplace, written over n (a temporary of the caller's: one full-size allocation fewer, whose
    page faults cost the CPU kernels as much as a pass)."""
    if act == "silu":
        return F.silu(n, inplace=inplace)
    if act == "gelu":
        return torch.ops.aten.gelu_(n) if inplace else F.gelu(n)
    if act == "gelu_tanh":
        return torch.ops.aten.gelu_(n, approximate="tanh") if inplace else F.gelu(n, approximate="tanh")
    if act == "relu":
        return torch.relu_(n) if inplace else torch.relu(n)
    if act == "tanh":
        return torch.tanh_(n) if inplace else torch.tanh(n)
    if act == "hardswish":
        return F.hardswish(n, inplace=inplace)
    if act == "tanh_hardswish":
        return F.hardswish(torch.tanh_(n) if inplace else torch.tanh(n), inplace=True)
    return n


_aten = torch.ops.aten
# act -> (its derivative's op, the op's extra arguments): act_backward calls op(g, n, *args, **kwargs), or its out
# overload (`out` for hardswish, `grad_input` for the others).
_ACT_DERIVATIVES = {
    "silu": (_aten.silu_backward, (), {}),
    "gelu": (_aten.gelu_backward, (), {"approximate": "none"}),
    "gelu_tanh": (_aten.gelu_backward, (), {"approximate": "tanh"}),
    "relu": (_aten.threshold_backward, (0,), {}),
    "hardswish": (_aten.hardswish_backward, (), {}),
}


def act_backward(g, n, act, out=None):
    """dL/dn from g = dL/d act(n): g itself for the identity; else into out where given (the CPU kernels pass n
    itself: each element of n is read before its own is written), or a new tensor."""
    if act == "identity":
        return g
    if act in ("tanh", "tanh_hardswish"):
        t = torch.tanh_(n) if out is n else torch.tanh(n)
        if act == "tanh_hardswish":
            g = _aten.hardswish_backward(g, t)
        return _aten.tanh_backward(g, t) if out is None else _aten.tanh_backward.grad_input(g, t, grad_input=out)
    op, args, kwargs = _ACT_DERIVATIVES[act]
    if out is None:
        return op(g, n, *args, **kwargs)
    if act == "hardswish":
        return op.out(g, n, *args, **kwargs, out=out)
    return op.grad_input(g, n, *args, **kwargs, grad_input=out)


def _normalized(v, s, mean, rstd, weight, bias):
    """GroupNorm(v) in float32 from mean/rstd (v float32, any layout; the result in v's): v * a[n, c] + b[n, c], as
    ATen's forward computes it, where that is exact enough (_ATEN_MAX_SHIFT); beyond it (v - mean) * a + beta, whose
    error does not grow with the mean. A product and an in-place sum with (N, C, 1, ...) coefficients run ATen's
    vectorized loops in either layout (addcmul, with two broadcast operands, does not: 1.1-2.4x slower)."""
    N, C, G, D, HxW = s
    shape = (N, C) + (1,) * (v.dim() - 2)
    a = rstd.float().reshape(N, G, 1).expand(N, G, D)
    a = (a if weight is None else a * weight.float().view(1, G, D)).reshape(shape)
    mu = mean.float().reshape(N, G, 1).expand(N, G, D).reshape(shape)
    beta = None if bias is None else bias.float().view((1, C) + shape[2:])
    if _shift(mean, rstd) <= _ATEN_MAX_SHIFT:
        return (v * a).add_(-mu * a if beta is None else beta - mu * a)
    n = (v - mu).mul_(a)
    return n if beta is None else n.add_(beta)


_lib = torch.library.Library("gnext", "IMPL")  # kept alive with the module


def register(*fns) -> None:
    """Registers each function as the CPU kernel of the gnext op of its name."""
    for fn in fns:
        _lib.impl(fn.__name__, fn, "CPU")
