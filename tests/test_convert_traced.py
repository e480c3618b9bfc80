# SPDX-License-Identifier: BSD-3-Clause
"""convert_group_norm_act(example_inputs=...): GroupNorm -> activation pairs found by running the model once, in
blocks the converter has no rule for (a causal 3-D video block with a shared activation module, a time embedding
through the same activation, a normalized tensor that is also used elsewhere), against the original model."""
from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from torch import nn

import groupnorm_ext as ge
from groupnorm_ext.convert import _ActivationGate


class CausalBlock3D(nn.Module):
    """A video VAE's resnet block: norm1 -> act -> conv -> norm2 -> act -> conv, one shared activation module that
    also runs on a time embedding, and norm3 whose output is also added to the result (not fusable)."""

    def __init__(self, c=32):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.GroupNorm(8, c), nn.GroupNorm(8, c), nn.GroupNorm(4, c)
        self.conv1 = nn.Conv3d(c, c, 3, padding=1)
        self.conv2 = nn.Conv3d(c, c, 3, padding=1)
        self.nonlinearity = nn.SiLU()
        self.temb = nn.Linear(16, c)

    def forward(self, x, t):
        h = self.conv1(self.nonlinearity(self.norm1(x)))
        h = h + self.temb(self.nonlinearity(t))[:, :, None, None, None]
        h = self.conv2(self.nonlinearity(self.norm2(h)))
        n3 = self.norm3(h)
        return x + h + n3 * torch.sigmoid(n3)  # norm3's output has consumers outside any activation module


def _perturb(m):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def test_traced_pairs_in_a_video_block_match_the_original():
    torch.manual_seed(0)
    model = _perturb(nn.Sequential(CausalBlock3D(), CausalBlock3D())).eval()
    x, t = torch.randn(1, 32, 3, 8, 8) * 2 + 1, torch.randn(1, 16)
    ref = model[1](model[0](x, t), t)
    conv = copy.deepcopy(model)
    keys = list(conv.state_dict())

    class Both(nn.Module):
        def __init__(self, seq):
            super().__init__()
            self.seq = seq

        def forward(self, x, t):
            return self.seq[1](self.seq[0](x, t), t)

    both, counts = ge.convert_group_norm_act(Both(conv), example_inputs=(x, t), return_counts=True)
    assert counts["group_norm_act"] == 4 and counts["group_norm"] == 2, counts  # norm3 stays plain GroupNorm
    for blk in both.seq:
        assert isinstance(blk.norm1, ge.GroupNormAct) and isinstance(blk.norm2, ge.GroupNormAct)
        assert type(blk.norm3) is ge.GroupNorm and isinstance(blk.nonlinearity, _ActivationGate)
    assert list(both.seq.state_dict()) == [k.replace("nonlinearity.", "nonlinearity.act.") for k in keys]
    for _ in range(2):  # the gates hold nothing between calls
        out = both(x, t)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_interleaved_norms_through_one_activation():
    """Two norms computed before the shared activation runs on either: each output passes through once."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.GroupNorm(2, 8), nn.GroupNorm(4, 8), nn.GELU()

        def forward(self, x):
            na, nb = self.a(x), self.b(x)
            return self.act(nb) * 2 + self.act(na)

    torch.manual_seed(1)
    m = _perturb(M())
    x = torch.randn(2, 8, 5, 5) + 3
    ref = m(x)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(m), example_inputs=(x,), return_counts=True)
    assert counts["group_norm_act"] == 2
    torch.testing.assert_close(conv(x), ref, rtol=1e-5, atol=1e-5)


def test_diffusers_hunyuan_video_decoder_pairs():
    diffusers = pytest.importorskip("diffusers")
    vae = diffusers.AutoencoderKLHunyuanVideo(
        block_out_channels=(32, 32, 32), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, layers_per_block=1, norm_num_groups=8, latent_channels=4,
        temporal_compression_ratio=4, spatial_compression_ratio=4).eval()
    _perturb(vae)
    z = torch.randn(1, 4, 2, 8, 8)
    with torch.no_grad():
        ref = vae.decoder(z)
    n_gn = sum(isinstance(m, nn.GroupNorm) for m in vae.decoder.modules())
    dec, counts = ge.convert_group_norm_act(vae.decoder, example_inputs=(z,), return_counts=True)
    assert counts["group_norm_act"] >= n_gn - 2, (counts, n_gn)  # all but the mid-block attention's norms
    with torch.no_grad():
        torch.testing.assert_close(dec(z), ref, rtol=1e-4, atol=1e-4)


def test_warns_when_nothing_is_fused_without_example_inputs():
    """A block the converter has no rule for: the GroupNorms convert, none fuses, and the warning names the fix."""
    block = CausalBlock3D()
    with pytest.warns(UserWarning, match="example_inputs"):
        _, counts = ge.convert_group_norm_act(block, return_counts=True)
    assert counts["group_norm_act"] == 0 and counts["group_norm"] == 3


def test_spatial_conversion_of_traced_pairs_keeps_one_activation():
    """convert_group_norm_spatial after convert_group_norm_act(example_inputs=...): every norm becomes a
    SpatialGroupNorm with its activation; a gated one tells its gate (which then passes its output through), so the
    activation is applied once: the block's output is unchanged (one process: the shard is the whole tensor)."""
    from groupnorm_ext import distributed as gd

    torch.manual_seed(2)
    block = CausalBlock3D()
    x, t = torch.randn(1, 32, 3, 8, 8), torch.randn(1, 16)
    ge.convert_group_norm_act(block, example_inputs=(x, t))
    seq = ge.convert_group_norm_act(nn.Sequential(nn.GroupNorm(4, 8), nn.SiLU()))
    with torch.no_grad():
        ref = block(x, t)
    gd.convert_group_norm_spatial(block)
    gd.convert_group_norm_spatial(seq)
    assert all(isinstance(m, gd.SpatialGroupNorm) for m in (block.norm1, block.norm2, block.norm3))
    assert block.norm1.activation == block.norm2.activation == "silu"
    assert isinstance(block.nonlinearity, _ActivationGate) and block.norm1.weight.device.type == "cpu"
    assert type(seq[0]) is gd.SpatialGroupNorm and seq[0].activation == "silu"
    if not torch.distributed.is_initialized():
        with tempfile.TemporaryDirectory() as tmp:
            torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
            try:
                with torch.no_grad():
                    for _ in range(2):  # the gates hold nothing between calls
                        torch.testing.assert_close(block(x, t), ref, rtol=1e-5, atol=1e-5)
            finally:
                torch.distributed.destroy_process_group()
