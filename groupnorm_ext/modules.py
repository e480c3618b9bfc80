# SPDX-License-Identifier: BSD-3-Clause
"""nn.Module drop-ins: GroupNorm (for torch.nn.GroupNorm), GroupNormAct (GroupNorm + activation + residual) and
ConvTranspose2dGELUGroupNorm. The converters that swap them into a model are in convert.py."""
from __future__ import annotations

import torch
from torch import nn

from .functional import ACTIVATIONS, conv_transpose2d_gelu_group_norm, group_norm, group_norm_act


class GroupNorm(nn.GroupNorm):
    r"""Drop-in for :class:`torch.nn.GroupNorm` running gnext's kernels.

    Same constructor (``num_groups, num_channels, eps=1e-5, affine=True, device=None,
    dtype=None``), parameters (``weight``, ``bias`` of shape ``(C,)``), ``reset_parameters``,
    ``extra_repr`` and ``state_dict`` keys as ``nn.GroupNorm``: checkpoints load both ways.
    Input ``(N, C, *)``, output of the same shape (see :func:`groupnorm_ext.group_norm`).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


class ConvTranspose2dGELUGroupNorm(nn.Module):
    r"""``GroupNorm(GELU(ConvTranspose2d(x)))`` as one fused op
    (:func:`groupnorm_ext.functional.conv_transpose2d_gelu_group_norm`).

    Holds an ``nn.ConvTranspose2d`` as ``conv`` and an ``nn.GroupNorm`` as ``norm``, so the
    ``state_dict`` keys are ``conv.weight``, ``conv.bias``, ``norm.weight``, ``norm.bias``. A
    checkpoint of an unfused model maps by renaming its submodule prefixes, e.g. KernelBench L2#19's
    ``conv_transpose.* -> conv.*`` and ``group_norm.* -> norm.*``, or ``nn.Sequential``'s
    ``0.* -> conv.*`` and ``2.* -> norm.*``; :meth:`from_modules` shares the parameters of live
    modules instead. Input ``(N, C_in, H, W)``; output ``(N, C_out, H_out, W_out)``.
    """

    def __init__(self, in_channels, out_channels, kernel_size, num_groups, stride=1, padding=0, output_padding=0,
                 groups=1, bias=True, dilation=1, eps=1e-5, affine=True, approximate="none", device=None,
                 dtype=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        kw = {"device": device, "dtype": dtype}
        self.conv = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride, padding, output_padding,
                                       groups, bias, dilation, **kw)
        self.norm = nn.GroupNorm(num_groups, out_channels, eps, affine, **kw)
        self.approximate = approximate

    @classmethod
    def from_modules(cls, conv: nn.ConvTranspose2d, gelu: nn.GELU, norm: nn.GroupNorm):
        """Fused module sharing ``conv``'s and ``norm``'s parameters (no copy)."""
        if conv.padding_mode != "zeros" or not isinstance(conv.padding, tuple):
            raise ValueError(f"only padding_mode='zeros' with explicit padding is supported, got {conv.padding_mode!r}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.conv, new.norm, new.approximate = conv, norm, gelu.approximate
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        c, n = self.conv, self.norm
        return conv_transpose2d_gelu_group_norm(input, c.weight, c.bias, n.num_groups, n.weight, n.bias, c.stride,
                                                c.padding, c.output_padding, c.dilation, c.groups, n.eps,
                                                self.approximate)


class GroupNormAct(nn.GroupNorm):
    r"""``act(GroupNorm(x)) [+ residual]`` (:func:`groupnorm_ext.functional.group_norm_act`).

    Same constructor as ``nn.GroupNorm`` (``num_groups, num_channels, eps=1e-5, affine=True, device=None,
    dtype=None``, keyword ``bias=True``: ``bias=False`` drops the shift, as in ``nn.GroupNorm``) plus
    ``activation`` (default ``"silu"``, one of ``groupnorm_ext.functional.ACTIVATIONS``); same parameters and
    ``state_dict`` keys (``weight``, ``bias``), so an ``nn.GroupNorm`` checkpoint loads.
    ``forward(x, residual=None)``.

    Raises:
        ValueError: ``activation`` not one of ``ACTIVATIONS`` (at construction, not at the first forward).
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, activation="silu", device=None, dtype=None,
                 *, bias=True):
        if activation not in ACTIVATIONS:
            raise ValueError(f"GroupNormAct: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        if affine and not bias:  # nn.GroupNorm's bias=False (torch >= 2.12 has the keyword; 2.11 does not)
            self.register_parameter("bias", None)
        self.activation = activation

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return group_norm_act(input, self.num_groups, self.weight, self.bias, self.eps, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"
