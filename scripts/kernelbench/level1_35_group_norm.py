# SPDX-License-Identifier: BSD-3-Clause
"""KernelBench level 1 #35: GroupNorm, 112x64x512x512 float32, G=8.

Model is KernelBench's reference; ModelNew runs torch.ops.gnext.group_norm with the same
parameters (its state_dict loads Model's). Run this file to check ModelNew against Model on
5 random inputs (CUDA if available, at a smaller batch on the CPU).
"""
import torch
import torch.nn as nn

import groupnorm_ext  # noqa: F401  (registers torch.ops.gnext)


class Model(nn.Module):
    """Simple model that performs Group Normalization."""

    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


class ModelNew(nn.Module):
    """Model with gnext's GroupNorm kernel (same parameters and state_dict keys)."""

    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gn = self.gn
        return torch.ops.gnext.group_norm(x, gn.num_groups, gn.weight, gn.bias, gn.eps)[0]


batch_size = 112
features = 64
num_groups = 8
dim1 = 512
dim2 = 512


def get_inputs():
    x = torch.rand(batch_size, features, dim1, dim2)
    return [x]


def get_init_inputs():
    return [features, num_groups]


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Model(*get_init_inputs()).to(device)
    with torch.no_grad():
        model.gn.weight.normal_()
        model.gn.bias.normal_()
    new = ModelNew(*get_init_inputs()).to(device)
    new.load_state_dict(model.state_dict())
    if device == "cpu":
        batch_size, dim1, dim2 = 2, 64, 64
    for trial in range(5):
        x = get_inputs()[0].to(device)
        with torch.no_grad():
            ref, out = model(x), new(x)
        err = (out - ref).abs().max().item()
        print(f"trial {trial}: max |ModelNew - Model| = {err:.3e}")
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), err
    print("ModelNew matches Model on 5 random inputs")
