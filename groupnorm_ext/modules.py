"""nn.Module drop-ins for torch.nn.GroupNorm and a helper that swaps them into a model."""
from __future__ import annotations

import torch
from torch import nn

from .functional import group_norm


class GroupNorm(nn.GroupNorm):
    r"""Drop-in for :class:`torch.nn.GroupNorm` running gnext's kernels.

    Same constructor (``num_groups, num_channels, eps=1e-5, affine=True, device=None,
    dtype=None``), parameters (``weight``, ``bias`` of shape ``(C,)``), ``reset_parameters``,
    ``extra_repr`` and ``state_dict`` keys as ``nn.GroupNorm``: checkpoints load both ways.
    Input ``(N, C, *)``, output of the same shape (see :func:`groupnorm_ext.group_norm`).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


def convert_group_norm(module: nn.Module) -> nn.Module:
    """Replaces every ``nn.GroupNorm`` in ``module`` (recursively, the root included) by
    :class:`GroupNorm`, sharing its parameters (no copy), and returns the converted module.

    Modules that are already ``groupnorm_ext.GroupNorm`` and subclasses of ``nn.GroupNorm``
    other than ``nn.GroupNorm`` itself are left alone.
    """
    if type(module) is nn.GroupNorm:
        new = GroupNorm(module.num_groups, module.num_channels, module.eps, module.affine,
                        device="meta")
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = convert_group_norm(child)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
