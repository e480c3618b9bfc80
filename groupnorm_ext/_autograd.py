"""Autograd of torch.ops.gnext.*, registered at the Autograd dispatch key from Python (the stable ABI
the compiled module uses has no C++ autograd). Each forward op saves what its backward op needs and
calls that op from backward; torch.compile/AOTAutograd traces through these kernels (real or fake),
so compiled graphs have no breaks. The *_backward ops are not differentiable themselves: double
backward raises "derivative for gnext::<op>_backward is not implemented".

Gradient slots follow the op's arguments; mean/rstd (and z of the fused conv op) are
non-differentiable outputs, and no zero gradients are materialized for them.
"""
from __future__ import annotations

import torch

from . import _ops  # noqa: F401  (the schema is defined by the compiled module)


def _setup(ctx, output, n_outputs_nondiff):
    ctx.mark_non_differentiable(*output[len(output) - n_outputs_nondiff:])
    ctx.set_materialize_grads(False)


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def _call_backward(op, *args):
    """Runs a gnext *_backward op from a backward function. Outside create_graph (grad mode off, the
    usual case) it goes straight below autograd: the op's Autograd kernel is Python, and skipping it
    saves a Python round trip per backward call. With create_graph the Autograd kernel runs (it makes
    double backward raise)."""
    if torch._C.is_grad_enabled():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


# group_norm(input, num_groups, weight, bias, eps) -> (out, mean, rstd)
def _gn_setup(ctx, inputs, output):
    input, num_groups, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, mean, rstd)
    ctx.num_groups = num_groups
    ctx.bias_dtype = bias.dtype if bias is not None else None
    _setup(ctx, output, 2)


def _gn_backward(ctx, grad_out, _gmean, _grstd):
    input, weight, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad[1:]  # [0]: the dispatch keyset (see _register)
    mask = [need[0], need[2], need[3]]
    if grad_out is None or not any(mask):
        return None, None, None, None, None
    dx, dw, db = _call_backward(torch.ops.gnext.group_norm_backward.default, grad_out, input, mean, rstd, weight,
                                ctx.num_groups, mask)
    return dx, None, dw, _cast(db, ctx.bias_dtype), None


# group_norm_act(input, num_groups, weight, bias, eps, activation, residual) -> (out, mean, rstd)
def _act_setup(ctx, inputs, output):
    input, num_groups, weight, bias, _, activation, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.bias_dtype = bias.dtype if bias is not None else None
    _setup(ctx, output, 2)


def _act_backward(ctx, grad_out, _gmean, _grstd):
    input, weight, bias, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad[1:]  # [0]: the dispatch keyset (see _register)
    if grad_out is None:
        return (None,) * 7
    dres = grad_out if need[6] else None  # the residual's gradient is grad_out itself
    mask = [need[0], need[2], need[3]]
    if not any(mask):
        return None, None, None, None, None, None, dres
    dx, dw, db = _call_backward(torch.ops.gnext.group_norm_act_backward.default, grad_out, input, mean, rstd, weight,
                                bias, ctx.num_groups, ctx.activation, mask)
    return dx, None, dw, _cast(db, ctx.bias_dtype), None, None, dres


# group_norm_act_logsumexp(input, input_bias, num_groups, weight, bias, eps, activation, residual)
#   -> (out, mean, rstd)
def _lse_setup(ctx, inputs, output):
    input, input_bias, num_groups, weight, bias, _, activation, residual = inputs
    out, mean, rstd = output
    ctx.save_for_backward(input, input_bias, weight, bias, out, mean, rstd)
    ctx.num_groups, ctx.activation, ctx.residual = num_groups, activation, residual
    ctx.bias_dtype = bias.dtype if bias is not None else None
    _setup(ctx, output, 2)


def _lse_backward(ctx, grad_out, _gmean, _grstd):
    input, input_bias, weight, bias, out, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad[1:]  # [0]: the dispatch keyset (see _register)
    mask = [need[0], need[1], need[3], need[4]]
    if grad_out is None or not any(mask):
        return (None,) * 8
    dx, dib, dw, db = _call_backward(
        torch.ops.gnext.group_norm_act_logsumexp_backward.default,
        grad_out, out, input, input_bias, mean, rstd, weight, bias, ctx.num_groups, ctx.activation, ctx.residual,
        mask)
    return dx, dib, None, dw, _cast(db, ctx.bias_dtype), None, None, None


# conv_transpose2d_gelu_group_norm(input, weight, conv_bias, stride, padding, output_padding, dilation, groups,
#   num_groups, gn_weight, gn_bias, eps, approximate) -> (out, z, mean, rstd)
def _conv_setup(ctx, inputs, output):
    (input, weight, conv_bias, stride, padding, output_padding, dilation, groups, num_groups, gn_weight, gn_bias, _,
     approximate) = inputs
    _, z, mean, rstd = output
    ctx.save_for_backward(input, weight, conv_bias, z, mean, rstd, gn_weight)
    ctx.args = (stride, padding, output_padding, dilation, groups, num_groups, approximate)
    ctx.gn_bias_dtype = gn_bias.dtype if gn_bias is not None else None
    _setup(ctx, output, 3)


def _conv_backward(ctx, grad_out, _gz, _gmean, _grstd):
    input, weight, conv_bias, z, mean, rstd, gn_weight = ctx.saved_tensors
    need = ctx.needs_input_grad[1:]  # [0]: the dispatch keyset (see _register)
    mask = [need[0], need[1], need[2], need[9], need[10]]
    if grad_out is None or not any(mask):
        return (None,) * 13
    stride, padding, output_padding, dilation, groups, num_groups, approximate = ctx.args
    di, dw, db, dgw, dgb = _call_backward(
        torch.ops.gnext.conv_transpose2d_gelu_group_norm_backward.default,
        grad_out, input, weight, conv_bias, z, mean, rstd, gn_weight, stride, padding, output_padding, dilation,
        groups, num_groups, approximate, mask)
    return di, dw, db, None, None, None, None, None, None, dgw, _cast(dgb, ctx.gn_bias_dtype), None, None


def _register(op_name, setup_context, backward):
    """An Autograd-key kernel for gnext::<op_name>. Without grad mode or an input that requires grad it
    redispatches below autograd at once (no autograd.Function, no context manager); otherwise a
    torch.autograd.Function whose forward redispatches below autograd and saves through setup_context.
    (The shape of torch.library.register_autograd, which measured ~60 us more host time per call on
    the CPU machine: it flattens arguments with pytrees.)"""
    op = getattr(torch.ops.gnext, op_name).default
    below = torch._C._after_autograd_keyset
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad

    def forward(ctx, keyset, *args):
        output = op.redispatch(keyset & below, *args)
        setup_context(ctx, args, output)
        return output

    def backward_with_keyset(ctx, *grads):
        return (None, *backward(ctx, *grads))

    fn = type(f"{op_name}_autograd", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(backward_with_keyset)})

    def kernel(keyset, *args):
        if grad_enabled() and any_requires_grad(*args):
            return fn.apply(keyset, *args)
        return op.redispatch(keyset & below, *args)

    _lib.impl(op_name, kernel, "Autograd", with_keyset=True)


class _NotDifferentiable(torch.autograd.Function):
    """Runs a backward op so that its outputs carry a grad_fn, whose backward raises (double backward)."""

    @staticmethod
    def forward(ctx, name, *args):
        ctx.name = name
        return getattr(torch.ops.gnext, name).default(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"derivative for gnext::{ctx.name} is not implemented")


def _register_not_differentiable(op_name):
    op = getattr(torch.ops.gnext, op_name).default
    below = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        if torch._C.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return _NotDifferentiable.apply(op_name, *args)  # backward with create_graph=True
        return op.redispatch(keyset & below, *args)

    _lib.impl(op_name, kernel, "Autograd", with_keyset=True)


_lib = torch.library.Library("gnext", "IMPL")  # kept alive with the module
for _op, _bwd, _setup_fn in (("group_norm", _gn_backward, _gn_setup),
                             ("group_norm_act", _act_backward, _act_setup),
                             ("group_norm_act_logsumexp", _lse_backward, _lse_setup),
                             ("conv_transpose2d_gelu_group_norm", _conv_backward, _conv_setup)):
    _register(_op, _setup_fn, _bwd)
    _register_not_differentiable(f"{_op}_backward")
