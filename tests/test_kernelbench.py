# SPDX-License-Identifier: BSD-3-Clause
"""KernelBench ModelNew vs Model (smaller inputs than the benchmark size)."""
import importlib.util
import pathlib

import pytest
import torch

from conftest import DEVICES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "kernelbench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("device", DEVICES)
def test_level1_35(device):
    kb = _load("level1_35_group_norm")
    kb.batch_size, kb.dim1, kb.dim2 = 2, 48, 40  # get_inputs() reads these globals
    torch.manual_seed(0)
    model = kb.Model(*kb.get_init_inputs()).to(device)
    with torch.no_grad():
        model.gn.weight.normal_()
        model.gn.bias.normal_()
    new = kb.ModelNew(*kb.get_init_inputs()).to(device)
    new.load_state_dict(model.state_dict())
    for _ in range(5):
        x = kb.get_inputs()[0].to(device)
        with torch.no_grad():
            torch.testing.assert_close(new(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_level2_19(device):
    """ModelNew vs Model, output and all gradients, 5 random inputs (TF32 off: fp32-accurate conv)."""
    kb = _load("level2_19_convtranspose_gelu_groupnorm")
    kb.batch_size, kb.in_channels, kb.out_channels, kb.height, kb.width = 2, 16, 16, 11, 9
    torch.backends.cudnn.allow_tf32 = False
    try:
        kb.check(device, n_inputs=5, tol=1e-4)
    finally:
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.parametrize("device", DEVICES)
def test_level2_92(device):
    """ModelNew vs Model, output and all gradients, 5 random inputs (TF32 off)."""
    kb = _load("level2_92_conv_groupnorm_tanh_hardswish_residual_logsumexp")
    kb.batch_size, kb.height, kb.width = 2, 13, 10
    torch.backends.cudnn.allow_tf32 = False
    try:
        kb.check(device, n_inputs=5, tol=1e-4)
    finally:
        torch.backends.cudnn.allow_tf32 = True
