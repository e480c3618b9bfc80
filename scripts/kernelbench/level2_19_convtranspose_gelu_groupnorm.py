# SPDX-License-Identifier: BSD-3-Clause
"""KernelBench level 2 #19: ConvTranspose2d(64 -> 64, k3, s1) + GELU + GroupNorm(8), 128x64x256x256
float32, trained (forward and backward).

Model is the reference (PyTorch modules); ModelNew runs torch.ops.gnext.conv_transpose2d_gelu_group_norm
with the same parameters and state_dict keys, so Model's checkpoint loads into it. Run this file to
check ModelNew against Model (output and all gradients) on 5 random inputs (CUDA if available, at a
smaller size on the CPU).
"""
import os
import sys

import torch
import torch.nn as nn

import groupnorm_ext  # noqa: F401  (registers torch.ops.gnext)


class Model(nn.Module):
    """ConvTranspose2d, then GELU, then GroupNorm."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, groups, num_groups):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride)
        self.group_norm = nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)

    def forward(self, x):
        x = self.conv_transpose(x)
        x = torch.nn.functional.gelu(x)
        x = self.group_norm(x)
        return x


class ModelNew(Model):
    """Model with the three steps in gnext's fused op (same parameters and state_dict keys)."""

    def forward(self, x):
        c, g = self.conv_transpose, self.group_norm
        return torch.ops.gnext.conv_transpose2d_gelu_group_norm(
            x, c.weight, c.bias, list(c.stride), list(c.padding), list(c.output_padding), list(c.dilation),
            c.groups, g.num_groups, g.weight, g.bias, g.eps, "none")[0]


batch_size = 128
in_channels = 64
out_channels = 64
height = width = 256
kernel_size = 3
stride = 1
groups = 8
num_groups = 8


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, groups, num_groups]


def check(device, n_inputs=5, tol=None):
    """ModelNew vs Model: output and gradients of x and every parameter (check_model_new.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_model_new import check as check_model_new

    return check_model_new(Model, ModelNew, get_inputs, get_init_inputs, device, n_inputs, tol)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        batch_size, height, width = 2, 16, 12
    else:
        batch_size = 8  # 128 needs ~40 GB for two models' activations and gradients
    torch.backends.cudnn.allow_tf32 = False
    print(f"L2#19 ModelNew vs Model ({device}, batch {batch_size}): max relative error {check(device):.2e}")
