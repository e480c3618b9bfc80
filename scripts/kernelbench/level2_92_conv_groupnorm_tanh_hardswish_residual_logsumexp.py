"""KernelBench level 2 #92: Conv2d(8 -> 64, k3) + GroupNorm(16) + Tanh + HardSwish + residual add +
LogSumExp over channels, 128x8x128x128 float32.

Model is the reference; ModelNew keeps the conv in ATen/cuDNN and runs GroupNorm + tanh + hardswish +
the residual add as ONE gnext op (torch.ops.gnext.group_norm_act with activation "tanh_hardswish" and
residual = the conv output), then torch.logsumexp. Same parameters and state_dict keys as Model.
Run this file to check ModelNew against Model on 5 random inputs (output and gradients).
"""
import os
import sys

import torch
import torch.nn as nn

import groupnorm_ext  # noqa: F401  (registers torch.ops.gnext)


class Model(nn.Module):
    """Conv2d, GroupNorm, Tanh, HardSwish, residual addition and LogSumExp."""

    def __init__(self, in_channels, out_channels, kernel_size, groups, eps=1e-5):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.group_norm = nn.GroupNorm(groups, out_channels, eps=eps)
        self.tanh = nn.Tanh()
        self.hard_swish = nn.Hardswish()

    def forward(self, x):
        x_conv = self.conv(x)
        x_norm = self.group_norm(x_conv)
        x_tanh = self.tanh(x_norm)
        x_hard_swish = self.hard_swish(x_tanh)
        x_res = x_conv + x_hard_swish
        return torch.logsumexp(x_res, dim=1, keepdim=True)


class ModelNew(Model):
    """GroupNorm + tanh + hardswish + residual in one gnext op (same parameters and state_dict keys)."""

    def forward(self, x):
        x_conv = self.conv(x)
        g = self.group_norm
        x_res = torch.ops.gnext.group_norm_act(x_conv, g.num_groups, g.weight, g.bias, g.eps, "tanh_hardswish",
                                               x_conv)[0]
        return torch.logsumexp(x_res, dim=1, keepdim=True)


batch_size = 128
in_channels = 8
out_channels = 64
height, width = 128, 128
kernel_size = 3
groups = 16


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, groups]


def check(device, n_inputs=5, tol=None):
    """ModelNew vs Model: output and gradients of x and every parameter (check_model_new.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_model_new import check as check_model_new

    return check_model_new(Model, ModelNew, get_inputs, get_init_inputs, device, n_inputs, tol)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        batch_size, height, width = 2, 16, 12
    torch.backends.cudnn.allow_tf32 = False
    print(f"L2#92 ModelNew vs Model ({device}, batch {batch_size}): max relative error {check(device):.2e}")
