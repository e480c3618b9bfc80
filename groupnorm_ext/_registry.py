# SPDX-License-Identifier: BSD-3-Clause
"""Registers everything of torch.ops.gnext.* beyond the compiled CUDA kernels: each op's module (ops/<op>.py)
registers its fake kernels, CPU kernels and autograd on import; then the layout tag, which must come after every
registration (torch.library's registrations rebuild the overload objects, their tags with them)."""
from __future__ import annotations

import torch

from ._library import ops
from .ops import (conv_transpose2d_gelu_group_norm, group_norm, group_norm_act, group_norm_act_apply,  # noqa: F401
                  group_norm_act_logsumexp, group_norm_act_modulate, group_norm_act_pad,
                  group_norm_moments)


def mark_flexible_layout() -> None:
    """Tag every gnext overload with torch.Tag.flexible_layout: Inductor then hands the op its inputs in
    the layout it already has them in, instead of forcing them to the strides they had when the graph
    was traced (the default for custom ops, needs_exact_strides). Under torch.compile, Inductor runs the
    convolutions of an NCHW model in channels_last; with exact strides every gnext call between two
    convolutions cost a transposing copy of its input and another of its output (BiT training step,
    H100: 3.1 ms of transposes in an 11.6 ms step). The kernels take any layout and the fake kernels (ops/<op>.py)
    give the output layout the CUDA/CPU kernels produce for every input layout, so no constraint is
    needed. The stable ABI can attach tags at definition time only from torch 2.12
    (StableLibrary::def(schema, tags)); the wheel supports 2.11, so the tag is added to the overload
    objects here, which is what torch.compile reads (OpOverload.tags)."""
    flexible = torch.Tag.flexible_layout
    # every op the library defines (iterating torch.ops.gnext yields only the ops looked up so far)
    names = [n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("gnext::")]
    for name in names:
        packet = getattr(ops, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if flexible not in op.tags:
                op._tags = [*op.tags, flexible]


mark_flexible_layout()
