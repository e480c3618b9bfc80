# SPDX-License-Identifier: BSD-3-Clause
"""GroupNorm drop-in module and convert_group_norm."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import groupnorm_ext as ge
from conftest import DEVICES, rand_input


def test_module_matches_nn_groupnorm_api():
    ref = nn.GroupNorm(4, 16, eps=1e-4, affine=True)
    mod = ge.GroupNorm(4, 16, eps=1e-4, affine=True)
    assert repr(mod).endswith(repr(ref)[len("GroupNorm"):])
    assert mod.extra_repr() == ref.extra_repr()
    assert list(mod.state_dict().keys()) == list(ref.state_dict().keys()) == ["weight", "bias"]
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mod.load_state_dict(ref.state_dict())
    ref.load_state_dict(mod.state_dict())
    mod.reset_parameters()
    assert torch.equal(mod.weight, torch.ones(16)) and torch.equal(mod.bias, torch.zeros(16))
    assert list(ge.GroupNorm(2, 4, affine=False).state_dict().keys()) == []


@pytest.mark.parametrize("device", DEVICES)
def test_module_forward_matches_nn(device):
    ref = nn.GroupNorm(4, 16).to(device)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mod = ge.GroupNorm(4, 16).to(device)
    mod.load_state_dict(ref.state_dict())
    x = rand_input((2, 16, 5, 5), torch.float32, device)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_convert_group_norm(device):
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.SiLU(),
        nn.Sequential(nn.Conv2d(16, 8, 1), nn.GroupNorm(2, 8, affine=False)),
    ).to(device)
    with torch.no_grad():
        model[1].weight.normal_()
    x = rand_input((2, 3, 8, 8), torch.float32, device)
    expected = model(x)
    keys = list(model.state_dict().keys())
    w = model[1].weight
    converted = ge.convert_group_norm(model)
    assert type(converted[1]) is ge.GroupNorm and type(converted[3][1]) is ge.GroupNorm
    assert converted[1].weight is w  # parameters are shared, not copied
    assert list(converted.state_dict().keys()) == keys
    torch.testing.assert_close(converted(x), expected, rtol=1e-5, atol=1e-5)
    root = ge.convert_group_norm(nn.GroupNorm(2, 4))
    assert type(root) is ge.GroupNorm


def test_info_command_reports_the_build():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "groupnorm_ext", "--info"], capture_output=True, text=True)
    assert "built against torch" in r.stdout and "library loaded" in r.stdout, r.stdout + r.stderr
    assert r.returncode in (0, 1)
    from groupnorm_ext.__main__ import _arch_ok

    assert _arch_ok(["9.0"], 9, 0) and not _arch_ok(["9.0"], 8, 0)
    assert _arch_ok(["8.0"], 8, 6) and _arch_ok(["8.0+PTX"], 9, 0) and not _arch_ok(["8.0"], 9, 0)
    assert _arch_ok(["9.0a"], 9, 0) and not _arch_ok(["9.0a"], 10, 0)


def test_module_names_its_archs_for_the_unsupported_gpu_error():
    """A GPU the build has no device code for gets "this build has no device code for <GPU> (sm_XY): it
    was compiled for <archs>" (csrc/common/cuda_utils.h) instead of a launch failure. The archs come from
    setup.py as one token (TORCH_CUDA_ARCH_LIST "9.0a;12.0+PTX" -> "90a_120ptx"): check that the module
    carries the token of the archs it records in its build info, and the message."""
    import groupnorm_ext._C as C
    from groupnorm_ext._build_info import BUILD_INFO

    if not BUILD_INFO["cuda"]:
        pytest.skip("CPU-only build")
    data = open(C.__file__, "rb").read()
    token = "_".join(a.replace(".", "").replace("+PTX", "ptx") for a in BUILD_INFO["cuda_archs"]).encode()
    assert b"\0" + token + b"\0" in data, token
    assert b"gnext: this build has no device code for " in data and b"): it was compiled for " in data


def test_compiled_module_uses_only_the_stable_abi():
    """The module must reference libtorch only through the stable C shim (aoti_torch_* / torch_*), never
    its C++ API (at::, c10::, torch:: mangled names): that is what lets one build load on every torch
    release from 2.11 on (setup.py's TORCH_TARGET_VERSION)."""
    import shutil
    import subprocess

    import groupnorm_ext._C as C

    if shutil.which("nm") is None:
        pytest.skip("needs binutils' nm")
    undef = subprocess.run(["nm", "-D", "--undefined-only", C.__file__], capture_output=True, text=True,
                           check=True).stdout.split()
    cxx = [s for s in undef if s.startswith(("_ZN2at", "_ZN3c10", "_ZN5torch", "_ZNK2at", "_ZNK3c10", "_ZNK5torch"))]
    assert not cxx, f"libtorch C++ symbols outside the stable ABI: {cxx[:10]}"
    assert any(s.startswith("aoti_torch_") for s in undef), "expected the stable C shim's entry points"
    from groupnorm_ext._build_info import BUILD_INFO

    assert BUILD_INFO.get("torch_min") == "2.11", BUILD_INFO
