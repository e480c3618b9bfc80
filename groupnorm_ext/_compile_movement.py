# SPDX-License-Identifier: BSD-3-Clause
"""Two rules of the compile pass for the data movement around a video VAE's causal convolutions, where no GroupNorm
is (docs/decisions/compile-fusion.md, "Up-samplers and zero pads"):

* Gathers. A replicate ``F.pad`` of a tensor that nearest up-sampling by integer factors, splits, concatenations,
  squeezes and ``contiguous`` made from one tensor x (HunyuanVideo's up-sampler: the first frame up-sampled in
  height and width, the others in time too, concatenated along time, then padded for the causal convolution)
  becomes one ``aten._unsafe_index`` of x, each source index ``(clamp(j - p, 0, L - 1) + a) // f`` of its output
  index j (all of an ``arange``): one pointwise kernel that reads x and writes the padded tensor. Inductor's own
  lowering writes the up-sampled frames in float32, then the concatenation, then pads it in a 2-D tiled kernel.
* Zero pads. ``F.pad`` with every size 0 (a 1x1x1 causal convolution's "padding") read only by convolutions is its
  input: Inductor copies it.

Index maps come from the chain itself: it is run on tensors of coordinates (N = C = 1, float32) and the result
must be separable (each output coordinate a function of its own dimension only) and of that closed form.
"""
from __future__ import annotations

import inspect
import math
import operator
from typing import Optional

import torch
import torch.nn.functional as F

_PADS = (F.pad, torch._C._nn.pad)
_CONVS = (torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d)
_INTERPOLATE_SIG = inspect.signature(F.interpolate)
_MAX_FACTOR = 8  # up-sampling factors and pad sizes searched for the closed form
_MAX_PAD = 8
# The chain runs at compile time on the CPU, three times, on float32 coordinates of the output's spatial size (exact
# below 2^24): above this many output elements per channel (512 MB of float32; 17 frames of 2048² are below, 33 are
# over) it is left alone rather than hold a few such tensors in host memory while compiling.
_MAX_EVAL_NUMEL = 1 << 27


def _meta(node) -> Optional[torch.Tensor]:
    v = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dim_arg(node: torch.fx.Node, pos: int, name: str, default=None):
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _spatial(dim, ndim: int) -> bool:
    """dim is an int naming a dimension after N and C of an ndim-dimensional tensor."""
    return type(dim) is int and -ndim <= dim < ndim and dim % ndim >= 2


def _integer_nearest(node: torch.fx.Node, src: torch.Tensor) -> bool:
    """F.interpolate(src, ...) in mode 'nearest' by integer factors (given as scale_factor or as sizes): each output
    index j reads j // f on every backend."""
    try:
        bound = _INTERPOLATE_SIG.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    kw = bound.arguments
    if kw["mode"] != "nearest" or kw["align_corners"] is not None or kw["recompute_scale_factor"] or kw["antialias"]:
        return False
    k = src.dim() - 2
    size, scale = kw["size"], kw["scale_factor"]
    if scale is not None and size is None:
        scales = tuple(scale) if isinstance(scale, (tuple, list)) else (scale,) * k
        return len(scales) == k and all(isinstance(s, (int, float)) and float(s) >= 1 and float(s).is_integer()
                                        for s in scales)
    if size is not None and scale is None:
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * k
        return len(sizes) == k and all(type(o) is int and type(i) is int and i > 0 and o % i == 0
                                       for o, i in zip(sizes, src.shape[2:]))
    return False


def _movement_inputs(node: torch.fx.Node) -> Optional[list]:
    """The tensor inputs of node where node moves or repeats elements along dims after N and C only (the ops of
    the gather rule), else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    t = node.target
    if node.op == "call_function" and t is torch.cat:
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        if not isinstance(tensors, (list, tuple)) or not tensors \
                or not all(isinstance(v, torch.fx.Node) for v in tensors):
            return None
        first = _meta(tensors[0])
        return list(tensors) if first is not None and _spatial(_dim_arg(node, 1, "dim", 0), first.dim()) else None
    x = node.args[0] if node.args else None
    if not isinstance(x, torch.fx.Node):
        return None
    xm = _meta(x)
    if xm is None and t is not operator.getitem:
        return None
    if node.op == "call_method":
        if t == "contiguous" and len(node.args) == 1 and not node.kwargs:
            return [x]
        if t in ("squeeze", "unsqueeze") and xm is not None:
            dim = _dim_arg(node, 1, "dim")
            return [x] if _spatial(dim, xm.dim() + (t == "unsqueeze")) else None
        if t == "split" and xm is not None:
            return [x] if _spatial(_dim_arg(node, 2, "dim", 0), xm.dim()) else None
        return None
    if t is operator.getitem:
        return [x] if x.op in ("call_method", "call_function") and x.target in ("split", torch.split) \
            and type(node.args[1]) is int else None
    if t is torch.split and xm is not None:
        return [x] if _spatial(_dim_arg(node, 2, "dim", 0), xm.dim()) else None
    if t in (torch.squeeze, torch.unsqueeze) and xm is not None:
        return [x] if _spatial(_dim_arg(node, 1, "dim"), xm.dim() + (t is torch.unsqueeze)) else None
    if t is F.interpolate and xm is not None:
        return [x] if _integer_nearest(node, xm) else None
    if t in _PADS:
        spec = _pad_of(node)
        return [x] if spec is not None and spec[1] == "replicate" else None
    return None


def _pad_of(node: torch.fx.Node):
    """(pad sizes, mode) of an F.pad node with static int sizes, else None."""
    pad = _dim_arg(node, 1, "pad")
    mode = _dim_arg(node, 2, "mode", "constant")
    if not isinstance(pad, (tuple, list)) or not all(type(v) is int for v in pad):
        return None
    return tuple(pad), mode


def _chain(pad: torch.fx.Node):
    """(x, the chain's nodes in graph order) where pad's input is made from x by movement ops only, each read only
    inside the chain, at least one of them an up-sampling; else None."""
    nodes: set = set()
    sources: set = set()
    stack = [pad]
    while stack:
        n = stack.pop()
        if n in nodes:
            continue
        inputs = _movement_inputs(n)
        if inputs is None:
            sources.add(n)
            continue
        nodes.add(n)
        stack.extend(inputs)
    if len(sources) != 1 or not any(n.target is F.interpolate for n in nodes):
        return None
    (x,) = sources
    if any(u not in nodes for n in nodes if n is not pad for u in n.users):
        return None
    order = {n: i for i, n in enumerate(pad.graph.nodes)}
    return x, sorted(nodes, key=order.__getitem__)


def _evaluate(chain, x: torch.fx.Node, coords: torch.Tensor) -> torch.Tensor:
    """The chain run on coords in place of x (eager, on the CPU)."""
    env = {x: coords}

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: env[n])

    for n in chain:
        args, kwargs = arg(n.args), arg(n.kwargs)
        env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
    return env[chain[-1]]


def _closed_form(idx: list, n_in: int) -> Optional[tuple]:
    """(p, L, a, f) with idx[j] == (min(max(j - p, 0), L - 1) + a) // f for every j and every value < n_in, else
    None."""
    n = len(idx)
    for f in range(1, _MAX_FACTOR + 1):
        for a in range(f):
            for p in range(_MAX_PAD + 1):
                for q in range(_MAX_PAD + 1):
                    L = n - p - q
                    if L < 1 or (L - 1 + a) // f >= n_in:
                        continue
                    if all((min(max(j - p, 0), L - 1) + a) // f == v for j, v in enumerate(idx)):
                        return p, L, a, f
    return None


def index_maps(chain, x: torch.fx.Node, xm: torch.Tensor, out_shape) -> Optional[list]:
    """Per dim after N and C, (p, L, a, f) of the chain's output index map (x's example value xm), where the chain is
    separable and each map has the closed form; else None."""
    spatial = tuple(xm.shape[2:])
    if not all(type(s) is int for s in spatial) or not all(type(s) is int for s in out_shape) \
            or math.prod(out_shape[2:]) > _MAX_EVAL_NUMEL or max(spatial) >= 1 << 24:
        return None
    maps = []
    for d, size in enumerate(spatial):
        shape = [1] * len(spatial)
        shape[d] = size
        coords = torch.arange(size, dtype=torch.float32).view(shape).expand(spatial)[None, None].contiguous()
        try:
            out = _evaluate(chain, x, coords)
        except Exception:  # an op the CPU lacks for float32, or arguments it rejects: no rewrite
            return None
        if tuple(out.shape) != (1, 1) + tuple(out_shape[2:]):
            return None
        line = out[0, 0].movedim(d, 0).reshape(out.shape[2 + d], -1)
        if not torch.equal(line, line[:, :1].expand_as(line)):
            return None  # not separable
        form = _closed_form([int(v) for v in line[:, 0].tolist()], size)
        if form is None:
            return None
        maps.append(form)
    return maps


def _emit_gather(pad: torch.fx.Node, x: torch.fx.Node, xm: torch.Tensor, maps, out_shape) -> torch.fx.Node:
    """The padded tensor as one aten._unsafe_index of x, each source index (clamp(j - p, 0, L - 1) + a) // f of
    its output index j.

    A contiguous x is indexed flat: the output's flat index is split into (n, c) and one j per dimension by // and
    %, so that Inductor sees a one-dimensional kernel. Indexed by one vector per dimension, Inductor tiles the output
    in two dimensions, (n, c, frame) by (row, column), a slower kernel (decisions/compile-fusion.md, "The gather's
    index: flat, not per dimension"). Other strides keep the per-dimension vectors."""
    graph = pad.graph
    device = xm.device
    k = len(maps)
    call = graph.call_function

    def source(j, L, a, f):  # j: the output index less p
        j = call(torch.clamp, (j, 0, L - 1))
        if a:
            j = call(operator.add, (j, a))
        return call(operator.floordiv, (j, f)) if f > 1 else j

    with graph.inserting_before(pad):
        if xm.is_contiguous():
            spatial = out_shape[2:]
            i = call(torch.arange, (math.prod(out_shape),), {"device": device})
            src = call(operator.floordiv, (i, math.prod(spatial)))  # n * C + c
            for d, (p, L, a, f) in enumerate(maps):
                j = call(operator.mod, (call(operator.floordiv, (i, math.prod(spatial[d + 1:]))), spatial[d]))
                j = source(call(operator.sub, (j, p)) if p else j, L, a, f)
                src = call(operator.add, (call(operator.mul, (src, xm.shape[2 + d])), j))
            flat = graph.call_method("reshape", (x, -1))
            out = graph.call_method("view", (call(torch.ops.aten._unsafe_index.Tensor, (flat, [src])), out_shape))
        else:
            index = []
            for d, (p, L, a, f) in enumerate(maps):
                j = source(call(torch.arange, (-p, out_shape[2 + d] - p), {"device": device}), L, a, f)
                shape = [1] * k
                shape[d] = -1
                index.append(graph.call_method("view", (j, shape)) if d < k - 1 else j)
            out = call(torch.ops.aten._unsafe_index.Tensor, (x, [None, None, *index]))
    out.meta.update(pad.meta)
    return out


def rewrite_movement(graph: torch.fx.Graph, stats: dict, applies) -> int:
    """The two rules on graph, in place; applies(x meta, output meta) says where (the pass's `when`). Returns how
    many chains and pads were rewritten; counts them in stats["gather"] and stats["zero_pad"]."""
    count = 0
    erased: set = set()
    # Last pads first: a pad of a pad is then part of the outer one's chain (one gather), or, where that chain is not
    # taken, still tried on its own.
    for pad in reversed(list(graph.nodes)):
        if pad in erased or pad.op != "call_function" or pad.target not in _PADS:
            continue
        spec, xm, om = _pad_of(pad), _meta(pad.args[0] if pad.args else None), _meta(pad)
        if spec is None or xm is None or om is None or not applies(xm, om):
            continue
        sizes, mode = spec
        if not any(sizes) and pad.users and all(u.op == "call_function" and u.target in _CONVS
                                                and (u.args[0] if u.args else u.kwargs.get("input")) is pad
                                                for u in pad.users):
            pad.replace_all_uses_with(pad.args[0])
            graph.erase_node(pad)
            stats["zero_pad"] += 1
            count += 1
            continue
        if mode != "replicate":
            continue
        found = _chain(pad)
        if found is None:
            continue
        x, chain = found
        xm = _meta(x)
        if xm is None or xm.dtype != om.dtype or xm.shape[:2] != om.shape[:2] or xm.dim() != om.dim():
            continue
        maps = index_maps(chain, x, xm, tuple(om.shape))
        if maps is None:
            continue
        out = _emit_gather(pad, x, xm, maps, tuple(om.shape))
        pad.replace_all_uses_with(out)
        for n in reversed(chain):
            graph.erase_node(n)
        erased.update(chain)
        stats["gather"] += 1
        count += 1
    return count
