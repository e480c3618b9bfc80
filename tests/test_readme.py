# SPDX-License-Identifier: BSD-3-Clause
"""Every python block of README.md runs as written (blocks that say "GPU only" skip without CUDA), each in a
fresh interpreter so that one block's state (enable_aten_kernels, the compile pass) cannot leak into another."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i):
    code = BLOCKS[i]
    if "GPU only" in code and not torch.cuda.is_available():
        pytest.skip("a GPU-only README block")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"README block {i} failed:\n{code}\n{out.stderr[-3000:]}"
