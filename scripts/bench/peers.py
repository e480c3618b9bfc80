# SPDX-License-Identifier: BSD-3-Clause
"""The public Triton GroupNorm+SiLU kernels gnext is compared with, loaded by path from .peers/
(scripts/dev/fetch_peers.sh puts them there; their code is never copied into the project):

* sglang 0.5.23 ``triton_group_norm_silu(x, w, b, G, eps)`` (NCHW; calls ``.contiguous()``) and
  ``group_norm_silu_4d(x, w, b, G, eps)`` (channels_last 4-D, power-of-two C <= 2048, guarded by
  ``can_use_group_norm_silu_4d``);
* vllm-omni 0.30.0 ``fused_group_norm_silu(x, w, b, G, eps)`` (NCHW, one program per group, autotuned).

Their framework imports are replaced by small stubs (an identity ``register_custom_op`` for sglang;
``vllm.triton_utils`` and ``vllm.logger`` for vllm-omni). ``load()`` returns {name: fn(x, w, b, G, eps)
-> y or None where the peer does not take that input}; peers whose files are missing are left out."""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"
SGLANG = PEERS / "sglang/kernels/ops/diffusion/norm"
VLLM_OMNI = PEERS / "vllm_omni/model_executor/models/common/ops/fused_group_norm_silu.py"


def _stub(name, **attrs):
    mod = sys.modules.get(name) or types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_stub(parent), child, mod)
    return mod


def _load_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load() -> dict:
    import triton
    import triton.language as tl

    peers = {}
    if (SGLANG / "group_norm_silu_triton.py").exists():
        def register_custom_op(*args, **kwargs):  # sglang.srt.utils.custom_op: identity decorator
            return lambda fn: fn

        _stub("sglang.srt.utils.custom_op", register_custom_op=register_custom_op)
        nchw = _load_file("peer_sglang_gn_silu", SGLANG / "group_norm_silu_triton.py")
        peers["sglang"] = lambda x, w, b, G, eps: nchw.triton_group_norm_silu(x, w, b, G, eps)
        if (SGLANG / "group_norm_silu_twopass_triton.py").exists():
            cl = _load_file("peer_sglang_gn_silu_twopass", SGLANG / "group_norm_silu_twopass_triton.py")

            def sglang_auto(x, w, b, G, eps):
                """sglang's own choice: the channels_last two-pass kernel where it applies, else NCHW."""
                if cl.can_use_group_norm_silu_4d(x, w, b, G):
                    return cl.group_norm_silu_4d(x, w, b, G, eps)
                return nchw.triton_group_norm_silu(x, w, b, G, eps)

            peers["sglang"] = sglang_auto
    if VLLM_OMNI.exists():
        _stub("vllm.triton_utils", HAS_TRITON=True, triton=triton, tl=tl)
        _stub("vllm.logger", init_logger=logging.getLogger)
        omni = _load_file("peer_vllm_omni_gn_silu", VLLM_OMNI)
        peers["vllm-omni"] = lambda x, w, b, G, eps: omni.fused_group_norm_silu(x, w, b, G, eps)
    return peers


if __name__ == "__main__":
    print(sorted(load()))
