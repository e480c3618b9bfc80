# SPDX-License-Identifier: BSD-3-Clause
"""The autograd machinery of torch.ops.gnext.* (each op's formulas are in ops/<op>.py: save(ctx, args, output)
keeps what the backward needs; grads(ctx, need, grad_out) returns one gradient per op argument, need being
ctx.needs_input_grad of those arguments), registered at the Autograd dispatch key from Python (the stable ABI
the compiled module uses has no C++ autograd). Each forward op saves what its backward op needs and
calls that op from backward; torch.compile/AOTAutograd traces through these kernels (real or fake),
so compiled graphs have no breaks. The *_backward ops are not differentiable themselves: double
backward raises "derivative for gnext::<op>_backward is not implemented".

Gradient slots follow the op's arguments; mean/rstd (and z of the fused conv op) are
non-differentiable outputs, and no zero gradients are materialized for them.

Two entries share each op's save/grads pair: the Autograd-key kernel (_register), which every call of
torch.ops.gnext.* and every compiled graph goes through, and the eager entry of the functional API
(_eager, the dict `eager`), which skips the dispatcher's boxing round trip into that Python kernel.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import _library  # noqa: F401  (loads the compiled module, which defines the schema)


_below = torch._C._AutoDispatchBelowAutograd


def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _call_backward(op, *args):
    """Runs a gnext *_backward op from a backward function. Outside create_graph (grad mode off, the
    usual case) it goes straight below autograd (:func:`_without_autograd`): the op's Autograd kernel is Python,
    and skipping it saves a Python round trip per backward call. With create_graph the Autograd kernel runs (it
    makes double backward raise)."""
    if torch._C.is_grad_enabled():
        return op(*args)
    return _without_autograd(op)(*args)


_runners: dict[Any, Callable[..., Any]] = {}  # OpOverload -> _without_autograd(op)


def _without_autograd(op) -> Callable[..., Any]:
    """A function calling ``op`` where no gradient is to be recorded: its twin of no Autograd kernel where it has one
    (:func:`no_autograd`; 1.1-2.5 µs less host time per call than the guard on four H100 hosts, with the twin ~25%
    under the op through its Python Autograd kernel, docs/decisions/compile-fusion.md), else the op under
    ``_AutoDispatchBelowAutograd``. Looked up at the first call: the twins are registered after the ops' autograd."""
    run = _runners.get(op)
    if run is None:
        twin = no_autograd(op)
        if twin is None:
            def run(*args):
                with _below():
                    return op(*args)
        else:
            run = twin
        _runners[op] = run
    return run




def _register(op_name, save, grads):
    """An Autograd-key kernel for gnext::<op_name>. Without grad mode or an input that requires grad it
    redispatches below autograd at once (no autograd.Function, no context manager); otherwise a
    torch.autograd.Function whose forward redispatches below autograd and saves what the backward needs;
    every output after the first is non-differentiable. (The shape of torch.library.register_autograd,
    which measured ~60 us more host time per call on the CPU machine: it flattens arguments with
    pytrees.)"""
    op = getattr(torch.ops.gnext, op_name).default
    below = torch._C._after_autograd_keyset
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad

    def forward(ctx, keyset, *args):
        output = op.redispatch(keyset & below, *args)
        save(ctx, args, output)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        return output

    def backward(ctx, grad_out, *_):
        return (None, *grads(ctx, ctx.needs_input_grad[1:], grad_out))  # [0]: the keyset

    fn = type(f"{op_name}_autograd", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def kernel(keyset, *args):
        if grad_enabled() and any_requires_grad(*args):
            return fn.apply(keyset, *args)
        return op.redispatch(keyset & below, *args)

    _lib.impl(op_name, kernel, "Autograd", with_keyset=True)


def _c_apply(cls):
    """``cls.apply`` without the Python layer that ``torch.autograd.Function.apply`` has before torch
    2.14 (binding default arguments for ``setup_context``, which these Functions do not define, and a
    pytree pass that unwraps dead functorch wrappers, which only exist under functorch transforms, and
    those calls take the op instead): the C function ``_FunctionBase.apply`` that torch 2.14 assigns to
    ``Function.apply`` itself. Host time per GroupNorm+SiLU layer: see docs/benchmarks.md."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)


def _eager(op_name, save, grads):
    """``torch.ops.gnext.<op_name>(*args)[0]`` for the functional API, with less host time in eager mode.

    Called through the dispatcher, the op's Autograd kernel (above) is a Python function: the dispatcher
    boxes the arguments to Python, the kernel redispatches, and the outputs are boxed back, around an
    autograd.Function with three outputs. In eager mode this entry skips that round trip: with grad
    needed, an autograd.Function whose forward calls the op below autograd and that returns only the
    output; without, the op below autograd directly. Measured on the CPU machine with no-op kernels:
    forward+backward 68-76 -> 60-61 us per call (interleaved runs), F.group_norm's 52-53 us (its kernels
    included).

    Under torch.compile / export (Dynamo traces the op, whose Autograd kernel AOTAutograd uses),
    functorch transforms, and for tensor subclasses (whose __torch_function__ must see the op), it calls
    the op as before."""
    op = getattr(torch.ops.gnext, op_name).default
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
    functorch_active, is_compiling, Tensor = torch._C._are_functorch_transforms_active, torch.compiler.is_compiling, \
        torch.Tensor

    def forward(ctx, *args):
        output = _without_autograd(op)(*args)  # grad mode is off in a Function's forward
        save(ctx, args, output)
        return output[0]

    def backward(ctx, grad_out):
        return grads(ctx, ctx.needs_input_grad, grad_out)

    apply = _c_apply(type(f"{op_name}_eager", (torch.autograd.Function,),
                          {"forward": staticmethod(forward), "backward": staticmethod(backward)}))

    def call(*args):
        if is_compiling() or type(args[0]) is not Tensor or functorch_active():
            return op(*args)[0]
        if grad_enabled() and any_requires_grad(*args):
            return apply(*args)
        return _without_autograd(op)(*args)[0]

    call.__name__ = call.__qualname__ = f"{op_name}_eager"
    return call


class _NotDifferentiable(torch.autograd.Function):
    """Runs a backward op so that its outputs carry a grad_fn, whose backward raises (double backward)."""

    @staticmethod
    def forward(ctx, name, *args):
        ctx.name = name
        return getattr(torch.ops.gnext, name).default(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"derivative for gnext::{ctx.name} is not implemented")


def register_not_differentiable(op_name, now: str | None = None):
    """An Autograd kernel for gnext::<op_name> whose outputs' backward raises (ops whose gradient is another
    op's business: the backward ops, the pieces of the split GroupNorm). now: raise at once where a gradient would
    be needed, saying this (ops that write into a given tensor, whose writes autograd does not record)."""
    op = getattr(torch.ops.gnext, op_name).default
    below = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        if torch._C.is_grad_enabled() and torch._C._any_requires_grad(*args):
            if now is not None:
                raise RuntimeError(f"gnext.{op_name} is not differentiable: {now}")
            return _NotDifferentiable.apply(op_name, *args)  # backward with create_graph=True
        return op.redispatch(keyset & below, *args)

    _lib.impl(op_name, kernel, "Autograd", with_keyset=True)


_lib = torch.library.Library("gnext", "IMPL")  # kept alive with the module
eager: dict[str, Callable[..., Any]] = {}  # op name -> the functional API's eager entry (_eager)


def register_no_autograd(op_name: str, fake, cpu) -> None:
    """The fake and CPU kernels of gnext::<op_name>_no_autograd: <op_name>'s kernels without its Autograd kernel
    (csrc/gnext.cpp), called by graphs that AOTAutograd has differentiated already (:func:`no_autograd`)."""
    twin = f"{op_name}_no_autograd"
    torch.library.register_fake(f"gnext::{twin}", fake, lib=_lib)
    _lib.impl(twin, cpu, "CPU")
    _no_autograd[op_name] = twin


_no_autograd: dict[str, str] = {}  # op name -> its twin's name (register_no_autograd)


def no_autograd(op: Any) -> Any:
    """The twin of no Autograd kernel of a gnext OpOverload (``torch.ops.gnext.group_norm_act.default`` ->
    ``torch.ops.gnext.group_norm_act_no_autograd.default``), or None where it has none. Its Autograd kernel is a
    Python function whose host time (6-12 us per call on an H100) a differentiated graph has no use for; PyTorch's
    C++ autograd fallback passes the twin through (it warns at backward if a gradient ever flows through one)."""
    if getattr(op, "namespace", None) != "gnext" or getattr(op, "_overloadname", None) != "default":
        return None
    twin = _no_autograd.get(op._opname)
    return None if twin is None else getattr(torch.ops.gnext, twin).default


def register(op_name, save, grads, backward_op: bool = True) -> None:
    """Autograd for gnext::<op_name> from its save/grads pair (ops/<op>.py), its backward op (gnext::<op_name>_backward,
    where backward_op) marked not differentiable, and the functional API's eager entry."""
    _register(op_name, save, grads)
    if backward_op:
        register_not_differentiable(f"{op_name}_backward")
    eager[op_name] = _eager(op_name, save, grads)
