# SPDX-License-Identifier: BSD-3-Clause
"""torch.compile fusion of GroupNorm + activation (+ residual add) into ``gnext::group_norm_act``,
without model edits: :func:`enable_compile_fusion` installs a graph pass in Inductor's
``pre_grad_custom_pass`` hook.

Where the pass sits: the pre-grad graph is the one Dynamo hands to Inductor, before AOTAutograd.
It still holds torch-level calls (modules inlined: ``F.group_norm``, ``F.silu``, ``operator.add``), so
a diffusers ``ResnetBlock2D``'s ``norm1`` -> ``nonlinearity`` shows up as a pair there; the
post-grad graphs hold GroupNorm decomposed into ``var_mean``/``rsqrt``/``mul`` already. Rewriting to
the gnext op before AOTAutograd makes training graphs use gnext's backward through the op's
registered autograd. The pass is a ``CustomGraphPass`` with a ``uuid()``, so Inductor's FX-graph
cache stays on (a pass without one bypasses the cache).

Rewritten chain: ``act(group_norm(x, G, weight, bias, eps))`` and ``act(...) + r`` (either operand
order), where ``act`` is SiLU, GELU (erf or tanh), ReLU, tanh or hardswish called as a function,
an inlined module or a tensor method, and each intermediate has no other user. The rule of
``when="auto"`` (where gnext is the faster choice) is in :func:`_fusable`.

Where the activation's output (through dropouts that do nothing) goes only into ``F.pad`` (replicate or constant,
non-negative sizes: a video VAE's causal convolution) and x is a contiguous 3-D or 5-D tensor, the chain becomes
``gnext::group_norm_act_pad``, which writes the padded tensor itself: no unpadded intermediate, and no padding pass
over it (:func:`_take_pad` says why not 4-D).

Where ``x`` is a convolution's output (``conv1d``/``conv2d``/``conv3d`` with a bias) that only the GroupNorm
reads, the convolution runs without its bias and the op adds it as it reads (``input_bias``): Inductor runs a
convolution's bias as a pointwise pass that it fuses into the consumers, and gnext's op is not one it can fuse
into, so the bias was a read and a write of the tensor of its own (docs/decisions/compile-fusion.md).

Where the GroupNorm's output is multiplied by ``scale`` and ``shift`` is added (then an optional activation), scale and
shift being 1x1x1 ``conv3d``s of one nearest-upsampled tensor that only they read (CogVideoX's spatial norm), the
upsampling keeps the source's height and width, the convolutions run at that size, and the chain becomes
``gnext::group_norm_act_modulate``, which upsamples scale and shift as it reads them (:func:`_modulation`); a strided
x (an up-sampler's permuted output) goes through ``x.contiguous()`` first, which Inductor writes (:func:`_contiguous`).

After the GroupNorm rules, the data movement of video VAEs' up-samplers: an up-sampling padded for a convolution
becomes one index of its source, and pads of size 0 read by convolutions are dropped (``_compile_movement``).

A second pass, post-grad (``post_grad_custom_post_pass``), points the gnext calls of the differentiated graphs at the
ops' twins without an Autograd kernel (``<op>_no_autograd``, :func:`_retarget`).
"""
from __future__ import annotations

import hashlib
import inspect
import math
import operator
from pathlib import Path
from typing import Optional

import functools
import logging

import torch
import torch.nn.functional as F

from . import _registry  # noqa: F401  (torch.ops.gnext.*)
from ._autograd import no_autograd as _no_autograd
from ._compile_movement import _CONVS, _INTERPOLATE_SIG, _PADS, _meta, _pad_of, rewrite_movement
from .ops.group_norm_act_pad import MODES as PAD_MODES, check_pad_args

__all__ = ["enable_compile_fusion", "disable_compile_fusion", "compile_fusion_stats"]

_log = logging.getLogger("groupnorm_ext")
_GROUP_NORM = (F.group_norm, torch.group_norm)
_GN_SIG = inspect.signature(F.group_norm)  # (input, num_groups, weight=None, bias=None, eps=1e-05)
_ADDS = (operator.add, torch.add)
_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MULS = (operator.mul, torch.mul)
_CONV3DS = (torch.conv3d, F.conv3d)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")

# Counts of this process's rewrites (tests and the benchmark read them): {"group_norm_act": n, "residual": m,
# "input_bias": convolution biases moved into the op, "left": chains that matched but that the rule left to
# Inductor (each reason is logged once as a warning)}.
# A graph that Inductor takes from its caches (FX graph, AOTAutograd) is not passed through the pass
# again, so its rewrites are not counted: count with the caches off (config force_disable_caches).
# "no_autograd": gnext calls of post-grad graphs retargeted to the op's twin without an Autograd kernel. "pad": chains
# (counted in "group_norm_act" too) that write their F.pad's padded output, or (modulated chains) their torch.cat along
# time behind a causal convolution's front frames. "unmatched": GroupNorm calls that start no
# chain the pass fuses (followed by something other than an activation, or read twice); where a graph has such calls
# and nothing rewritten or left by the rule, each reason is logged once as a warning.
# "modulate": modulated chains (counted in "group_norm_act" too) rewritten to group_norm_act_modulate.
# "gather": up-samplings padded for a convolution rewritten as one index; "zero_pad": pads of size 0 dropped
# (_compile_movement).
compile_fusion_stats: dict = {"group_norm_act": 0, "residual": 0, "input_bias": 0, "left": 0, "no_autograd": 0,
                              "pad": 0, "unmatched": 0, "modulate": 0, "gather": 0, "zero_pad": 0}


def _activation(node: torch.fx.Node) -> Optional[str]:
    """group_norm_act's name for the activation this node computes (of its first argument), or None."""
    t, kw = node.target, node.kwargs
    if node.op == "call_method":
        return {"relu": "relu", "tanh": "tanh", "relu_": "relu", "tanh_": "tanh"}.get(str(t)) \
            if len(node.args) == 1 and not kw else None
    if node.op != "call_function":
        return None
    if t in (F.silu, torch.nn.functional.silu):
        return "silu"
    if t in (F.relu, torch.relu, torch.relu_):
        return "relu"
    if t in (torch.tanh, F.tanh):
        return "tanh"
    if t is F.hardswish:
        return "hardswish"
    if t in (F.gelu, torch._C._nn.gelu):
        approximate = kw.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(str(approximate))
    return None


def _static_numel(t: torch.Tensor) -> Optional[int]:
    n = 1
    for s in t.shape:
        if not isinstance(s, int):
            return None  # dynamic shape: the rule decides without the size
        n *= s
    return n


# Below this many elements (4M: 8 MB in half precision) the rewrite loses: measured on the H100
# (docs/benchmarks.md), the SD-1.5 UNet fp16 inference (GroupNorm tensors of
# 2x1280x8x8 up to 2x320x64x64 = 2.6M elements, 45 chains rewritten with a 64K threshold) ran 31.9 ms
# compiled with the rewrite against 28.4 ms without, while the VAE decoder (maps of 1x512x64x64 up to
# 1x128x512x512) ran faster with it. A compiled graph at those sizes is host-bound: Inductor's fused
# Triton kernels cost less host time per call than the op's dispatch, and they also fuse the GroupNorm
# with what precedes it (the time-embedding add). That measurement had the op's Python Autograd kernel in
# each call; the twins take 6-12 us per call off (0.3-0.5 ms over those 45 calls, against 3.5 ms lost),
# and the threshold has not been measured with them.
_MIN_NUMEL = 1 << 22


def _fusable(x: torch.Tensor, y: torch.Tensor, params, when: str) -> bool:
    """The rule (:func:`_left_because` is None)."""
    return _left_because(x, y, params, when) is None


def _left_because(x: torch.Tensor, y: torch.Tensor, params, when: str) -> Optional[str]:
    """Why the chain stays with Inductor, or None where it is rewritten. The rule. Always: floating input of 3-5
    dims, output of the input's dtype (not under autocast, which computes GroupNorm in float32), weight/bias of the
    input's dtype or float32. For
    when="auto" also: an inference graph (the output needs no grad: traced under no_grad or from
    inputs and parameters that need none), a CUDA tensor with at least _MIN_NUMEL elements (or a dynamic shape),
    3-D to 5-D (video VAEs: docs/decisions/compile-fusion.md).

    Why inference only: measured on the H100, Inductor's own training
    graphs beat the rewritten ones: diffusers UNet2DModel bf16 training step 44.7 ms compiled vs 46.9
    with the rewrite, timm BiT-50 bf16 training step 27.4 vs 39.9 ms. Inductor fuses GroupNorm's
    backward with the gradient sums and casts around it, gnext's backward op is a separate pass."""
    if x is None or y is None or x.dtype not in _FLOATS or not 3 <= x.dim() <= 5:
        return "the input is not a 3-D to 5-D float16/bfloat16/float32 tensor"
    if y.dtype != x.dtype:
        return "the output's dtype is not the input's (autocast)"
    for p in params:
        if p is not None and (p.dtype not in (x.dtype, torch.float32) or p.device != x.device):
            return "weight or bias of another dtype or device"
    if when == "always":
        return None
    if y.requires_grad:  # traced with grad mode on and a differentiable input: a training graph
        return "a training graph (when='auto' rewrites inference graphs; when='always' rewrites these too)"
    if x.device.type != "cuda":
        return "not a CUDA tensor (when='auto')"
    n = _static_numel(x)
    if n is not None and n < _MIN_NUMEL:
        return f"fewer than {_MIN_NUMEL} elements, where Inductor's own kernels are faster (when='auto')"
    return None


def _movement_applies(x: torch.Tensor, y: torch.Tensor, when: str) -> bool:
    """The data-movement rules' rule: with when="auto", inference graphs on CUDA (where they were measured)."""
    return when == "always" or (not y.requires_grad and x.device.type == "cuda")


def _take_conv_bias(x, xm: torch.Tensor, chain: tuple):
    """Where x (or the ``contiguous()`` of it) is a convolution's output with a bias node b of shape (C,), x's dtype or
    float32 and on x's device, and every reader of x outside the chain (chain[0] is its GroupNorm) is one that b can
    move past: b, after setting the convolution's bias to None and moving it past those readers (_move_bias_past).
    Else None."""
    if not isinstance(x, torch.fx.Node):
        return None
    conv = x
    if x.op == "call_method" and x.target == "contiguous" and len(x.args) == 1 and not x.kwargs \
            and isinstance(x.args[0], torch.fx.Node) and len(x.args[0].users) == 1:
        conv = x.args[0]  # a block's `hidden_states.contiguous()` of a convolution's (contiguous) output
    if conv.op != "call_function" or conv.target not in _CONVS:
        return None
    pos = len(conv.args) > 2
    b = conv.args[2] if pos else conv.kwargs.get("bias")
    bm = _meta(b)
    if bm is None or bm.dim() != 1 or bm.shape[0] != xm.shape[1] or bm.device != xm.device \
            or bm.dtype not in (xm.dtype, torch.float32):
        return None
    moves = _bias_moves(x, xm, chain)
    if moves is None or not isinstance(b, torch.fx.Node):
        return None
    if pos:
        conv.args = conv.args[:2] + (None,) + conv.args[3:]
    else:
        conv.kwargs = {**conv.kwargs, "bias": None}
    _move_bias_past(x, xm, b, bm.dtype, moves)
    return b


def _conv_args(node: torch.fx.Node) -> dict:
    return {**dict(zip(_CONV_ARGS, node.args)), **node.kwargs}


def _all_are(v, one) -> bool:
    """A convolution's int-or-tuple argument v is one in every dimension."""
    return v == one or (isinstance(v, (tuple, list)) and all(e == one for e in v))


def _no_padding(conv_args: dict) -> bool:
    padding = conv_args.get("padding", 0)
    return padding == "valid" or _all_are(padding, 0)


def _folds_bias(node: torch.fx.Node, x: torch.fx.Node) -> bool:
    """node is a convolution of x (its input, nothing else) with no padding and one group: conv(x + b) =
    conv(x) + sum over the kernel of W b, exactly, whatever the stride and dilation."""
    if node.op != "call_function" or node.target not in _CONVS:
        return False
    a = _conv_args(node)
    return a.get("input") is x and sum(v is x for v in (*node.args, *node.kwargs.values())) == 1 \
        and _no_padding(a) and a.get("groups", 1) == 1 and _meta(a.get("weight")) is not None


def _bias_moves(x: torch.fx.Node, xm: torch.Tensor, chain: tuple):
    """[(kind, node)] for each reader of x but the chain's GroupNorm, kind "conv" (a convolution that folds the
    bias: _folds_bias, directly or through F.pad of size 0 read only by such convolutions, a 1x1x1 causal
    convolution's pad) or "add" (x + y with y of x's shape and dtype: it gets x + b, which Inductor computes inside
    that add's kernel); None if x has another reader, or one inside the chain (the residual add the op takes)."""
    moves = []
    for u in x.users:
        if u is chain[0]:
            continue
        if u in chain:
            return None
        other = _other_operand(u, x, _ADDS)
        om, um = _meta(other), _meta(u)
        if other is not None and om is not None and um is not None and om.shape == xm.shape \
                and om.dtype == xm.dtype and um.dtype == xm.dtype:
            moves.append(("add", u))
        elif _folds_bias(u, x):
            moves.append(("conv", u))
        elif u.op == "call_function" and u.target in _PADS and u.args and u.args[0] is x \
                and (spec := _pad_of(u)) is not None and not any(spec[0]) and u.users \
                and all(_folds_bias(c, u) for c in u.users):
            moves.extend(("conv", c) for c in u.users)
        else:
            return None
    return moves


def _move_bias_past(x: torch.fx.Node, xm: torch.Tensor, b: torch.fx.Node, b_dtype: torch.dtype, moves) -> None:
    """The readers of x (without its bias b) in moves see what they saw with it: each add reads x + b[c]; each
    convolution's bias gains sum over the kernel of W b (float32, then its weight's dtype)."""
    graph = x.graph
    view = [1, -1] + [1] * (xm.dim() - 2)
    for kind, u in moves:
        with graph.inserting_before(u):
            if kind == "add":
                bx = graph.call_method("to", (b, xm.dtype)) if b_dtype != xm.dtype else b
                xb = graph.call_function(operator.add, (x, graph.call_method("view", (bx, view))))
                u.args = tuple(xb if a is x else a for a in u.args)
                continue
            a = _conv_args(u)
            w, wm = a["weight"], _meta(a["weight"])
            assert wm is not None  # _folds_bias
            w32 = graph.call_method("float", (w,))
            summed = graph.call_method("sum", (w32, tuple(range(2, wm.dim())))) if wm.dim() > 2 else w32
            fold = graph.call_function(operator.matmul, (summed, graph.call_method("float", (b,))))
            old = a.get("bias")
            if old is not None:
                fold = graph.call_function(operator.add, (fold, graph.call_method("float", (old,))))
            nb = graph.call_method("to", (fold, wm.dtype))
            if len(u.args) > 2:
                u.args = u.args[:2] + (nb,) + u.args[3:]
            else:
                u.kwargs = {**u.kwargs, "bias": nb}


def _identity_dropout(node: torch.fx.Node) -> bool:
    """A dropout call that returns its input: training False or p = 0 (F.dropout(input, p, training, inplace),
    torch.dropout(input, p, train))."""
    if node.op != "call_function" or node.target not in _DROPOUTS:
        return False
    names = ("input", "p", "train" if node.target is torch.dropout else "training")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    p, training = bound.get("p", 0.5), bound.get(names[2], True)
    return training is False or (type(p) in (int, float) and bool(p == 0))


def _reads_first_only(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """node takes source as its first argument and nowhere else."""
    return bool(node.args) and node.args[0] is source and not any(a is source for a in node.args[1:]) \
        and not any(v is source for v in node.kwargs.values())


def _through_dropouts(source: torch.fx.Node):
    """(the dropouts that return their input read in a line from source, each the only reader of the one before and
    taking it as its first argument only; the last of them, or source)."""
    nodes = []
    while len(source.users) == 1:
        node = next(iter(source.users))
        if not _identity_dropout(node) or not _reads_first_only(node, source):
            break
        nodes.append(node)
        source = node
    return nodes, source


def _take_pad(act_node: torch.fx.Node, xm: torch.Tensor):
    """Where x is a contiguous 3-D or 5-D tensor and the activation's output, through dropouts that return their
    input, goes only into one F.pad of static non-negative sizes over x's spatial dims, mode 'replicate' or
    'constant': (the nodes after the activation, the pad last; pad, mode, value), which group_norm_act_pad computes
    in one op. Else None. Not 4-D: Inductor runs 2-D convolutions channels_last (its layout optimization) and would
    copy the op's NCHW output for them; it keeps 1-D and 3-D convolutions in their input's layout. Not channels_last:
    the op's padded pass reads NCHW rows (it would copy x)."""
    if xm.dim() == 4 or not xm.is_contiguous():
        return None
    nodes, source = _through_dropouts(act_node)
    node = next(iter(source.users)) if len(source.users) == 1 else None
    if node is None or node.op != "call_function" or node.target not in _PADS or not _reads_first_only(node, source):
        return None
    nodes.append(node)
    args = node.args
    pad = args[1] if len(args) > 1 else node.kwargs.get("pad")
    mode = args[2] if len(args) > 2 else node.kwargs.get("mode", "constant")
    value = args[3] if len(args) > 3 else node.kwargs.get("value")
    if not isinstance(pad, (tuple, list)) or not all(type(v) is int for v in pad) or mode not in PAD_MODES \
            or not (value is None or isinstance(value, (int, float))) \
            or (mode == "replicate" and value not in (None, 0)):
        return None
    try:  # the op's own checks of pad against x: pairs over spatial dims, sizes, replicated dims non-empty
        check_pad_args("gnext.group_norm_act_pad", xm, pad, mode)
    except RuntimeError:
        return None
    pm = _meta(node)
    if pm is None or pm.dtype != xm.dtype or pm.device != xm.device:
        return None
    return nodes, list(pad), mode, float(value or 0.0)


def _activation_of(node: torch.fx.Node, source: torch.fx.Node) -> Optional[str]:
    """group_norm_act's name for the activation that node computes of source (its only tensor argument), or None."""
    act = _activation(node)
    if act is None or node.args[0] is not source or any(a is source for a in node.args[1:]) or (
            node.op == "call_function" and node.target is F.hardswish and len(node.args) > 2):
        return None
    return act


def _other_operand(node: torch.fx.Node, first: torch.fx.Node, targets) -> Optional[torch.fx.Node]:
    """The operand beside first of node = targets(first, other) or targets(other, first), two positional arguments."""
    if node.op != "call_function" or node.target not in targets or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is first else a if b is first else None
    return other if isinstance(other, torch.fx.Node) and other is not first else None


def _pointwise_conv3d_input(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The input of node where node is a conv3d with a 1x1x1 kernel, stride 1, no padding or dilation, one group,
    whose output has one reader: a pointwise convolution, which commutes with nearest upsampling (each output
    position is W z[src] + b either way). Else None."""
    if node.op != "call_function" or node.target not in _CONV3DS or len(node.users) != 1:
        return None
    a = _conv_args(node)
    wm = _meta(a.get("weight"))
    if wm is None or wm.dim() != 5 or tuple(wm.shape[2:]) != (1, 1, 1) or not _all_are(a.get("stride", 1), 1) \
            or not _no_padding(a) or not _all_are(a.get("dilation", 1), 1) \
            or a.get("groups", 1) != 1:
        return None
    z = a.get("input")
    return z if isinstance(z, torch.fx.Node) else None


def _nearest_parts(z: torch.fx.Node, size_hw):
    """Where z is F.interpolate(src, size=(d, H, W)) in mode 'nearest' of a 5-D src no larger than (H, W) = size_hw
    and smaller in one of them, or torch.cat of such calls along dim 2 (each read only by the cat), all of one
    source (h, w): (the interpolate nodes, (h, w)). Else None."""
    parts = [z]
    if z.op == "call_function" and z.target is torch.cat:
        tensors = z.args[0] if z.args else z.kwargs.get("tensors")
        dim = z.args[1] if len(z.args) > 1 else z.kwargs.get("dim", 0)
        if not isinstance(tensors, (list, tuple)) or dim not in (2, -3) \
                or any(not isinstance(t, torch.fx.Node) or len(t.users) != 1 for t in tensors):
            return None
        parts = list(tensors)
    hw = None
    for node in parts:
        if node.op != "call_function" or node.target is not F.interpolate:
            return None
        try:
            a = _INTERPOLATE_SIG.bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        a.apply_defaults()
        size, src = a.arguments["size"], _meta(a.arguments["input"])
        if a.arguments["mode"] != "nearest" or a.arguments["scale_factor"] is not None \
                or a.arguments["align_corners"] is not None or a.arguments["recompute_scale_factor"] \
                or a.arguments["antialias"] or not isinstance(size, (tuple, list)) or len(size) != 3 \
                or not all(type(v) is int for v in size) or tuple(size[1:]) != tuple(size_hw) \
                or src is None or src.dim() != 5 or _static_numel(src) is None:
            return None
        src_hw = tuple(src.shape[-2:])
        if hw not in (None, src_hw):
            return None
        hw = src_hw
    if hw is None or not (hw[0] <= size_hw[0] and hw[1] <= size_hw[1]) or hw == tuple(size_hw):
        return None
    return parts, hw


def _dead_readers(z: torch.fx.Node, keep) -> Optional[list]:
    """z's readers other than keep, where each is a getitem, clone, contiguous or detach whose results nothing
    reads (CogVideoX's causal convolutions clone their input for a frame cache that a 1x1x1 kernel never reads):
    those nodes, readers first. None where another reader uses z."""
    out: list = []

    def dead(node) -> bool:
        pure = (node.op == "call_function" and node.target is operator.getitem) or (
            node.op == "call_method" and node.target in ("clone", "contiguous", "detach"))
        if not pure or not all(dead(u) for u in node.users):
            return False
        out.append(node)
        return True

    return out if all(u in keep or dead(u) for u in z.users) else None


def _resize_meta(node: torch.fx.Node, hw) -> None:
    """node's example value (a fake tensor) with its last two sizes set to hw."""
    v = _meta(node)
    if v is not None:
        node.meta["example_value"] = v.new_empty(tuple(v.shape[:-2]) + tuple(hw))


_NOT_MODULATED = "GroupNorm followed by mul, not an activation the op fuses (SiLU, GELU, ReLU, tanh, hardswish)"
_FULL_SIZE_MODULATION = ("GroupNorm(x) * scale + shift whose scale and shift are not 1x1x1 conv3ds of one tensor that "
                         "nearest-neighbour upsampling brings to x's size from a smaller height or width and that "
                         "nothing else reads (Inductor's normalize reads as many bytes and adds their biases)")
_NOT_5D_MODULATION = "GroupNorm(x) * scale + shift with x not a 5-D tensor"
_MAX_UPSAMPLED_PLANE = 2 ** 31 - 4096  # group_norm_act_modulate's bound on a channel's plane with smaller scale/shift
_LARGE_MODULATION = ("GroupNorm(x) * scale + shift with a channel's plane of x over 2^31 - 4096 elements or of dynamic "
                     "size (the op upsamples smaller scale and shift only below that)")


def _modulation(gn: torch.fx.Node, xm: torch.Tensor):
    """GroupNorm(x) * scale + shift (either operand order), then an optional activation, where scale and shift are
    pointwise conv3ds (_pointwise_conv3d_input) of one tensor z that nothing else reads and z is x's size upsampled by
    nearest neighbour from a smaller height and width (_nearest_parts; CogVideoXSpatialNorm3D): (the nodes after
    the GroupNorm, the last one last; scale; shift; activation or 'identity'; z's interpolate nodes; the source (h, w);
    z's dead readers). Else the reason, a str.

    Why only then: group_norm_act_modulate reads scale and shift at the source's size, upsampling as it reads, so
    the convolutions run on the small tensor and no full-size scale, shift or upsampled z is written; with full-size
    scale and shift it reads as many bytes as Inductor's own normalize, which also adds the convolutions' biases
    that the op would leave to passes of their own (docs/decisions/compile-fusion.md)."""
    mul = next(iter(gn.users))
    scale = _other_operand(mul, gn, _MULS)
    if scale is None or len(mul.users) != 1:
        return _NOT_MODULATED
    add = next(iter(mul.users))
    shift = _other_operand(add, mul, _ADDS)
    if shift is None:
        return _NOT_MODULATED
    for t in (scale, shift, add):
        tm = _meta(t)
        if tm is None or tm.shape != xm.shape or tm.dtype != xm.dtype or tm.device != xm.device:
            return _FULL_SIZE_MODULATION
    chain, act = [mul, add], "identity"
    if len(add.users) == 1:
        node = next(iter(add.users))
        name = _activation_of(node, add)
        if name is not None:
            chain, act = chain + [node], name
    z = _pointwise_conv3d_input(scale)
    if z is None or z is not _pointwise_conv3d_input(shift):
        return _FULL_SIZE_MODULATION
    parts = _nearest_parts(z, xm.shape[-2:])
    dead = _dead_readers(z, (scale, shift)) if parts is not None else None
    if parts is None or dead is None:
        return _FULL_SIZE_MODULATION
    if xm.dim() != 5:
        return _NOT_5D_MODULATION
    if not all(type(d) is int for d in xm.shape[2:]) or math.prod(xm.shape[2:]) >= _MAX_UPSAMPLED_PLANE:
        return _LARGE_MODULATION
    return chain, scale, shift, act, parts[0], parts[1], dead


def _first_frame(node: torch.fx.Node, y: torch.fx.Node) -> bool:
    """node is y[:, :, :1] (or y[:, :, 0:1])."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2 \
            or node.args[0] is not y or not isinstance(node.args[1], tuple) or len(node.args[1]) != 3:
        return False
    every, t = slice(None, None, None), node.args[1][2]
    return node.args[1][:2] == (every, every) and isinstance(t, slice) and t.start in (None, 0) and t.stop == 1 \
        and t.step in (None, 1)


def _take_cat(last: torch.fx.Node, xm: torch.Tensor):
    """Where the modulated chain's output y (its last node `last`, then dropouts that return their input) is read
    only by one torch.cat along dim 2 of [cache, y] or of [y[:, :, :1]] * k + [y], those slices of y read only by
    it (CogVideoXCausalConv3d's input, its cached frames or copies of the first before x): (the nodes after
    `last`, the cat last; the number of front frames; cache or None), which group_norm_act_modulate_cat computes:
    the chain then writes its frames into the concatenation instead of a full-size output that Inductor copies
    there. Else None."""
    nodes, y = _through_dropouts(last)
    cats = [u for u in y.users if u.op == "call_function" and u.target is torch.cat]
    if len(cats) != 1:
        return None
    cat = cats[0]
    tensors = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or tensors[-1] is not y \
            or any(t is y for t in tensors[:-1]) or dim not in (2, -3) or len(xm.shape) != 5:
        return None
    front, others = list(tensors[:-1]), [u for u in y.users if u is not cat]
    cm = _meta(cat)
    if cm is None or cm.dtype != xm.dtype or cm.device != xm.device:
        return None
    if len(front) == 1 and not others and not _first_frame(front[0], y):  # [cache, y]
        fm = _meta(front[0])
        if fm is None or fm.dtype != xm.dtype or fm.device != xm.device \
                or tuple(fm.shape) != (*xm.shape[:2], fm.shape[2], *xm.shape[3:]):
            return None
        return nodes + [cat], fm.shape[2], front[0]
    first = front[0]
    if others != [first] or any(t is not first for t in front) or len(first.users) != 1 or not _first_frame(first, y):
        return None
    return nodes + [first, cat], len(front), None


def _contiguous(graph: torch.fx.Graph, x: torch.fx.Node, xm: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
    """x, or x.contiguous() inserted before `before` where x is a strided view (CogVideoX's up-samplers hand the next
    block the permuted view of a frame-batched conv2d). Inductor writes that copy in the kernel that adds the
    convolution's bias anyway; the op would otherwise copy the view itself, after that kernel."""
    if xm.is_contiguous():
        return x
    with graph.inserting_before(before):
        xc = graph.call_method("contiguous", (x,))
    xc.meta["example_value"] = xm.new_empty(tuple(xm.shape))
    return xc


def _shrink_modulation(scale, shift, parts, hw, dead) -> None:
    """Makes z's interpolate calls keep the source's (h, w), so that the convolutions scale and shift run at it: the
    dead readers of z erased, the sizes and the example values set."""
    graph = scale.graph
    for node in dead:
        graph.erase_node(node)
    for node in parts:
        size = (node.kwargs["size"] if "size" in node.kwargs else node.args[1])
        size = (size[0],) + tuple(hw)
        if "size" in node.kwargs:
            node.kwargs = {**node.kwargs, "size": size}
        else:
            node.args = (node.args[0], size) + tuple(node.args[2:])
        _resize_meta(node, hw)
    z = scale.args[0] if scale.args else scale.kwargs["input"]
    for node in {z, scale, shift}:
        _resize_meta(node, hw)


_warned: set = set()


_LEFT = ("gnext enable_compile_fusion: %d GroupNorm->activation chain(s) of a compiled graph left to Inductor: %s "
         "(further graphs left for this reason are not reported)")
_UNMATCHED = ("gnext enable_compile_fusion: a compiled graph has %d GroupNorm call(s) and none was rewritten: %s; they "
              "stay Inductor's (further graphs are not reported)")


def _report(counts: dict, message: str) -> None:
    """One warning per reason per process (message: _LEFT, chains of a compiled graph that the rule left to Inductor;
    _UNMATCHED, GroupNorm calls of a graph that rewrote nothing and that start no chain the pass fuses)."""
    for why, n in counts.items():
        if why not in _warned:
            _warned.add(why)
            _log.warning(message, n, why)


def _target_name(node: torch.fx.Node) -> str:
    """A short name of what node calls (for the warnings)."""
    if node.op in ("call_method", "call_module"):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _replace(graph: torch.fx.Graph, op, op_args, chain) -> None:
    """op(*op_args)[0] in place of the chain's last node; the chain (in graph order) is erased."""
    last = chain[-1]
    with graph.inserting_before(last):
        fused = graph.call_function(op, op_args)
        out = graph.call_function(operator.getitem, (fused, 0))
    out.meta.update(last.meta)
    last.replace_all_uses_with(out)
    for n in reversed(chain):
        graph.erase_node(n)


def _rewrite(graph: torch.fx.Graph, when: str) -> int:
    """Rewrites every matching chain in place; returns how many."""
    count = 0
    left: dict[str, int] = {}  # reason -> chains the rule left to Inductor
    unmatched: dict[str, int] = {}  # reason -> GroupNorm calls that start no chain

    def no_chain(why: str) -> None:
        unmatched[why] = unmatched.get(why, 0) + 1
        compile_fusion_stats["unmatched"] += 1

    for gn in list(graph.nodes):
        if gn.op != "call_function" or gn.target not in _GROUP_NORM:
            continue
        if len(gn.users) != 1:
            no_chain("a GroupNorm output read by more than one node (the activation must be its only reader)")
            continue
        try:
            args = (_GN_SIG.bind(*gn.args[:5], **{k: v for k, v in gn.kwargs.items() if k != "cudnn_enabled"})
                    if gn.target is F.group_norm else _GN_SIG.bind(*gn.args[:5]))
        except TypeError:
            no_chain("GroupNorm arguments the pass does not read")
            continue
        args.apply_defaults()
        x, groups, weight, bias, eps = (args.arguments[k] for k in ("input", "num_groups", "weight", "bias", "eps"))
        if not isinstance(groups, int) or not isinstance(eps, (int, float)):
            no_chain("num_groups or eps not a constant of the graph")
            continue
        act_node = next(iter(gn.users))
        act = _activation_of(act_node, gn)
        xm, wm, bm = _meta(x), _meta(weight), _meta(bias)
        modulated = None
        if act is None and xm is not None and act_node.op == "call_function" and act_node.target in _MULS:
            modulated = _modulation(gn, xm)
            if isinstance(modulated, str):
                no_chain(modulated)
                continue
        elif act is None:
            no_chain(f"GroupNorm followed by {_target_name(act_node)}, not an activation the op fuses (SiLU, GELU, "
                     "ReLU, tanh, hardswish)")
            continue
        om = _meta(act_node if modulated is None else modulated[0][-1])
        if xm is None or om is None or (weight is not None and wm is None) or (bias is not None and bm is None):
            no_chain("no tensor metadata on the chain's nodes")
            continue
        why = _left_because(xm, om, (wm, bm), when)
        if why is not None:
            left[why] = left.get(why, 0) + 1
            compile_fusion_stats["left"] += 1
            continue
        residual = padded = cat = None
        if modulated is not None:
            mod_chain, scale, shift, mod_act, parts, hw, dead = modulated
            cat = _take_cat(mod_chain[-1], xm)
            _shrink_modulation(scale, shift, parts, hw, dead)
            x = _contiguous(graph, x, xm, gn)
        else:
            last = act_node
            if len(act_node.users) == 1:
                add = next(iter(act_node.users))
                other = _other_operand(add, act_node, _ADDS)
                om, am = _meta(other), _meta(add)
                if (om is not None and am is not None and om.shape == xm.shape and om.dtype == xm.dtype
                        and om.device == xm.device and am.dtype == xm.dtype):
                    last, residual = add, other
            padded = _take_pad(act_node, xm) if residual is None else None
        if modulated is not None:
            chain = (gn, *mod_chain, *(cat[0] if cat is not None else ()))
        elif padded is not None:
            chain = (gn, act_node, *padded[0])
        else:
            chain = (gn, act_node) if residual is None else (gn, act_node, last)
        input_bias = _take_conv_bias(x, xm, chain)
        op_args: tuple
        if cat is not None:
            op, op_args = torch.ops.gnext.group_norm_act_modulate_cat.default, \
                (x, groups, weight, bias, float(eps), scale, shift, mod_act, int(cat[1]), cat[2], input_bias)
        elif modulated is not None:
            op, op_args = torch.ops.gnext.group_norm_act_modulate.default, \
                (x, groups, weight, bias, float(eps), scale, shift, mod_act, input_bias)
        elif padded is not None:
            after, pad, mode, value = padded
            op, op_args = torch.ops.gnext.group_norm_act_pad.default, \
                (x, groups, weight, bias, float(eps), act, pad, mode, value, input_bias)
        else:
            op, op_args = torch.ops.gnext.group_norm_act.default, \
                (x, groups, weight, bias, float(eps), act, residual, input_bias)
        _replace(graph, op, op_args, chain)
        count += 1
        compile_fusion_stats["group_norm_act"] += 1
        compile_fusion_stats["modulate"] += modulated is not None
        compile_fusion_stats["pad"] += padded is not None or cat is not None
        compile_fusion_stats["residual"] += residual is not None
        compile_fusion_stats["input_bias"] += input_bias is not None
    if left:
        _report(left, _LEFT)
    if unmatched and count == 0 and not left:
        _report(unmatched, _UNMATCHED)
    return count


def _retarget(graph: torch.fx.Graph) -> int:
    """Post-grad: each gnext call with a twin of no Autograd kernel calls the twin; returns how many. The graphs
    after AOTAutograd are differentiated already (a training graph's forward runs inside an autograd.Function, with
    grad mode off; its backward graph holds the backward ops' twins already, traced through
    _autograd._call_backward), so the op's Autograd kernel, a Python function, had no work left but its host time:
    6-12 us per call on an H100 (docs/decisions/compile-fusion.md)."""
    count = 0
    for node in graph.nodes:
        twin = _no_autograd(node.target) if node.op == "call_function" else None
        if twin is not None:
            node.target = twin
            count += 1
    compile_fusion_stats["no_autograd"] += count
    return count


@functools.lru_cache(None)
def _pass_class(post_grad: bool = False):
    """GroupNormActPass (pre-grad) or NoAutogradPass (post-grad), defined on first use: importing Inductor costs
    ~2 s, not paid at gnext's import."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GroupNormActPass(CustomGraphPass):
        """Inductor pre-grad pass: GroupNorm + activation (+ residual) -> gnext::group_norm_act. As the post-grad
        NoAutogradPass: gnext's ops -> their twins of no Autograd kernel (``when`` unused)."""

        def __init__(self, when: str = "auto", previous=None):
            self.when, self.previous = when, previous

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.previous is not None:
                self.previous(graph)
            if post_grad:
                _retarget(graph)
            else:
                _rewrite(graph, self.when)
                rewrite_movement(graph, compile_fusion_stats, functools.partial(_movement_applies, when=self.when))

        def uuid(self) -> Optional[bytes]:
            h = hashlib.sha256(_SOURCE)
            h.update(f"{self.when} {post_grad}".encode())
            if self.previous is not None:
                prev = self.previous.uuid() if hasattr(self.previous, "uuid") else None
                if prev is None:
                    return None  # a previous pass without a uuid: Inductor bypasses its cache, as before us
                h.update(prev if isinstance(prev, bytes) else str(prev).encode())
            return h.digest()

        def __reduce__(self):
            # Picklable although the class is local: torch 2.11's FX-graph cache pickles the Inductor
            # config with this object in it (a pickling error there bypasses the cache). The uuid goes
            # along, so a cache key changes with gnext's pass source as it does through uuid().
            return _restore_pass, (self.when, self.previous, self.uuid(), post_grad)

    if post_grad:
        GroupNormActPass.__name__ = GroupNormActPass.__qualname__ = "NoAutogradPass"
    return GroupNormActPass


def _restore_pass(when, previous, _uuid=None, post_grad=False):
    """Unpickles a GroupNormActPass or NoAutogradPass (see their __reduce__)."""
    return _pass_class(post_grad)(when, previous)


# Inductor's hooks for the two passes.
_HOOKS = {False: "pre_grad_custom_pass", True: "post_grad_custom_post_pass"}


_SOURCE = Path(__file__).read_bytes() + (Path(__file__).parent / "_compile_movement.py").read_bytes()


def enable_compile_fusion(when: str = "auto") -> None:
    """Makes ``torch.compile`` (Inductor) rewrite GroupNorm followed by an activation (SiLU, GELU,
    ReLU, tanh, hardswish) and an optional residual add into ``gnext::group_norm_act``, in inference
    and training graphs, for models compiled after this call. Works with ``fullgraph=True``, dynamic
    shapes and ``mode="reduce-overhead"``. A pre-grad pass already installed keeps running first. Also
    installs a post-grad pass: the compiled graphs call gnext's ops (these and any others in the model)
    through their twins without a Python Autograd kernel (6-12 µs less host time per call on an H100).

    Args:
        when: ``"auto"``: only where gnext is the faster choice (inference graphs, CUDA, 3-D to 5-D, at
            least 4M elements; see ``_fusable`` and docs/api.md); ``"always"``: every matching
            chain on any device, training graphs too (tests; measurements). Chains the rule leaves to
            Inductor are counted in ``compile_fusion_stats["left"]`` and each reason is logged once per
            process as a warning (logger ``groupnorm_ext``).

    Raises:
        ValueError: ``when`` is not ``"auto"`` or ``"always"``.
    """
    if when not in ("auto", "always"):
        raise ValueError(f"enable_compile_fusion: when must be 'auto' or 'always', got {when!r}")
    from torch._inductor import config as inductor_config

    for post_grad, hook in _HOOKS.items():
        current = getattr(inductor_config, hook)
        if isinstance(current, _pass_class(post_grad)):
            current = current.previous
        setattr(inductor_config, hook, _pass_class(post_grad)(when, current))


def disable_compile_fusion() -> None:
    """Removes the passes installed by :func:`enable_compile_fusion` (passes installed before them stay).
    Models compiled before keep their compiled code; call ``torch._dynamo.reset()`` to recompile."""
    from torch._inductor import config as inductor_config

    for post_grad, hook in _HOOKS.items():
        current = getattr(inductor_config, hook)
        if isinstance(current, _pass_class(post_grad)):
            setattr(inductor_config, hook, current.previous)
