# SPDX-License-Identifier: BSD-3-Clause
"""Converters that swap gnext's modules into a model, sharing its parameters: convert_group_norm (nn.GroupNorm and
timm's GroupNorm layers), convert_group_norm_act (GroupNorm -> activation pairs, timm's GroupNormAct, diffusers'
ResnetBlock2D) and convert_conv_transpose_gelu_group_norm (ConvTranspose2d -> GELU -> GroupNorm runs)."""
from __future__ import annotations

import logging
import types
import warnings
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._cpu import channel_view
from .functional import group_norm_act, group_norm_act_modulate, group_norm_act_pad
from .modules import ConvTranspose2dGELUGroupNorm, GroupNorm, GroupNormAct

_log = logging.getLogger("groupnorm_ext")


def convert_group_norm(module: nn.Module, *, return_counts: bool = False):
    """Replaces every GroupNorm layer of ``module`` (recursively, the root included) by
    :class:`GroupNorm`, sharing its parameters (no copy), and returns the converted module.

    Converted: ``nn.GroupNorm``, its subclasses that keep ``nn.GroupNorm.forward``, and timm's
    ``GroupNorm`` and ``GroupNorm1`` (``timm.layers``: ``F.group_norm`` in their forward). Left alone,
    and counted as ``skipped``: other subclasses with a forward of their own (unknown semantics), and
    gnext's own modules. ``state_dict`` keys and the ``training`` flag are kept. A summary is logged
    (logger ``groupnorm_ext``, INFO); a model with GroupNorm layers of which none was converted gets a
    ``UserWarning``.

    Args:
        module: any ``nn.Module``.
        return_counts: also return the counts ``{"group_norm": n, "group_norm_act": 0,
            "resnet_block2d": 0, "pad_into_conv": 0, "spatial_norm": 0, "stream_bias": 0, "skipped": n}`` (the keys of
            :func:`convert_group_norm_act`).

    Returns:
        The converted module (``module`` itself unless it is a GroupNorm), or ``(module, counts)``.
    """
    counts = _new_counts()
    module = _convert(module, counts, act=False)
    _report("convert_group_norm", module, counts)
    return (module, counts) if return_counts else module


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


_TIMM_ACTS = {"Swish": "silu", "Tanh": "tanh", "HardSwish": "hardswish", "GELU": "gelu", "GELUTanh": "gelu_tanh"}


def _activation_name(m: object):
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
    if m is not None and type(m).__module__.startswith("timm.layers"):
        return _TIMM_ACTS.get(type(m).__name__)
    return None


def _timm(m: nn.Module, *names: str) -> bool:
    return type(m).__module__.startswith("timm.layers") and type(m).__name__ in names


def _plain_group_norm(m: object) -> bool:
    """A GroupNorm layer whose forward is plain GroupNorm (converted to gnext's GroupNorm)."""
    if not isinstance(m, nn.GroupNorm) or isinstance(m, (GroupNorm, GroupNormAct)):
        return False
    return type(m).forward is nn.GroupNorm.forward or _timm(m, "GroupNorm", "GroupNorm1")


def _timm_group_norm_act(m: nn.Module):
    """The activation name of a timm GroupNormAct / GroupNorm1Act that gnext can run (its dropout slot
    empty, its activation known or identity), else None."""
    if not isinstance(m, nn.GroupNorm) or not _timm(m, "GroupNormAct", "GroupNorm1Act"):
        return None
    if type(getattr(m, "drop", None)) is not nn.Identity:
        return None
    act = getattr(m, "act", None)
    return "identity" if type(act) is nn.Identity else _activation_name(act)


def _from_group_norm(cls, m, *extra, **kwargs) -> nn.GroupNorm:
    """cls (a GroupNorm subclass taking nn.GroupNorm's arguments) sharing m's parameters, in m's training mode."""
    new = cls(m.num_groups, m.num_channels, m.eps, m.affine, *extra, device="meta", **kwargs)
    if m.affine:
        new.weight, new.bias = m.weight, m.bias
    new.train(m.training)
    return new


def _new_counts() -> dict:
    return {"group_norm": 0, "group_norm_act": 0, "resnet_block2d": 0, "pad_into_conv": 0, "spatial_norm": 0,
            "stream_bias": 0, "skipped": 0}


def _convert(module: nn.Module, counts: dict, act: bool, blocks: bool = False, into_conv: bool = False) -> nn.Module:
    """Converts module and its children in place; returns module, or its replacement if it is a norm. into_conv:
    blocks whose norms can write their convolution's padded input do (CogVideoXResnetBlock3D)."""
    name = _timm_group_norm_act(module) if act else None
    if name is not None:
        counts["group_norm_act"] += 1
        return _from_group_norm(GroupNormAct, module, name)
    if _plain_group_norm(module):
        counts["group_norm"] += 1
        return _from_group_norm(GroupNorm, module)
    if isinstance(module, nn.GroupNorm) and not isinstance(module, (GroupNorm, GroupNormAct)):
        counts["skipped"] += 1
        _log.info("gnext: left %s alone (a GroupNorm subclass with a forward of its own)", type(module).__name__)
        return module
    if blocks:
        _fuse_blocks(module, counts)
        _fuse_spatial_norm(module, counts)
        if into_conv and act:
            _fuse_cog_resnet3d(module, counts)
    if act and isinstance(module, nn.Sequential):  # a GroupNorm, then an activation module
        for i in range(len(module) - 1):
            a, b = module[i], module[i + 1]
            name = _activation_name(b)
            if _plain_group_norm(a) and name is not None:
                module[i], module[i + 1] = _from_group_norm(GroupNormAct, a, name), nn.Identity()
                counts["group_norm_act"] += 1
    for child_name, child in module.named_children():
        new = _convert(child, counts, act, blocks, into_conv)
        if new is not child:
            setattr(module, child_name, new)
    return module


def _report(what: str, module: nn.Module, counts: dict) -> None:
    _log.info("gnext %s: %s", what, ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    converted = counts["group_norm"] + counts["group_norm_act"]
    if converted == 0 and counts["skipped"] > 0:
        warnings.warn(f"gnext {what}: the model has {counts['skipped']} GroupNorm layer(s) and none was converted "
                      f"(subclasses of nn.GroupNorm with a forward of their own are left alone)", stacklevel=3)


def convert_group_norm_act(module: nn.Module, *, blocks: bool = True, return_counts: bool = False,
                           example_inputs: tuple | None = None, pad_into_conv: bool = True):
    """Like :func:`convert_group_norm`, and also fuses each GroupNorm with the activation after it into
    :class:`GroupNormAct` (``act(group_norm(x))`` in one kernel), sharing the parameters:

    * ``nn.GroupNorm`` followed by an activation module (SiLU, GELU, ReLU, Tanh, Hardswish, or timm's
      Swish/GELU/GELUTanh/Tanh/HardSwish) as consecutive children of an ``nn.Sequential``; the
      activation's slot becomes ``nn.Identity`` (indices stay valid);
    * timm's ``GroupNormAct`` / ``GroupNorm1Act`` (activation inside the norm module; kept as is when
      its dropout slot is used or its activation is not one of the above);
    * with ``example_inputs``, every pair found by running ``module(*example_inputs)`` once: a GroupNorm module
      whose every output went only into one activation module (above), whatever the block's class (video VAEs'
      causal 3-D blocks, a shared ``nonlinearity`` module). The norm becomes a :class:`GroupNormAct` and the
      activation a gate that passes that norm's output through unchanged and applies the activation to any
      other input (a time embedding). The pairing is what that forward did: a forward whose control flow
      depends on the input may need another example. Where the activated output went (through an identity
      dropout) only into ``F.pad`` (replicate or constant) inside a module that passed the padded tensor to one
      child and returned that child's output (a causal convolution: ``self.conv(F.pad(x, pad, mode=...))``), the
      norm writes the padded tensor itself (:func:`group_norm_act_pad`) and that module's forward hands it to the
      child without padding: one pass less over the tensor, and no unpadded copy in memory
      (``pad_into_conv``; counted as ``pad_into_conv``). Other inputs of that module run its own forward. With
      ``pad_into_conv``, also: a biased ``nn.Conv1d/2d/3d`` whose every output went only into such a padded norm
      runs without its bias inside the smallest module holding both, and the norm adds it as it reads
      (``input_bias``; called by itself, under ``torch.compile`` or once that norm is swapped out, the convolution
      adds its own); and a module that padded its own input by 0 on every side for one convolution child (a copy:
      1x1x1 causal convolutions) hands the input to that child;
    * with ``blocks=True``, diffusers' ``ResnetBlock2D``: ``norm1 -> nonlinearity`` and (unless
      ``time_embedding_norm="scale_shift"``) ``norm2 -> nonlinearity`` are called from its
      ``forward``, so the block gets a forward that calls the fused norms (:func:`_fuse_blocks`); the
      time-embedding path keeps its own activation. Same results and ``state_dict`` keys;
    * with ``blocks=True``, diffusers' ``CogVideoXSpatialNorm3D`` (``group_norm(f) * conv_y + conv_b``, a spatially
      conditioned norm): its product and sum run in the norm's pass (:func:`group_norm_act_modulate`), and with
      ``example_inputs``, where its output went only into an activation module, the activation too (counted as
      ``spatial_norm``). Its forward is checked against diffusers' source (0.35.1); another one is left alone with a
      warning. Its ``conv_y`` and ``conv_b`` (pointwise) convolve the latents at their own height and width, and
      the op upsamples them as it reads them;
    * with ``blocks=True`` and ``pad_into_conv``, diffusers' ``CogVideoXResnetBlock3D``: each spatial norm -> SiLU
      writes its output straight into its causal convolution's input buffer, after the cached frames that the
      convolution would concatenate before it (both counted as ``pad_into_conv``), where no gradient is needed
      (the block's own forward otherwise). Its and the convolution's source are checked as above;
    * with ``example_inputs`` and ``pad_into_conv``, diffusers' ``HunyuanVideoResnetBlockCausal3D`` and
      ``HunyuanVideoUpsampleCausal3D`` (source checked against 0.35.1), where no gradient is needed: an up-sampler
      writes its convolution's replicate-padded input in one buffer (no interpolated, concatenated and padded
      copies), and a block whose every output went only into such blocks or a padded norm (the trace shows it)
      returns it without its convolutions' biases: the next block's padded norm adds them as it reads, its residual
      sum and convolutions carry them on (counted as ``stream_bias``). Called by itself, a block adds its own.

    Args:
        module: any ``nn.Module``.
        blocks: fuse the pairs inside diffusers ``ResnetBlock2D`` blocks.
        return_counts: also return ``{"group_norm": n, "group_norm_act": n, "resnet_block2d": n,
            "pad_into_conv": n, "spatial_norm": n, "stream_bias": n, "skipped": n}`` (``pad_into_conv``: fused norms
            that write padded outputs; ``spatial_norm``: modulated norms, with their activation where it was paired;
            ``stream_bias``: blocks that leave their biases to the next).
        example_inputs: arguments of one forward of ``module`` (run under ``torch.no_grad``) to find the
            GroupNorm -> activation pairs by what the forward does (module calls and the ops that consume each
            GroupNorm output).
        pad_into_conv: with ``example_inputs``, write padded outputs where the activation's output is only
            padded for one child module, with the bias and zero-padding rewrites around them, and CogVideoX's
            blocks (above); False keeps every fused norm's output unpadded and every other module's forward.

    Returns:
        The converted module, or ``(module, counts)``. GroupNorms without an activation after them
        become :class:`GroupNorm`.
    """
    counts = _new_counts()
    if example_inputs is not None:
        _fuse_traced_pairs(module, tuple(example_inputs), counts, pad_into_conv)
    module = _convert(module, counts, act=True, blocks=blocks, into_conv=pad_into_conv)
    _report("convert_group_norm_act", module, counts)
    fused_act = counts["group_norm_act"] + counts["pad_into_conv"]
    if fused_act == 0 and counts["group_norm"] > 0 and example_inputs is None and any(
            _activation_name(m) is not None or isinstance(m, _ActivationGate) for m in module.modules()):
        warnings.warn(f"gnext convert_group_norm_act: {counts['group_norm']} GroupNorm(s) converted, none fused with "
                      "an activation: the model's blocks have no rule here; pass example_inputs=(...) to find the "
                      "GroupNorm -> activation pairs by running it once", stacklevel=2)
    return (module, counts) if return_counts else module


# --- pairs found by running the model -----------------------------------------------------------------
class _ActivationGate(nn.Module):
    """An activation module whose paired GroupNorms already applied it: their output passes through unchanged,
    any other input (a time embedding through the same module) gets the activation."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act
        self._fused: list[weakref.ref] = []  # outputs of the paired norms not yet seen here

    def announce(self, out: torch.Tensor) -> torch.Tensor:
        """Called by a paired norm with its output (returned): that tensor passes through here unchanged."""
        self._fused.append(weakref.ref(out))
        return out

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        for i, ref in enumerate(self._fused):
            if ref() is input:
                del self._fused[i]
                return input
        self._fused = [r for r in self._fused if r() is not None]
        return self.act(input)


class _GatedGroupNormAct(GroupNormAct):
    """GroupNormAct that tells its activation gate which tensor it produced (the gate is not a submodule: the
    state_dict keys stay the norm's own)."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.__dict__["_gate"].announce(super().forward(input, residual))


class _PaddedGroupNormAct(_GatedGroupNormAct):
    """A gated GroupNormAct whose output feeds a module that pads it (F.pad(x, pad, mode, value)) and passes the
    result to one child (a causal convolution): it writes the padded tensor (group_norm_act_pad) and returns its
    interior, a view that module's forward (_padded_forward) recognizes and unwraps, so no padding pass runs.
    Anything else that gets the view sees act(group_norm(x)) itself."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        conv = self.__dict__.get("_bias_conv")  # a convolution whose output (here) may lack its bias (_fold_bias)
        ib: torch.Tensor | None = None
        if conv is not None and getattr(input, "_gnext_bias_from", None) is conv:
            ib = getattr(conv, "bias")
        ib = _add(ib, _pending(input))  # a residual stream's biases (_hy_resnet_forward)
        if residual is not None or torch.compiler.is_compiling():
            return super().forward(_with_pending(input, ib), residual)
        pad, mode, value = self.__dict__["_pad"]
        padded = group_norm_act_pad(input, self.num_groups, self.weight, self.bias, self.eps, self.activation, pad,
                                    mode, value, input_bias=ib)
        y = padded
        for k in range(len(pad) // 2):
            d = padded.dim() - 1 - k
            y = y.narrow(d, pad[2 * k], input.shape[d])
        setattr(y, "_gnext_padded_for", self.__dict__["_pad_target"])
        return self.__dict__["_gate"].announce(y)


def _unpadded_forward(self, input, *args, **kwargs):
    """Forward of a module whose traced forward was conv(F.pad(input, pad)) with every pad value 0: F.pad then only
    copies input, which goes to the convolution (a direct child; it does not write its input) as it is."""
    if args or kwargs:
        return type(self).forward(self, input, *args, **kwargs)
    return getattr(self, self.__dict__["_gnext_pad_child"])(input)


def _padded_forward(self, input, *args, **kwargs):
    """Forward of a module whose traced forward was child(F.pad(input, ...)): a padded norm's interior view goes
    straight to the child as the whole padded tensor; any other input runs the class's forward."""
    if (not args and not kwargs and not torch.compiler.is_compiling()
            and getattr(input, "_gnext_padded_for", None) is self and input._base is not None):
        return getattr(self, self.__dict__["_gnext_pad_child"])(input._base)
    return type(self).forward(self, input, *args, **kwargs)


def _bias_deferred_forward(self, input):
    """Forward of a convolution whose every traced output went only into one padded norm's F.group_norm: inside the
    traced forward of the block holding both (_fold_bias), its output without the bias, marked for that norm, which
    adds the bias as it reads (input_bias): one broadcast pass over the output less. Called anywhere else, under
    torch.compile, or once that norm is no longer in its place in the block (swapped by later model surgery), the
    class's forward."""
    block, path, norm = self.__dict__["_gnext_fold_block"]
    if (torch.compiler.is_compiling() or not block.__dict__.get("_gnext_running")
            or block.get_submodule(path) is not norm):
        return type(self).forward(self, input)
    out = self._conv_forward(input, self.weight, None)
    setattr(out, "_gnext_bias_from", self)
    return out


def _block_enter(block, _args):
    if not torch.compiler.is_compiling():
        block.__dict__["_gnext_running"] = block.__dict__.get("_gnext_running", 0) + 1


def _block_exit(block, _args, _output):
    if not torch.compiler.is_compiling():
        block.__dict__["_gnext_running"] -= 1


def _track_running(block: nn.Module) -> None:
    """block.__dict__["_gnext_running"] counts its forwards in progress (hooks, once per block)."""
    if "_gnext_running" not in block.__dict__:
        block.__dict__["_gnext_running"] = 0
        block.register_forward_pre_hook(_block_enter)
        block.register_forward_hook(_block_exit, always_call=True)


def _common_depth(paths: list) -> int:
    """How many leading names the qualified module paths (each split at ".") share, leaving each at least one of its
    own: the depth of the smallest module holding them all."""
    k = 0
    while all(len(p) > k + 1 and p[k] == paths[0][k] for p in paths):
        k += 1
    return k


def _fold_bias(module: nn.Module, names: dict, conv: nn.Module, norm: nn.Module, fused: nn.Module) -> None:
    """conv (its outputs went only into norm, a GroupNorm of module that fused, the padded norm, replaces) runs
    without its bias inside the smallest module of `module` holding both, and fused adds the bias
    (_bias_deferred_forward). names: module's submodules' qualified names."""
    a, b = names[conv].split("."), names[norm].split(".")
    k = _common_depth([a, b])
    block = module.get_submodule(".".join(a[:k]))
    _track_running(block)
    conv.__dict__["_gnext_fold_block"] = (block, ".".join(b[k:]), fused)
    conv.forward = types.MethodType(_bias_deferred_forward, conv)
    fused.__dict__["_bias_conv"] = conv


# --- diffusers HunyuanVideo: convolution biases carried down the residual stream, up-samplers' padded inputs ----
# An up-sampler writes its convolution's replicate-padded input in one buffer (_hy_upsampled_padded), bitwise what its
# interpolations, concatenation and F.pad make. A HunyuanVideoResnetBlockCausal3D returns conv2(...) + residual and
# a HunyuanVideoUpsampleCausal3D returns conv(...): PyTorch adds each convolution's bias in a broadcast pass over its
# output. Where the trace shows that such a block's
# output goes only into blocks that know the form below (the next resnet block or up-sampler, or a padded norm), the
# block returns its output without those biases and marks it with the per-channel vector still to add ("pending",
# float32, (C,)). The next block carries it on: its norm1 adds it as it reads (input_bias), its residual sum carries
# it to the output's vector, a 1x1x1 shortcut or the up-sampler's convolution folds it into its own bias (a constant
# channel through replicate padding and nearest upsampling stays constant: conv(x + p) = conv(x) + sum_k W p). Only
# where no gradient is needed, and only while the smallest module holding the block and those consumers runs (a
# block called by itself adds its vector). Forwards checked against diffusers' source (0.35.1).
_HY_RESNET = (
    "hidden_states = hidden_states.contiguous()\n        residual = hidden_states\n\n"
    "        hidden_states = self.norm1(hidden_states)\n        hidden_states = self.nonlinearity(hidden_states)\n"
    "        hidden_states = self.conv1(hidden_states)\n\n"
    "        hidden_states = self.norm2(hidden_states)\n        hidden_states = self.nonlinearity(hidden_states)\n"
    "        hidden_states = self.dropout(hidden_states)\n        hidden_states = self.conv2(hidden_states)\n\n"
    "        if self.conv_shortcut is not None:\n            residual = self.conv_shortcut(residual)\n\n"
    "        hidden_states = hidden_states + residual\n        return hidden_states",)
_HY_UPSAMPLE = (
    "first_frame, other_frames = hidden_states.split((1, num_frames - 1), dim=2)",
    "first_frame = F.interpolate(\n            first_frame.squeeze(2), scale_factor=self.upsample_factor[1:], "
    'mode="nearest"\n        ).unsqueeze(2)',
    "other_frames = other_frames.contiguous()\n            other_frames = F.interpolate(other_frames, "
    'scale_factor=self.upsample_factor, mode="nearest")\n'
    "            hidden_states = torch.cat((first_frame, other_frames), dim=2)\n        else:\n"
    "            hidden_states = first_frame\n\n        hidden_states = self.conv(hidden_states)\n"
    "        return hidden_states")
_HY_CAUSAL_CONV = ("hidden_states = F.pad(hidden_states, self.time_causal_padding, mode=self.pad_mode)\n"
                   "        return self.conv(hidden_states)",)


def _diffusers_class(m, name: str) -> bool:
    cls = type(m)
    return cls.__name__ == name and cls.__module__.startswith("diffusers.")


def _hy_causal_conv(m) -> bool:
    """m is diffusers' HunyuanVideoCausalConv3d around a plain Conv3d without padding of its own."""
    c = getattr(m, "conv", None)
    return (_diffusers_class(m, "HunyuanVideoCausalConv3d") and type(c) is nn.Conv3d
            and c.padding_mode == "zeros" and tuple(c.padding) == (0, 0, 0) and _source_has(type(m), _HY_CAUSAL_CONV))


def _hy_resnet_convs(m: nn.Module) -> bool:
    """m's conv2 and shortcut (if any) are the causal convolutions _hy_conv_unbiased runs."""
    shortcut = getattr(m, "conv_shortcut", None)
    return _hy_causal_conv(getattr(m, "conv2", None)) and (shortcut is None or _hy_causal_conv(shortcut))


def _is_hy_resnet(m: nn.Module) -> bool:
    return (_diffusers_class(m, "HunyuanVideoResnetBlockCausal3D") and "forward" not in m.__dict__
            and _hy_resnet_convs(m) and _source_has(type(m), _HY_RESNET))


def _is_hy_upsample(m: nn.Module) -> bool:
    return (_diffusers_class(m, "HunyuanVideoUpsampleCausal3D") and "forward" not in m.__dict__
            and _hy_causal_conv(getattr(m, "conv", None)) and _source_has(type(m), _HY_UPSAMPLE))


def _pending(t: torch.Tensor):
    return getattr(t, "_gnext_pending", None)


def _with_pending(t: torch.Tensor, pend) -> torch.Tensor:
    """t + pend[c] in t's dtype (a new tensor), or t where pend is None."""
    return t if pend is None else t + channel_view(pend.to(t.dtype), t)


def _stream_defers(m: nn.Module) -> bool:
    """m may return its output without its biases: the trace cleared it, its enclosing module is running, no
    gradient is needed and nothing is being compiled."""
    block = m.__dict__.get("_gnext_stream_block")
    return (block is not None and bool(block.__dict__.get("_gnext_running")) and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def _stream_out(m: nn.Module, out: torch.Tensor, pend) -> torch.Tensor:
    """out marked with its pending vector where m defers, else with it added (in place: out is m's own)."""
    if pend is None:
        return out
    if _stream_defers(m):
        setattr(out, "_gnext_pending", pend)
        return out
    return out.add_(channel_view(pend.to(out.dtype), out))


def _hy_conv_unbiased(cc, h, pend=None, src=None):
    """HunyuanVideoCausalConv3d cc on h + pend[c] (pend: None or float32 (C,)), without its bias: (output, the
    float32 vector its output lacks, or None). A padded norm's interior view (made for cc) goes in as the whole
    padded tensor, as does src (h's replicate-padded form, made by the caller); replicate (or no) padding keeps a
    constant channel constant, so pend folds into the bias."""
    c = cc.conv
    pad = tuple(cc.time_causal_padding)
    if pend is not None and (c.groups != 1 or (any(pad) and cc.pad_mode != "replicate")):  # it does not fold
        if src is not None:  # replicate-padded: pend added to the halo too is the padding of h + pend
            src = _with_pending(src, pend)
        else:
            h = _with_pending(h, pend)
        pend = None
    if src is None:
        if getattr(h, "_gnext_padded_for", None) is cc and h._base is not None:
            src = h._base
        else:
            src = torch.nn.functional.pad(h, pad, mode=cc.pad_mode) if any(pad) else h
    out = c._conv_forward(src, c.weight, None)
    b = None if c.bias is None else c.bias.float()
    if pend is not None:
        fold = c.weight.float().sum(dim=(2, 3, 4)) @ pend
        b = fold if b is None else b + fold
    return out, b


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _hy_resnet_forward(self, hidden_states):
    """diffusers HunyuanVideoResnetBlockCausal3D.forward carrying convolution biases down the residual stream (see
    above): its input's pending vector goes to norm1 and to the output's; conv2 and the shortcut run without their
    bias. With a gradient, under compile, or where conv2 or the shortcut is no longer a HunyuanVideoCausalConv3d
    (swapped after the conversion: a split decode's halo convolution, say), the class's forward."""
    pend = _pending(hidden_states)
    if pend is None and not _stream_defers(self):
        return type(self).forward(self, hidden_states)
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _hy_resnet_convs(self):  # or swapped since
        return type(self).forward(self, _with_pending(hidden_states, pend))
    x = hidden_states.contiguous()
    if pend is not None and not isinstance(self.norm1, _PaddedGroupNormAct):  # only the padded norm reads it
        x, pend = _with_pending(x, pend), None
    elif pend is not None:
        setattr(x, "_gnext_pending", pend)
    h = self.norm1(x)
    h = self.nonlinearity(h)
    h = self.conv1(h)
    h = self.norm2(h)
    h = self.nonlinearity(h)
    h = self.dropout(h)
    out, b2 = _hy_conv_unbiased(self.conv2, h)
    if self.conv_shortcut is not None:
        residual, bs = _hy_conv_unbiased(self.conv_shortcut, x, pend)
        pend = _add(b2, bs)
    else:
        residual, pend = x, _add(b2, pend)
    return _stream_out(self, out + residual, pend)


def _hy_upsampled_padded(self, x: torch.Tensor) -> torch.Tensor | None:
    """The up-sampler's convolution input, replicate-padded, written in one buffer: each frame of x repeated by the
    integer factors (the first frame along height and width only, as F.interpolate's nearest mode does it), then
    the halo copied from the edges, width, height, then time (replicate padding is the clamp of each index, so one
    dimension after the other gives it). What the up-sampler's forward builds with two interpolations, a
    concatenation and F.pad, without those three full-size tensors. None where the factors are not integers or
    the padding is not replicate."""
    cc = self.conv
    f = tuple(self.upsample_factor)
    if len(f) != 3 or any(float(v) != int(v) or int(v) < 1 for v in f) or cc.pad_mode != "replicate" or x.dim() != 5:
        return None
    ft, fh, fw = (int(v) for v in f)
    pw0, pw1, ph0, ph1, pt0, pt1 = (int(p) for p in cc.time_causal_padding)
    N, C, T, H, W = x.shape
    To, Ho, Wo = 1 + ft * (T - 1), fh * H, fw * W
    buf = x.new_empty((N, C, pt0 + To + pt1, ph0 + Ho + ph1, pw0 + Wo + pw1))
    inner = buf[:, :, pt0:pt0 + To, ph0:ph0 + Ho, pw0:pw0 + Wo]
    inner[:, :, 0].unflatten(-1, (W, fw)).unflatten(-3, (H, fh)).copy_(
        x[:, :, 0, :, None, :, None].expand(N, C, H, fh, W, fw))
    if T > 1:
        inner[:, :, 1:].unflatten(-1, (W, fw)).unflatten(-3, (H, fh)).unflatten(2, (T - 1, ft)).copy_(
            x[:, :, 1:, None, :, None, :, None].expand(N, C, T - 1, ft, H, fh, W, fw))
    rows, frames = slice(ph0, ph0 + Ho), slice(pt0, pt0 + To)
    if pw0:
        buf[:, :, frames, rows, :pw0] = buf[:, :, frames, rows, pw0:pw0 + 1]
    if pw1:
        buf[:, :, frames, rows, pw0 + Wo:] = buf[:, :, frames, rows, pw0 + Wo - 1:pw0 + Wo]
    if ph0:
        buf[:, :, frames, :ph0] = buf[:, :, frames, ph0:ph0 + 1]
    if ph1:
        buf[:, :, frames, ph0 + Ho:] = buf[:, :, frames, ph0 + Ho - 1:ph0 + Ho]
    if pt0:
        buf[:, :, :pt0] = buf[:, :, pt0:pt0 + 1]
    if pt1:
        buf[:, :, pt0 + To:] = buf[:, :, pt0 + To - 1:pt0 + To]
    return buf


def _hy_upsample_forward(self, hidden_states):
    """diffusers HunyuanVideoUpsampleCausal3D.forward where no gradient is needed: the convolution's padded input
    written in one buffer (_hy_upsampled_padded), its input's pending vector folded into the convolution's bias,
    and that bias carried on (see above); elsewhere the class's forward on the input with its pending vector
    added."""
    pend = _pending(hidden_states)
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _hy_causal_conv(self.conv):
        return type(self).forward(self, _with_pending(hidden_states, pend))
    src = _hy_upsampled_padded(self, hidden_states)
    if src is None:  # factors that are not integers, or other padding: the class's forward, with its bias
        return type(self).forward(self, _with_pending(hidden_states, pend))
    out, b = _hy_conv_unbiased(self.conv, None, pend, src)
    return _stream_out(self, out, b)


def _carry_stream_biases(module: nn.Module, mode: "_ConsumerMode", streams: set, padded: dict, counts: dict) -> None:
    """Installs the stream forwards on every block of `streams` (each may be handed a pending input), and lets a
    block defer its biases where the trace saw its output go only into such blocks or padded norms (`padded`'s
    keys), and not returned by the smallest module holding it and them (or beyond)."""
    for m in streams:
        m.forward = types.MethodType(_hy_resnet_forward if _is_hy_resnet(m) else _hy_upsample_forward, m)
    names = {m: n for n, m in module.named_modules()}

    def within(a: str, b: str) -> bool:  # b is a or inside it
        return a == "" or a == b or b.startswith(a + ".")

    for block, uses in mode.stream_uses.items():
        if not uses or "other" in uses or any(u not in streams and u not in padded for u in uses):
            continue
        parts = [names[m].split(".") for m in (block, *uses)]
        k = _common_depth(parts)
        while k > 0 and module.get_submodule(".".join(parts[0][:k])) not in mode.ran:  # a ModuleList never runs
            k -= 1
        outer = ".".join(parts[0][:k])
        if any(within(names[m], outer) for m in mode.stream_returned.get(block, ())):
            continue
        holder = module.get_submodule(outer)
        _track_running(holder)
        block.__dict__["_gnext_stream_block"] = holder
        counts["stream_bias"] += 1
    if counts["stream_bias"]:
        _log.info("gnext: %d block(s) carry their convolutions' biases to the next", counts["stream_bias"])


class _ConsumerMode(TorchFunctionMode):
    """Records, for every watched tensor (a GroupNorm's output), the ops that take it: (activation module, its
    function) when the innermost running module is that activation, else "other". For the padded form it also
    follows the activation's output: the uses of each norm's activated output are recorded in `pads` as (module
    that ran F.pad on it, pad, mode, value), or "other" (an identity dropout passes it on unchanged); an op on the
    padded tensor (`pad_outs`) outside the direct child of that module that took it (marked by
    _fuse_traced_pairs's hooks) is "other" too. The uses of each biased convolution's output go to `conv_uses`: the
    GroupNorm module whose F.group_norm took it, or "other". F.pad calls with every pad value 0 on the calling module's
    own input (`zero_outs`, followed as `pad_outs` are) go to `zero_pads`: "zero" per such call, "other" for any other
    F.pad call of that module or any other use of its padded tensor."""

    def __init__(self, stack: list):
        super().__init__()
        self.stack = stack
        # Every table maps id(tensor) to a tuple ending in a weak reference to that tensor: strong ones would keep
        # every activation of the traced forward alive until the trace ends, more than a video decode's GPU holds.
        self.watch: dict[int, tuple[nn.Module, weakref.ref]] = {}
        self.consumers: dict[nn.Module, set] = {}
        self.activated: dict[int, tuple[nn.Module, weakref.ref]] = {}  # activation outputs of watched tensors
        self.pads: dict[nn.Module, set] = {}
        self.pad_outs: dict[int, tuple[nn.Module, nn.Module, weakref.ref]] = {}  # padded -> (norm, padder, tensor)
        self.conv_outs: dict[int, tuple[nn.Module, weakref.ref]] = {}
        self.zero_outs: dict[int, tuple[None, nn.Module, weakref.ref]] = {}  # padded -> (None, padder, tensor)
        self.zero_pads: dict[nn.Module, set] = {}
        self.conv_uses: dict[nn.Module, set] = {}
        # Outputs of the blocks that can carry biases down a residual stream (_HY_RESNET): the modules that took one
        # and know that form (`stream_recv`, by id of the output), each block's uses (such a module, or "other": an
        # op on it outside them) and the modules other than the block that returned it.
        self.stream_outs: dict[int, tuple[nn.Module, weakref.ref]] = {}
        self.stream_recv: dict[int, set] = {}
        self.stream_uses: dict[nn.Module, set] = {}
        self.stream_returned: dict[nn.Module, set] = {}
        self.ran: set = set()  # modules whose forward ran

    def taken(self, a) -> bool:
        """A module running now took a (a block's output) as its input and knows its form."""
        return any(s in self.stream_recv.get(id(a), ()) for s in self.stack)

    def _hit(self, table, a):
        """table's entry for a, where a is the tensor it was made for (not a later one with a dead one's id)."""
        hit = table.get(id(a)) if isinstance(a, torch.Tensor) else None
        return hit if hit is not None and hit[-1]() is a else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        top = self.stack[-1] if self.stack else None
        if func is torch.nn.functional.pad and top is not None and args and self._hit(self.activated, args[0]) is None:
            pad = args[1] if len(args) > 1 else kwargs.get("pad")
            zero = pad is not None and all(int(p) == 0 for p in pad) and isinstance(out, torch.Tensor)
            own = top.__dict__.get("_gnext_trace_in")
            if zero and own is not None and args[0] is own():
                self.zero_pads.setdefault(top, set()).add("zero")
                self.zero_outs[id(out)] = (None, top, weakref.ref(out))
                return out
            self.zero_pads.setdefault(top, set()).add("other")
        if self.stream_outs:
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                hit = self._hit(self.stream_outs, a)
                if hit is not None and not self.taken(a):
                    self.stream_uses.setdefault(hit[0], set()).add("other")
        for a in [*args, *kwargs.values()]:
            hit = self._hit(self.watch, a)
            if hit is not None:
                first = args[0] is a if args else False
                ok = top is not None and _activation_name(top) is not None and first
                self.consumers.setdefault(hit[0], set()).add(top if ok else "other")
            hit = self._hit(self.activated, a)
            if hit is not None:
                norm = hit[0]
                if func is torch.nn.functional.dropout and out is a:
                    continue
                if (func is torch.nn.functional.pad and args and args[0] is a and top is not None
                        and isinstance(out, torch.Tensor)):
                    pad = args[1] if len(args) > 1 else kwargs.get("pad")
                    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
                    value = args[3] if len(args) > 3 else kwargs.get("value", None)
                    value = 0.0 if value is None else value
                    if mode in ("replicate", "constant") and isinstance(value, (int, float)):
                        self.pads.setdefault(norm, set()).add((top, tuple(int(p) for p in pad), mode, float(value)))
                        self.pad_outs[id(out)] = (norm, top, weakref.ref(out))
                        continue
                self.pads.setdefault(norm, set()).add("other")
            hit = self._hit(self.pad_outs, a)
            if hit is not None and (top is None or top.__dict__.get("_gnext_trace_parent") is not hit[1]):
                self.pads.setdefault(hit[0], set()).add("other")
            hit = self._hit(self.zero_outs, a)
            if hit is not None and (top is None or top.__dict__.get("_gnext_trace_parent") is not hit[1]):
                self.zero_pads.setdefault(hit[1], set()).add("other")
            hit = self._hit(self.conv_outs, a)
            if hit is not None:
                ok = func is torch.nn.functional.group_norm and args[0] is a and _plain_group_norm(top)
                self.conv_uses.setdefault(hit[0], set()).add(top if ok else "other")
        return out


def _fuse_traced_pairs(module: nn.Module, example_inputs: tuple, counts: dict, pad_into_conv: bool = True) -> None:
    stack: list = []
    mode = _ConsumerMode(stack)
    norms = [m for m in module.modules() if _plain_group_norm(m)]
    acts = {id(m) for m in module.modules() if _activation_name(m) is not None}
    children: dict[nn.Module, nn.Module | None] = {}  # padder -> the child that took its padded tensor (None: varied)
    returned: dict[nn.Module, bool] = {}  # padder -> whether each of its padding calls returned that child's output
    handles = []
    streams = {m for m in module.modules() if _is_hy_resnet(m) or _is_hy_upsample(m)} if pad_into_conv else set()

    def push(m, inputs):
        first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        took = mode._hit(mode.stream_outs, first)
        if took is not None and (m in streams or _plain_group_norm(m)) and not mode.taken(first):
            mode.stream_recv[id(first)].add(m)
            mode.stream_uses[took[0]].add(m)
        hit = mode._hit(mode.pad_outs, first) or mode._hit(mode.zero_outs, first)
        m.__dict__["_gnext_trace_in"] = weakref.ref(first) if first is not None else None
        if hit is not None:  # m takes a padded tensor: it must be a direct child of the padder, the same every call
            parent = stack[-1] if stack else None
            ok = parent is hit[1] and any(c is m for c in parent.children())
            prev = children.get(parent, m)
            children[parent] = m if ok and prev is m else None
            m.__dict__["_gnext_trace_parent"] = parent if ok else None
        stack.append(m)
        mode.ran.add(m)

    def pop(m, inputs, output):
        stack.pop()
        if mode.stream_outs:
            for leaf in torch.utils._pytree.tree_leaves(output):
                made = mode._hit(mode.stream_outs, leaf)
                if made is not None and made[0] is not m:
                    mode.stream_returned.setdefault(made[0], set()).add(m)
        if m in streams and isinstance(output, torch.Tensor):
            mode.stream_outs[id(output)] = (m, weakref.ref(output))
            mode.stream_recv[id(output)] = set()
            mode.stream_uses.setdefault(m, set())
        if id(m) in acts and inputs and mode._hit(mode.watch, inputs[0]) is not None:
            mode.activated[id(output)] = (mode.watch[id(inputs[0])][0], weakref.ref(output))
        if m in children:  # a padder: did it return its child's output?
            child = children[m]
            took = child is not None and child.__dict__.get("_gnext_trace_out") is output
            returned[m] = returned.get(m, True) and took
        if "_gnext_trace_parent" in m.__dict__:
            m.__dict__["_gnext_trace_out"] = output

    def watch(m, _inputs, output):
        if isinstance(output, tuple):  # a spatial norm: (normalized, conv cache)
            output = output[0]
        mode.watch[id(output)] = (m, weakref.ref(output))
        mode.consumers.setdefault(m, set())

    def watch_conv(m, _inputs, output):
        mode.conv_outs[id(output)] = (m, weakref.ref(output))
        mode.conv_uses.setdefault(m, set())

    spatial = [m for m in module.modules() if _is_spatial_norm(m)]
    convs = [m for m in module.modules()
             if type(m) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and m.bias is not None and "forward" not in m.__dict__]
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(push))
        handles.append(m.register_forward_hook(pop))
    for m in norms + spatial:
        handles.append(m.register_forward_hook(watch))
    for m in convs:
        handles.append(m.register_forward_hook(watch_conv))
    try:
        with torch.no_grad(), mode:
            module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
        for m in module.modules():
            m.__dict__.pop("_gnext_trace_parent", None)
            m.__dict__.pop("_gnext_trace_out", None)
            m.__dict__.pop("_gnext_trace_in", None)
    # A norm fuses when every output it produced went into one activation module and nothing else.
    pairs = {n: next(iter(c)) for n, c in mode.consumers.items() if len(c) == 1 and "other" not in c}
    # ... and writes its output padded when every activated output went into F.pad in one module, with one pad,
    # whose padded tensor went only into one direct child whose output that module returned.
    padded = {}
    for norm in pairs if pad_into_conv else ():
        uses = mode.pads.get(norm, set())
        if len(uses) == 1 and "other" not in uses:
            padder, pad, pmode, value = next(iter(uses))
            if children.get(padder) is not None and returned.get(padder) and "forward" not in padder.__dict__:
                padded[norm] = (padder, pad, pmode, value)
    # A module that only ever padded its own input by 0 (a 1x1x1 causal convolution) for one convolution child, and
    # returned its output, hands its input to that child: F.pad copied it, nothing more.
    targets = {p[0] for p in padded.values()}
    zero = [m for m, u in mode.zero_pads.items() if pad_into_conv and u == {"zero"} and m not in targets
            and type(children.get(m)) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and returned.get(m)
            and "forward" not in m.__dict__]
    for m in zero:
        m.__dict__["_gnext_pad_child"] = next(n for n, c in m.named_children() if c is children[m])
        m.forward = types.MethodType(_unpadded_forward, m)
    if zero:
        _log.info("gnext: %d module(s) skip their zero padding (a copy) before their convolution", len(zero))
    if not pairs:
        return
    gates = {id(a): _ActivationGate(a) for a in set(pairs.values())}
    fused = {}
    for norm, act in pairs.items():
        if _is_spatial_norm(norm):  # fused in place: its forward runs the modulated norm and the activation
            _install_spatial_norm(norm, _activation_name(act), gates[id(act)])
            counts["spatial_norm"] += 1
            continue
        if norm in padded:
            padder, pad, pmode, value = padded[norm]
            new = _from_group_norm(_PaddedGroupNormAct, norm, _activation_name(act))
            new.__dict__["_pad"], new.__dict__["_pad_target"] = (list(pad), pmode, value), padder
            name = next(n for n, c in padder.named_children() if c is children[padder])
            padder.__dict__["_gnext_pad_child"] = name
            padder.forward = types.MethodType(_padded_forward, padder)
            counts["pad_into_conv"] += 1
        else:
            new = _from_group_norm(_GatedGroupNormAct, norm, _activation_name(act))
        new.__dict__["_gate"] = gates[id(act)]
        fused[id(norm)] = new
    # A convolution whose every output went only into a padded norm leaves its bias to that norm.
    folds = [(conv, next(iter(u))) for conv, u in mode.conv_uses.items() if len(u) == 1 and next(iter(u)) in padded]
    names = {m: n for n, m in module.named_modules()} if folds else {}
    for conv, norm in folds:
        _fold_bias(module, names, conv, norm, fused[id(norm)])
    if folds:
        _log.info("gnext: %d convolution(s) leave their bias to the padded norm after them", len(folds))
    _carry_stream_biases(module, mode, streams, padded, counts)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in fused:
                setattr(parent, name, fused[id(child)])
                counts["group_norm_act"] += 1
            elif id(child) in gates:
                setattr(parent, name, gates[id(child)])


# --- diffusers ResnetBlock2D ------------------------------------------------------------------------
# Its forward calls self.norm1 then self.nonlinearity, and self.norm2 then self.nonlinearity (the
# same activation module also runs on the time embedding). The fused block runs _resnet_block2d_forward:
# the same computation with norm1/norm2 as GroupNormAct. It is installed only on blocks whose class
# forward is diffusers' own and whose source has both pairs as consecutive statements (checked once per
# diffusers version), so a diffusers release that changes the block is left alone, not computed wrongly.
# Where no gradient is needed, conv1 (an nn.Conv2d with a bias, norm2 a GroupNormAct) runs without its bias and
# norm2 adds it as it reads (input_bias): PyTorch's convolution adds its bias in a pass of its own over the output.
# Exact: the time embedding's add between them commutes with the bias's.
_PAIRS = ("hidden_states = self.norm1(hidden_states)\n        hidden_states = self.nonlinearity(hidden_states)",
          "hidden_states = self.norm2(hidden_states)",
          "hidden_states = self.nonlinearity(hidden_states)\n\n        hidden_states = self.dropout(hidden_states)")
_checked_forwards: dict = {}


def _source_has(cls, patterns, method: str = "forward") -> bool:
    """Whether the source of cls's method (forward) contains every pattern (checked once per method; a warning where
    not)."""
    fwd = getattr(cls, method)
    if fwd not in _checked_forwards:
        try:
            import inspect

            src = inspect.getsource(fwd)
            _checked_forwards[fwd] = all(p in src for p in patterns)
        except (OSError, TypeError):
            _checked_forwards[fwd] = False
        if not _checked_forwards[fwd]:
            _log.warning("gnext: %s.%s is not the one gnext knows; its norms stay unfused", cls.__qualname__,
                         method)
            warnings.warn(f"gnext: {cls.__qualname__}.{method} differs from the diffusers source gnext was checked "
                          "against (0.35.1); its GroupNorms run unfused", stacklevel=4)
    return _checked_forwards[fwd]


def _is_resnet_block2d(m: nn.Module) -> bool:
    cls = type(m)
    return (cls.__name__ == "ResnetBlock2D" and cls.__module__.startswith("diffusers.")
            and "forward" not in m.__dict__ and _source_has(cls, _PAIRS))


def _resnet_block2d_forward(self, input_tensor, temb, *args, **kwargs):
    """diffusers ResnetBlock2D.forward with norm1 (and norm2, unless scale_shift) computing
    act(group_norm(.)) in one gnext kernel (GroupNormAct)."""
    hidden_states = self.norm1(input_tensor)  # + nonlinearity
    if self.upsample is not None:
        if hidden_states.shape[0] >= 64:
            input_tensor = input_tensor.contiguous()
            hidden_states = hidden_states.contiguous()
        input_tensor = self.upsample(input_tensor)
        hidden_states = self.upsample(hidden_states)
    elif self.downsample is not None:
        input_tensor = self.downsample(input_tensor)
        hidden_states = self.downsample(hidden_states)
    conv1, norm2 = self.conv1, self.norm2
    bias_to_norm2 = (getattr(self, "_gnext_conv1_bias_to_norm2", False) and type(conv1) is nn.Conv2d
                     and conv1.bias is not None and type(norm2) is GroupNormAct and not torch.is_grad_enabled())
    if bias_to_norm2:
        hidden_states = conv1._conv_forward(hidden_states, conv1.weight, None)
    else:
        hidden_states = conv1(hidden_states)
    if self.time_emb_proj is not None:
        if not self.skip_time_act:
            temb = self.nonlinearity(temb)
        temb = self.time_emb_proj(temb)[:, :, None, None]
    if self.time_embedding_norm == "scale_shift":
        if temb is None:
            raise ValueError(f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}")
        time_scale, time_shift = torch.chunk(temb, 2, dim=1)
        hidden_states = self.norm2(hidden_states)
        hidden_states = hidden_states * (1 + time_scale) + time_shift
        hidden_states = self.nonlinearity(hidden_states)
    else:
        if self.time_embedding_norm == "default" and temb is not None:
            hidden_states = hidden_states + temb
        if bias_to_norm2:
            hidden_states = group_norm_act(hidden_states, norm2.num_groups, norm2.weight, norm2.bias, norm2.eps,
                                           norm2.activation, input_bias=conv1.bias)
        else:
            hidden_states = self.norm2(hidden_states)  # + nonlinearity
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.conv2(hidden_states)
    if self.conv_shortcut is not None:
        if self.training:
            input_tensor = input_tensor.contiguous()
        input_tensor = self.conv_shortcut(input_tensor)
    out = input_tensor + hidden_states
    # x / 1.0 is x: PyTorch would still run a pass over the output for it.
    return out if self.output_scale_factor == 1 else out / self.output_scale_factor


# --- diffusers CogVideoXSpatialNorm3D --------------------------------------------------------------------
# A spatially conditioned norm: its forward interpolates the latents zq to f's size, convolves them into conv_y and
# conv_b, and returns (group_norm(f) * conv_y + conv_b, conv cache). The fused forward computes the same with
# group_norm_act_modulate (and the activation its caller applies next, where the trace paired one). Installed only
# where the class's forward is diffusers' own and its source has the lines below (diffusers 0.35.1), checked once per
# version.
_SPATIAL_NORM = ("zq = F.interpolate(zq, size=f.shape[-3:])",
                 'conv_y, new_conv_cache["conv_y"] = self.conv_y(zq, conv_cache=conv_cache.get("conv_y"))',
                 'conv_b, new_conv_cache["conv_b"] = self.conv_b(zq, conv_cache=conv_cache.get("conv_b"))',
                 "norm_f = self.norm_layer(f)\n        new_f = norm_f * conv_y + conv_b\n        return new_f, new_conv_cache")


def _is_spatial_norm(m: nn.Module) -> bool:
    cls = type(m)
    return (cls.__name__ == "CogVideoXSpatialNorm3D" and cls.__module__.startswith("diffusers.")
            and _plain_group_norm(getattr(m, "norm_layer", None)) and _source_has(cls, _SPATIAL_NORM))


def _pointwise_conv(m: nn.Module) -> bool:
    """m (a CogVideoXCausalConv3d) convolves each position alone: a 1x1x1 kernel, stride 1, no padding or
    dilation, one group (its conv cache, a copy of its input, is then never read)."""
    c = getattr(m, "conv", None)
    return (isinstance(c, nn.Conv3d) and getattr(m, "time_kernel_size", None) == 1 and c.kernel_size == (1, 1, 1)
            and c.stride == (1, 1, 1) and c.padding == (0, 0, 0) and c.dilation == (1, 1, 1) and c.groups == 1)


def _spatial_modulation(self, f, zq, conv_cache):
    """CogVideoXSpatialNorm3D's conv_y and conv_b of zq for f, and its new conv cache.

    Where conv_y and conv_b are pointwise and zq is not larger than f in height and width, they convolve zq at its
    own height and width (upsampled along time only) and group_norm_act_modulate upsamples them to f's by nearest
    neighbour as it reads them: a pointwise convolution commutes with nearest upsampling, so the values are the
    original's (to the convolution's rounding), and no full-size upsampled latents, convolution outputs or bias
    additions are made. Their conv caches then hold the smaller latents; a 1x1x1 causal convolution never reads its
    cache."""
    new_conv_cache = {}
    conv_cache = conv_cache or {}
    low = (zq.shape[-2] <= f.shape[-2] and zq.shape[-1] <= f.shape[-1] and _pointwise_conv(self.conv_y)
           and _pointwise_conv(self.conv_b))
    hw = tuple(zq.shape[-2:]) if low else tuple(f.shape[-2:])
    if f.shape[2] > 1 and f.shape[2] % 2 == 1:
        z_first, z_rest = zq[:, :, :1], zq[:, :, 1:]
        z_first = torch.nn.functional.interpolate(z_first, size=(1,) + hw)
        z_rest = torch.nn.functional.interpolate(z_rest, size=(f.shape[2] - 1,) + hw)
        zq = torch.cat([z_first, z_rest], dim=2)
    else:
        zq = torch.nn.functional.interpolate(zq, size=(f.shape[2],) + hw)
    conv_y, new_conv_cache["conv_y"] = self.conv_y(zq, conv_cache=conv_cache.get("conv_y"))
    conv_b, new_conv_cache["conv_b"] = self.conv_b(zq, conv_cache=conv_cache.get("conv_b"))
    return conv_y, conv_b, new_conv_cache


def _spatial_norm3d_forward(self, f, zq, conv_cache=None):
    """diffusers CogVideoXSpatialNorm3D.forward with group_norm(f) * conv_y + conv_b (and the paired activation) in
    one gnext op (conv_y and conv_b as _spatial_modulation makes them)."""
    conv_y, conv_b, new_conv_cache = _spatial_modulation(self, f, zq, conv_cache)
    norm = self.norm_layer
    act = self.__dict__.get("_gnext_act", "identity")
    new_f = group_norm_act_modulate(f, norm.num_groups, conv_y, conv_b, norm.weight, norm.bias, norm.eps, act)
    gate = self.__dict__.get("_gnext_gate")
    return (new_f if gate is None else gate.announce(new_f)), new_conv_cache


def _install_spatial_norm(m: nn.Module, act: str = "identity", gate: "_ActivationGate | None" = None) -> None:
    m.__dict__["_gnext_act"], m.__dict__["_gnext_gate"] = act, gate
    m.forward = types.MethodType(_spatial_norm3d_forward, m)


def _fuse_spatial_norm(module: nn.Module, counts: dict) -> None:
    """A CogVideoXSpatialNorm3D not fused by the trace gets the modulated norm without the activation."""
    if "forward" in module.__dict__ or not _is_spatial_norm(module):
        return
    _install_spatial_norm(module)
    counts["spatial_norm"] += 1


# --- diffusers CogVideoXResnetBlock3D --------------------------------------------------------------------
# norm1 -> SiLU -> conv1 and norm2 -> SiLU -> dropout -> conv2, each convolution a CogVideoXCausalConv3d that
# concatenates its cached frames (or k copies of the first frame) before its input along time and convolves that.
# The fused block writes each norm's activated output straight into that buffer after the k cached frames
# (group_norm_act_modulate(..., out=)), then copies the k frames before it: the concatenation's full copy of the
# tensor and the unconcatenated output are not made; conv1's bias goes to norm2, which adds it as it reads
# (input_bias), instead of PyTorch's broadcast pass over conv1's output. Installed only where both forwards are
# diffusers' own (source checked against 0.35.1) and the norms are spatial norms, the activation SiLU and the
# convolutions causal with cached frames; it runs where no gradient is needed (inference; else the block's own
# forward).
_COG_RESNET3D = (
    'hidden_states, new_conv_cache["norm1"] = self.norm1(hidden_states, zq, conv_cache=conv_cache.get("norm1"))',
    'hidden_states = self.nonlinearity(hidden_states)\n'
    '        hidden_states, new_conv_cache["conv1"] = self.conv1(hidden_states, conv_cache=conv_cache.get("conv1"))',
    'hidden_states, new_conv_cache["norm2"] = self.norm2(hidden_states, zq, conv_cache=conv_cache.get("norm2"))',
    'hidden_states = self.nonlinearity(hidden_states)\n        hidden_states = self.dropout(hidden_states)\n'
    '        hidden_states, new_conv_cache["conv2"] = self.conv2(hidden_states, conv_cache=conv_cache.get("conv2"))',
    "hidden_states = hidden_states + inputs\n        return hidden_states, new_conv_cache")
_COG_CAUSAL_CAT = (
    "cached_inputs = [conv_cache] if conv_cache is not None else [inputs[:, :, :1]] * (kernel_size - 1)",
    "inputs = torch.cat(cached_inputs + [inputs], dim=2)")
_COG_CAUSAL_FWD = ("inputs = self.fake_context_parallel_forward(inputs, conv_cache)",
                   "conv_cache = inputs[:, :, -self.time_kernel_size + 1 :].clone()",
                   "output = self.conv(inputs)\n        return output, conv_cache")


def _cat_causal_conv(m: nn.Module) -> bool:
    """m is diffusers' CogVideoXCausalConv3d concatenating cached frames (a time kernel of 2 or more, not the
    replicate padding mode)."""
    cls = type(m)
    return (cls.__name__ == "CogVideoXCausalConv3d" and cls.__module__.startswith("diffusers.")
            and getattr(m, "pad_mode", "replicate") != "replicate" and getattr(m, "time_kernel_size", 1) > 1
            and isinstance(getattr(m, "conv", None), nn.Conv3d) and "forward" not in m.__dict__
            and _source_has(cls, _COG_CAUSAL_FWD)
            and _source_has(cls, _COG_CAUSAL_CAT, "fake_context_parallel_forward"))


def _is_silu(m) -> bool:
    """m is nn.SiLU, or the gate that the traced pairing put in its place."""
    return isinstance(m.act if isinstance(m, _ActivationGate) else m, nn.SiLU)


def _is_cog_resnet3d(m: nn.Module) -> bool:
    cls = type(m)
    return (cls.__name__ == "CogVideoXResnetBlock3D" and cls.__module__.startswith("diffusers.")
            and "forward" not in m.__dict__ and _is_silu(getattr(m, "nonlinearity", None))
            and isinstance(getattr(m, "dropout", None), nn.Dropout)
            and all(isinstance(c, nn.Module) and _is_spatial_norm(c) for c in (getattr(m, "norm1", None),
                                                                                getattr(m, "norm2", None)))
            and all(isinstance(c, nn.Module) and _cat_causal_conv(c) for c in (getattr(m, "conv1", None),
                                                                                 getattr(m, "conv2", None)))
            and _source_has(cls, _COG_RESNET3D))


def _norm_into_causal_conv(norm, conv, f, zq, norm_cache, conv_cache, f_bias=None, defer_bias=False):
    """conv(silu(norm(f + f_bias, zq))) as diffusers computes it (the cached frames, or k copies of the first frame,
    before the activated output), with the activated output written into the convolution's input buffer. f_bias: a
    per-channel bias f does not hold yet (the norm adds it). defer_bias: return the convolution's output without
    its bias and that bias (None where it was added: no bias, or CogVideoXSafeConv3d's chunked path over 2 GiB)."""
    scale, shift, new_norm_cache = _spatial_modulation(norm, f, zq, norm_cache)
    gn = norm.norm_layer
    k = conv.time_kernel_size - 1
    buf = f.new_empty((f.shape[0], f.shape[1], f.shape[2] + k) + tuple(f.shape[3:]))
    group_norm_act_modulate(f, gn.num_groups, scale, shift, gn.weight, gn.bias, gn.eps, "silu", out=buf[:, :, k:],
                            input_bias=f_bias)
    buf[:, :, :k].copy_(conv_cache if conv_cache is not None else buf[:, :, k:k + 1].expand_as(buf[:, :, :k]))
    new_conv_cache = buf[:, :, -k:].clone()
    c = conv.conv
    if defer_bias and c.bias is not None and buf.numel() * 2 / 1024**3 <= 2:  # SafeConv3d's unchunked path
        # The bias goes to the next norm, which adds it as it reads: one broadcast pass over the output less.
        return c._conv_forward(buf, c.weight, None), new_norm_cache, new_conv_cache, c.bias
    return c(buf), new_norm_cache, new_conv_cache, None


def _cog_resnet3d_forward(self, inputs, temb=None, zq=None, conv_cache=None):
    """diffusers CogVideoXResnetBlock3D.forward with each norm -> SiLU written into its causal convolution's input
    buffer (_norm_into_causal_conv); the block's own forward where a gradient is needed, without zq or with a time
    embedding, or where the dropout is active."""
    grad = torch.is_grad_enabled() and (inputs.requires_grad or any(p.requires_grad for p in self.parameters()))
    if grad or zq is None or temb is not None or (self.dropout.training and self.dropout.p > 0):
        return type(self).forward(self, inputs, temb, zq, conv_cache)
    new_conv_cache = {}
    conv_cache = conv_cache or {}
    hidden_states, new_conv_cache["norm1"], new_conv_cache["conv1"], conv1_bias = _norm_into_causal_conv(
        self.norm1, self.conv1, inputs, zq, conv_cache.get("norm1"), conv_cache.get("conv1"), defer_bias=True)
    hidden_states, new_conv_cache["norm2"], new_conv_cache["conv2"], _ = _norm_into_causal_conv(
        self.norm2, self.conv2, hidden_states, zq, conv_cache.get("norm2"), conv_cache.get("conv2"), conv1_bias)
    if self.in_channels != self.out_channels:
        if self.use_conv_shortcut:
            inputs, new_conv_cache["conv_shortcut"] = self.conv_shortcut(
                inputs, conv_cache=conv_cache.get("conv_shortcut"))
        else:
            inputs = self.conv_shortcut(inputs)
    return hidden_states + inputs, new_conv_cache


def _fuse_cog_resnet3d(module: nn.Module, counts: dict) -> None:
    """A diffusers CogVideoXResnetBlock3D whose norms and convolutions fit (_is_cog_resnet3d) gets the fused forward;
    its two norms count as pad_into_conv (their output is the convolution's padded input)."""
    if not _is_cog_resnet3d(module):
        return
    module.forward = types.MethodType(_cog_resnet3d_forward, module)
    counts["pad_into_conv"] += 2


def _fuse_blocks(module: nn.Module, counts: dict) -> None:
    """Fuses the norm/activation pairs of module if it is a diffusers ResnetBlock2D (see above)."""
    if not _is_resnet_block2d(module):
        return
    act = _activation_name(module.nonlinearity)
    n1, n2 = module.norm1, module.norm2
    if act is None or not (_plain_group_norm(n1) and _plain_group_norm(n2)):
        return
    module.norm1 = _from_group_norm(GroupNormAct, n1, act)
    if module.time_embedding_norm == "scale_shift":
        module.norm2 = _from_group_norm(GroupNorm, n2)
        counts["group_norm"] += 1
    else:
        module.norm2 = _from_group_norm(GroupNormAct, n2, act)
        module.__dict__["_gnext_conv1_bias_to_norm2"] = True  # (checked again at each call: see the comment above)
        counts["group_norm_act"] += 1
    counts["group_norm_act"] += 1
    counts["resnet_block2d"] += 1
    module.forward = types.MethodType(_resnet_block2d_forward, module)
