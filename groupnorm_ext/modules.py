"""nn.Module drop-ins for torch.nn.GroupNorm and a helper that swaps them into a model."""
from __future__ import annotations

import torch
from torch import nn

from .functional import conv_transpose2d_gelu_group_norm, group_norm, group_norm_act


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


def convert_conv_transpose_gelu_group_norm(module: nn.Module) -> nn.Module:
    """Fuses every ``nn.ConvTranspose2d -> nn.GELU -> nn.GroupNorm`` run of three consecutive children
    of an ``nn.Sequential`` (recursively) into :class:`ConvTranspose2dGELUGroupNorm`, sharing the
    parameters; the GELU and GroupNorm slots become ``nn.Identity`` so indices stay valid. Returns
    ``module``. Patterns written in a ``forward`` method (not a Sequential) are not detected. The
    converted model's ``state_dict`` keys change (``0.weight`` -> ``0.conv.weight``): load a
    checkpoint before converting.
    """
    for child in module.children():
        convert_conv_transpose_gelu_group_norm(child)
    if isinstance(module, nn.Sequential):
        mods = list(module)
        for i in range(len(mods) - 2):
            a, b, c = mods[i], mods[i + 1], mods[i + 2]
            if (type(a) is nn.ConvTranspose2d and type(b) is nn.GELU and type(c) is nn.GroupNorm
                    and a.padding_mode == "zeros" and isinstance(a.padding, tuple)):
                module[i] = ConvTranspose2dGELUGroupNorm.from_modules(a, b, c)
                module[i + 1], module[i + 2] = nn.Identity(), nn.Identity()
                mods = list(module)
    return module


class GroupNormAct(nn.GroupNorm):
    r"""``act(GroupNorm(x)) [+ residual]`` (:func:`groupnorm_ext.functional.group_norm_act`).

    Same constructor as ``nn.GroupNorm`` plus ``activation`` (default ``"silu"``); same parameters and
    ``state_dict`` keys (``weight``, ``bias``), so an ``nn.GroupNorm`` checkpoint loads.
    ``forward(x, residual=None)``.
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, activation="silu", device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input: torch.Tensor, residual: torch.Tensor = None) -> torch.Tensor:
        return group_norm_act(input, self.num_groups, self.weight, self.bias, self.eps, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"


def _activation_name(m: nn.Module):
    """group_norm_act's name for an activation module, or None."""
    if type(m) is nn.SiLU:
        return "silu"
    if type(m) is nn.GELU:
        return "gelu" if m.approximate == "none" else "gelu_tanh"
    if type(m) is nn.ReLU:
        return "relu"
    if type(m) is nn.Tanh:
        return "tanh"
    if type(m) is nn.Hardswish:
        return "hardswish"
    return None


def convert_group_norm_act(module: nn.Module) -> nn.Module:
    """Fuses ``nn.GroupNorm`` followed by an activation module (SiLU, GELU, ReLU, Tanh, Hardswish) as
    consecutive children of an ``nn.Sequential`` (recursively) into :class:`GroupNormAct`, sharing
    the parameters; the activation's slot becomes ``nn.Identity``. Remaining ``nn.GroupNorm``s become
    :class:`GroupNorm` (:func:`convert_group_norm`). Returns ``module``.

    Detected: patterns in ``nn.Sequential`` containers (timm's ``GroupNormAct`` layers are also
    replaced: any module of class name ``GroupNormAct`` with ``act`` one of the modules above).
    Not detected: a GroupNorm and an activation called in sequence from a ``forward`` method (e.g.
    diffusers' ``ResnetBlock2D``: ``norm1`` then ``nonlinearity``), since that is code, not module
    structure; those GroupNorms still get gnext's kernels through :func:`convert_group_norm`.
    """
    for name, child in module.named_children():
        if type(child).__name__ == "GroupNormAct" and isinstance(child, nn.GroupNorm) \
                and not isinstance(child, GroupNormAct) and _activation_name(getattr(child, "act", None)):
            new = GroupNormAct(child.num_groups, child.num_channels, child.eps, child.affine,
                               _activation_name(child.act), device="meta")
            if child.affine:
                new.weight, new.bias = child.weight, child.bias
            setattr(module, name, new)
        else:
            convert_group_norm_act(child)
    if isinstance(module, nn.Sequential):
        for i in range(len(module) - 1):
            a, b = module[i], module[i + 1]
            act = _activation_name(b)
            if type(a) is nn.GroupNorm and act is not None:
                new = GroupNormAct(a.num_groups, a.num_channels, a.eps, a.affine, act, device="meta")
                if a.affine:
                    new.weight, new.bias = a.weight, a.bias
                new.train(a.training)
                module[i], module[i + 1] = new, nn.Identity()
    return convert_group_norm(module)
