# SPDX-License-Identifier: BSD-3-Clause
"""convert_group_norm / convert_group_norm_act on the layers users have: nn.GroupNorm subclasses, timm's
GroupNorm, GroupNorm1 and GroupNormAct, diffusers' ResnetBlock2D (norm/activation pairs called from its
forward). Same results and state_dict keys as the original, counts of what was converted, a warning when
a model with GroupNorm layers got none. timm and diffusers tests skip where those packages are missing."""
from __future__ import annotations

import copy
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import groupnorm_ext as ge
from conftest import DEVICES, perturb_params, rand_input


class PlainSubclass(nn.GroupNorm):
    """Keeps nn.GroupNorm.forward: converted."""


class OwnForward(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x) * 2  # not GroupNorm: must be left alone


def _check_same(model, convert, inputs, rtol=1e-5, atol=1e-5, **kw):
    ref = model(*inputs)
    keys = list(model.state_dict())
    conv, counts = convert(copy.deepcopy(model), return_counts=True, **kw)
    assert list(conv.state_dict()) == keys
    torch.testing.assert_close(conv(*inputs), ref, rtol=rtol, atol=atol)
    return conv, counts


def test_subclasses_counts_and_warning():
    torch.manual_seed(0)
    model = perturb_params(nn.Sequential(PlainSubclass(2, 8), OwnForward(2, 8), nn.GroupNorm(4, 8)))
    x = rand_input((2, 8, 5, 5), torch.float32, "cpu")
    conv, counts = _check_same(model, ge.convert_group_norm, (x,))
    assert type(conv[0]) is ge.GroupNorm and type(conv[1]) is OwnForward and type(conv[2]) is ge.GroupNorm
    assert counts == {"group_norm": 2, "group_norm_act": 0, "resnet_block2d": 0, "pad_into_conv": 0, "spatial_norm": 0,
                      "stream_bias": 0, "skipped": 1}
    with pytest.warns(UserWarning, match="1 GroupNorm layer.*none was converted"):
        ge.convert_group_norm(nn.Sequential(OwnForward(2, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ge.convert_group_norm(nn.Linear(2, 2), return_counts=True)[1]["skipped"] == 0  # no GN: no warning
    assert type(ge.convert_group_norm(nn.GroupNorm(2, 4))) is ge.GroupNorm  # the root itself


@pytest.mark.parametrize("device", DEVICES)
def test_timm_layers(device):
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    model = perturb_params(nn.Sequential(
        timm_layers.GroupNorm(16, num_groups=4), timm_layers.GroupNorm1(16),
        timm_layers.GroupNormAct(16, num_groups=4, act_layer=nn.SiLU),
        timm_layers.GroupNormAct(16, num_groups=4, act_layer="gelu_tanh"),
        timm_layers.GroupNormAct(16, num_groups=8, apply_act=False),
        timm_layers.GroupNorm1Act(16, act_layer=nn.ReLU),
        timm_layers.GroupNormAct(16, num_groups=4, act_layer=nn.Sigmoid),  # no such activation in gnext
    )).to(device)
    x = rand_input((2, 16, 6, 5), torch.float32, device)
    conv, counts = _check_same(model, ge.convert_group_norm_act, (x,))
    assert [type(m).__name__ for m in conv] == ["GroupNorm", "GroupNorm", "GroupNormAct", "GroupNormAct",
                                                "GroupNormAct", "GroupNormAct", "GroupNormAct"]
    assert [getattr(m, "activation", None) for m in conv[2:6]] == ["silu", "gelu_tanh", "identity", "relu"]
    assert type(conv[6]).__module__.startswith("timm")  # left alone
    assert counts == {"group_norm": 2, "group_norm_act": 4, "resnet_block2d": 0, "pad_into_conv": 0, "spatial_norm": 0,
                      "stream_bias": 0, "skipped": 1}
    conv2, counts2 = _check_same(model, ge.convert_group_norm, (x,))
    assert counts2["group_norm"] == 2 and counts2["skipped"] == 5  # GroupNormAct needs convert_group_norm_act


def test_timm_resnet_gn_model():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=10).eval()
    n_gn = sum(isinstance(m, nn.GroupNorm) for m in model.modules())
    x = rand_input((1, 3, 64, 64), torch.float32, "cpu", scale=1.0, offset=0.0)
    with torch.no_grad():
        conv, counts = _check_same(model, ge.convert_group_norm_act, (x,), rtol=1e-4, atol=1e-4)
    assert counts["group_norm"] + counts["group_norm_act"] == n_gn > 0 and counts["skipped"] == 0
    assert counts["group_norm_act"] > 0


def _resnet_blocks():
    resnet = pytest.importorskip("diffusers.models.resnet")
    torch.manual_seed(0)
    return [
        resnet.ResnetBlock2D(in_channels=32, out_channels=64, temb_channels=24, groups=8),
        resnet.ResnetBlock2D(in_channels=32, out_channels=32, temb_channels=24, groups=8,
                             time_embedding_norm="scale_shift"),
        resnet.ResnetBlock2D(in_channels=32, out_channels=32, temb_channels=None, groups=8, up=True),
        resnet.ResnetBlock2D(in_channels=32, out_channels=32, temb_channels=24, groups=8, down=True,
                             skip_time_act=True, output_scale_factor=2.0),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [False, True])
def test_diffusers_resnet_block2d(device, train, no_tf32):
    blocks = _resnet_blocks()
    for i, blk in enumerate(blocks):
        blk = perturb_params(blk).to(device).train(train)
        x = rand_input((2, 32, 8, 8), torch.float32, device).requires_grad_()
        temb = torch.randn(2, 24, device=device) if blk.time_emb_proj is not None else None
        ref = blk(x, temb)
        ref_g = torch.autograd.grad(ref.square().sum(), [x, *blk.parameters()])
        conv, counts = ge.convert_group_norm_act(copy.deepcopy(blk), return_counts=True)
        assert list(conv.state_dict()) == list(blk.state_dict())
        assert counts["resnet_block2d"] == 1
        assert counts["group_norm_act"] == (1 if blk.time_embedding_norm == "scale_shift" else 2), i
        assert type(conv.nonlinearity) is nn.SiLU  # the time-embedding path keeps its activation
        out = conv(x, temb)
        g = torch.autograd.grad(out.square().sum(), [x, *conv.parameters()])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(g, ref_g):  # sums over many terms (conv weights): relative L2, max error vs max|ref|
            assert ((a - b).norm() / b.norm()).item() < 1e-4
            assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()
        # without a gradient, conv1 runs without its bias and norm2 adds it (input_bias); not with scale_shift, nor
        # once norm2 is swapped for another module
        fold = blk.time_embedding_norm != "scale_shift"
        with torch.no_grad(), mock.patch("groupnorm_ext.convert.group_norm_act", wraps=ge.group_norm_act) as m:
            torch.testing.assert_close(conv(x, temb), ref, rtol=1e-4, atol=1e-4)
            assert m.call_count == fold and (not fold or m.call_args.kwargs["input_bias"] is conv.conv1.bias)
            if fold:
                swapped = copy.deepcopy(conv)
                swapped.norm2 = nn.Sequential(nn.GroupNorm(8, conv.norm2.num_channels, eps=conv.norm2.eps),
                                              nn.SiLU()).to(device)
                swapped.norm2[0].load_state_dict(conv.norm2.state_dict())
                torch.testing.assert_close(swapped(x, temb), ref, rtol=1e-4, atol=1e-4)
                assert m.call_count == 1
        # no blocks: the norms become plain gnext GroupNorm and the block keeps its own forward
        with pytest.warns(UserWarning, match="example_inputs"):  # nothing fused: the warning names the fix
            plain, c2 = ge.convert_group_norm_act(copy.deepcopy(blk), blocks=False, return_counts=True)
        assert c2["resnet_block2d"] == 0 and c2["group_norm"] == 2 and "forward" not in plain.__dict__
        torch.testing.assert_close(plain(x, temb), ref, rtol=1e-4, atol=1e-4)


def test_diffusers_block_changed_forward_left_alone():
    resnet = pytest.importorskip("diffusers.models.resnet")

    class Changed(resnet.ResnetBlock2D):
        def forward(self, input_tensor, temb):
            return super().forward(input_tensor, temb) * 0.5

    blk = Changed(in_channels=16, out_channels=16, temb_channels=None, groups=4)
    with pytest.warns(UserWarning, match="example_inputs"):  # left alone, nothing fused: the warning names the fix
        conv, counts = ge.convert_group_norm_act(blk, return_counts=True)
    assert counts["resnet_block2d"] == 0 and counts["group_norm"] == 2


def test_diffusers_unet_compiles_converted():
    """A converted diffusers UNet2DModel (every ResnetBlock2D fused) matches the original and compiles
    with fullgraph=True."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=16, block_out_channels=(32, 64), norm_num_groups=8,
                                 down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D")).eval()
    x, t = rand_input((2, 3, 16, 16), torch.float32, "cpu", scale=1.0, offset=0.0), torch.tensor([10, 500])
    with torch.no_grad():
        ref = unet(x, t).sample
        conv, counts = ge.convert_group_norm_act(copy.deepcopy(unet), return_counts=True)
        n_blocks = sum(type(m).__name__ == "ResnetBlock2D" for m in unet.modules())
        assert counts["resnet_block2d"] == n_blocks > 0 and counts["skipped"] == 0
        torch.testing.assert_close(conv(x, t).sample, ref, rtol=1e-4, atol=1e-4)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(conv, fullgraph=True)(x, t).sample, ref, rtol=1e-4, atol=1e-4)
