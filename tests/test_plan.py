# SPDX-License-Identifier: BSD-3-Clause
"""The launch planner (csrc/group_norm/group_norm_plan.h) through `python -m groupnorm_ext --plan` and the
tuning reader (groupnorm_ext.tuning / set_tuning): pure functions of the problem and a named device, so these
run without a GPU (a CUDA build is needed; a CPU-only build has no planner)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import groupnorm_ext
from groupnorm_ext import __main__ as cli
from groupnorm_ext._library import _C


def _cuda_build():
    try:
        _C._plan((1, 32, 8, 64), 2, False, 0, False, cli.DEVICES["h100"])
        return True
    except RuntimeError:
        return False


needs_planner = pytest.mark.skipif(not _cuda_build(), reason="CPU-only build: no CUDA planner")


def _plan(spec, device, act="identity", input_bias=False):
    N, C, G, hxw, esize, cl = cli.parse_shape(spec)
    text = _C._plan((N, C, G, hxw), esize, cl, groupnorm_ext._library.ACTIVATIONS.index(act), False,
                    cli.DEVICES[device], input_bias)
    fwd = text.split("forward: ")[1].split(" (")[0]
    bwd = text.split("backward: ")[1].split(" (")[0]
    return fwd, bwd, text


@needs_planner
def test_bandwidth_rule_differs_between_h100_and_h200(tuning):
    """L2#19's GroupNorm, 1024 groups of 2.1 MB, with the bulk forward off (by the rule it takes the bulk forward in
    teams on both): the persistent one-pass forward on the H100 (3352 GB/s), the streamed two-pass kernels on the
    H200 (4814 GB/s, >= 3.8 TB/s) (docs/decisions/persistent-vs-streamed.md)."""
    tuning.set("GNEXT_BULK", "0")
    assert _plan("128,64,258,258:8:float32", "h100")[0] == "one-pass"
    fwd, _, text = _plan("128,64,258,258:8:float32", "h200")
    assert fwd == "two-pass" and "3.8 TB/s" in text
    # Few groups (32 < 64) keep the one-pass plan on both.
    assert _plan("1,512,256,256:32:float32", "h200")[0] == "one-pass"
    # Wide NCHW kernels: the H100 only.
    assert _plan("1,128,2048,2048:32:bfloat16", "h100")[:2] == ("wide", "wide")
    assert _plan("1,128,2048,2048:32:bfloat16", "h200")[:2] == ("two-pass", "two-pass")


@needs_planner
def test_bulk_rule():
    """Slices of more than 8 chunks of 4 KiB per SM take the bulk forward on sm_90 devices below 3.8 TB/s (measured
    on the H100; docs/decisions/bulk.md): 8 MiB groups (16 chunks per SM on 132 SMs) with look-ahead 2; 12.6 MB
    groups (24 chunks) with look-ahead 1; 16 MiB groups (32 chunks, too many for the ring twice) streamed, 24 chunks
    held and 8 read again from L2; 32 MiB groups (44 chunks of each to read again: over a quarter of L2) keep their
    plans (4 MiB groups take teams: test_bulk_teams_rule); not on sm_80 (no bulk copies), not for channels_last
    inputs. On the H200 (>= 3.8 TB/s): copies of 16 KiB (4 parts of 4 KiB), held slices of at least 64 KiB, at
    look-ahead 2; 16 MiB groups (streamed) in 8 KiB copies, 10 of 16 chunks held; 20-32 MiB groups (over a quarter
    of L2 to read again) keep the two-pass plans; the backward keeps 4 KiB chunks. The producer counts stages up in
    the H200's forward only."""
    fwd, _, text = _plan("1,128,1024,1024:32:float16", "h100")
    assert fwd == "bulk" and "look-ahead 2" in text.split("backward:")[0], text
    assert _plan("112,64,512,512:8:float32", "h100")[0] == "bulk"
    fwd, _, text = _plan("1,192,1024,1024:32:float16", "h100")
    assert fwd == "bulk" and "look-ahead 1" in text, text
    fwd, _, text = _plan("1,256,1024,1024:32:bfloat16", "h100")
    assert fwd == "bulk" and "streamed: 24 chunks" in text.split("backward:")[0], text
    for spec in ("1,128,2048,2048:32:bfloat16", "1,128,1024,1024:32:float16:cl"):
        assert _plan(spec, "h100")[0] != "bulk", spec
    assert _plan("1,128,1024,1024:32:float16", "a100")[0] != "bulk"
    for spec in ("1,128,1024,1024:32:float16", "112,64,512,512:8:float32", "1,512,512,512:32:bfloat16"):
        fwd, _, text = _plan(spec, "h200")
        fwd_text = text.split("backward:")[0]
        assert fwd == "bulk" and "look-ahead 2" in fwd_text and "streamed" not in fwd_text, text
        assert "of 16384 B (4 part(s)" in fwd_text and "producer counts stages up" in fwd_text, text
    text = _plan("1,128,1024,1024:32:float16", "h100")[2]
    assert "of 4096 B (1 part(s)" in text and "producer counts stages up" not in text, text
    text = _plan("1,512,256,256:32:float32", "h200")[2].split("backward:")[1]
    assert "bulk" in text and "of 4096 B (1 part(s)" in text and "producer per chunk" in text, text
    for spec in ("1,256,1024,1024:32:bfloat16", "1,512,512,512:32:float32"):
        fwd, _, text = _plan(spec, "h200")
        fwd_text = text.split("backward:")[0]
        assert fwd == "bulk" and "of 8192 B (2 part(s)" in fwd_text and "streamed: 10 chunks" in fwd_text, text
    for spec in ("1,320,1024,1024:32:float16", "1,128,2048,2048:32:bfloat16"):
        assert _plan(spec, "h200")[0] != "bulk", spec


@needs_planner
def test_bulk_fewer_consumers_rule(tuning):
    """Held NCHW slices of 17-24 parts of 4 KiB on the H200 (>= 3.8 TB/s) take 12 consumer warps instead of 16
    (two parts each), float32 slices in 4 KiB copies (docs/decisions/bulk.md#fewer-consumer-warps-on-the-h200):
    12 MiB fp16 groups (6 copies of 16 KiB per SM, 24 parts), 9 MiB ones (5 copies, 20 parts, with the look-ahead set:
    the rule sends them two-pass, test_bulk_ahead1_rule); 9 MiB float32 groups in 18 copies of 4 KiB. Slices of 16
    parts or fewer, streamed ones, the backward, the H100 and an explicit GNEXT_BULK_CONSUMERS keep their warps."""
    def fwd_text(spec, device, act="identity"):
        fwd, _, text = _plan(spec, device, act)
        assert fwd == "bulk", (spec, device, text)
        return text.split("backward:")[0]

    tuning.set("GNEXT_BULK_AHEAD", "1")
    for act in ("identity", "silu"):
        for spec, copy in (("1,192,1024,1024:32:float16", 16384), ("1,160,1024,1024:32:float16", 16384),
                           ("1,192,1024,1024:32:bfloat16", 16384), ("1,256,768,768:32:float16", 16384),
                           ("1,128,768,768:32:float32", 4096), ("1,96,1024,1024:32:float32", 4096)):
            text = fwd_text(spec, "h200", act)
            assert "(12 consumer warps" in text and f"of {copy} B" in text and "streamed" not in text, (spec, text)
            assert "(16 consumer warps" in fwd_text(spec, "h100", act), spec
    tuning.set("GNEXT_BULK_AHEAD", "-1")
    for spec in ("1,128,1024,1024:32:float16", "1,512,512,512:32:bfloat16", "1,256,1024,1024:32:bfloat16"):
        assert "(16 consumer warps" in fwd_text(spec, "h200"), spec
    assert "(8 consumer warps" in _plan("1,512,256,256:32:float32", "h200")[2].split("backward:")[1]
    tuning.set("GNEXT_BULK_CONSUMERS", "16")
    assert "(16 consumer warps" in fwd_text("1,192,1024,1024:32:float16", "h200")


@needs_planner
def test_bulk_ahead1_rule(tuning):
    """On the H200 (>= 3.8 TB/s), held slices of 16 KiB copies at look-ahead 1 with fewer than 24 parts of 4 KiB (5
    copies: groups of 8.3-10.3 MiB) go two-pass, GroupNorm and GroupNorm+SiLU alike, and not one-pass
    (docs/decisions/bulk.md#look-ahead-1-on-the-h200). 6 copies (10.4-12.4 MiB groups), 4 copies at look-ahead 2,
    float32's 4 KiB copies, the H100, and the bulk knobs set explicitly keep the bulk forward."""
    for act in ("identity", "silu"):
        for spec in ("1,256,768,768:32:float16", "1,160,1024,1024:32:float16", "1,288,768,768:32:bfloat16"):
            fwd, _, text = _plan(spec, "h200", act)
            assert fwd == "two-pass" and "look-ahead 1" in text.split("backward:")[0], (spec, act, text)
            assert _plan(spec, "h100", act)[0] == "bulk", spec
        for spec in ("1,320,768,768:32:float16", "1,192,1024,1024:32:float16", "1,128,1024,1024:32:float16",
                     "1,128,768,768:32:float32"):
            assert _plan(spec, "h200", act)[0] == "bulk", (spec, act)
    for knob, value in (("GNEXT_BULK", "2"), ("GNEXT_BULK_AHEAD", "1"), ("GNEXT_BULK_CHUNK", "16384")):
        tuning.set(knob, value)
        assert _plan("1,256,768,768:32:float16", "h200")[0] == "bulk", knob
        tuning.set(knob, {"GNEXT_BULK": "1"}.get(knob, "-1"))
    # Without the bulk forward, 32 groups of >= 8 MiB stream (two-pass) on the H200; 2 MiB ones keep one-pass.
    tuning.set("GNEXT_BULK", "0")
    assert _plan("1,256,768,768:32:float16", "h200")[0] == "two-pass"
    assert _plan("1,256,768,768:32:float16", "h100")[0] == "one-pass"
    assert _plan("1,512,256,256:32:float32", "h200")[0] == "one-pass"


@needs_planner
def test_bulk_rule_with_activation():
    """An output activation does not change the bulk forward's plans: on the H200, 16 MiB groups stream in 8 KiB
    copies, held slices and teams stay, on 2-byte elements as on float32 (the 2-byte activation forwards' normalize
    keeps a loop without channel bookkeeping for that: docs/decisions/bulk.md)."""
    for act in ("silu", "gelu"):
        for spec in ("1,256,1024,1024:32:bfloat16", "2,128,1024,1024:16:float16", "1,512,512,512:32:float32"):
            fwd, _, text = _plan(spec, "h200", act)
            assert fwd == "bulk" and "streamed: 10 chunks" in text.split("backward:")[0], (spec, text)
        for spec in ("1,128,1024,1024:32:float16", "112,64,256,256:8:bfloat16", "16,256,16000:16:bfloat16"):
            assert _plan(spec, "h200", act)[0] == "bulk", spec


@needs_planner
def test_bulk_teams_rule(tuning):
    """The bulk forward in teams (docs/decisions/bulk.md): where one team of every CTA gives slices too short, the
    most teams (>= 4 CTAs and >= 2 groups each) whose slices the ring holds at look-ahead 2, in 4 KiB copies on both
    GPUs. L2#19's GroupNorm (520 chunks per group): 4 teams of 33, 16 chunks per slice; 8x512x4096 fp32 (64
    chunks): 33 teams of 4; 4 MiB groups, 64 of them: 2 teams of 66. 16 groups of 512 KiB (8 teams of 16 CTAs, 8
    chunks per slice: too short) keep one-pass; groups that one team streams keep one team (8 MiB groups; 16 KiB
    copies on the H200); the backward never takes teams. GNEXT_BULK_TEAMS=1: one team, so L2#19 keeps one-pass on
    the H100."""
    def teams(text):
        fwd = text.split("backward:")[0]
        return [line.strip().split(":")[0] for line in fwd.splitlines() if " teams of " in line and "why" not in line]

    for device in ("h100", "h200"):
        for spec, want in (("128,64,258,258:8:float32", "4 teams of 33 CTAs"), ("8,512,4096:32:float32",
                                                                                "33 teams of 4 CTAs"),
                           ("2,256,512,512:32:bfloat16", "2 teams of 66 CTAs")):
            fwd, bwd, text = _plan(spec, device)
            fwd_text = text.split("backward:")[0]
            assert fwd == "bulk" and teams(text) == [want], (device, spec, text)
            assert "of 4096 B (1 part(s)" in fwd_text and "look-ahead 2" in fwd_text, (device, spec, text)
            assert " teams of " not in text.split("backward:")[1], text
        assert _plan("16,128,32,32:1:float32", device)[0] == "one-pass"
        fwd, _, text = _plan("1,128,1024,1024:32:float16", device)
        assert fwd == "bulk" and teams(text) == [], text
    tuning.set("GNEXT_BULK_TEAMS", "1")
    assert _plan("128,64,258,258:8:float32", "h100")[0] == "one-pass"


@needs_planner
def test_bulk_backward_rule():
    """The bulk backward (H100; docs/decisions/bulk.md): slices of x and dy of at least 8 chunks per SM. 4 MiB
    groups fit the ring three times (look-ahead 2); 8 MiB groups do not fit it twice and are streamed, 10 of their 16
    chunks held and the rest read again from L2 (12.4 MiB in flight, within a quarter of L2); 12 MiB groups would
    need 37 MiB of L2 and keep the wide kernel; 2 MiB groups (4 chunks) keep one-pass. With an output activation:
    ReLU and SiLU (2-byte 4 MiB groups included), GELU only on float32 slices held in the ring (streamed or on 2-byte
    elements, its derivative taken twice per element outruns the consumer warps), not the others (unmeasured). 8
    consumer warps (16 in the forward). Not on sm_80. On the H200 the same slices with identity and ReLU, SiLU on
    float32 only, GELU not (unmeasured there)."""
    _, bwd, text = _plan("1,128,1024,1024:32:float16", "h100")
    assert bwd == "bulk" and "streamed: 10 chunks" in text, text
    fwd_text, bwd_text = text.split("backward:")
    assert "16 consumer warps" in fwd_text and "8 consumer warps" in bwd_text, text  # the backward's launch bound
    _, bwd, text = _plan("1,512,256,256:32:float32", "h100")
    assert bwd == "bulk" and "look-ahead 2" in text.split("backward:")[1] and "streamed" not in text, text
    assert _plan("112,64,512,512:8:float32", "h100")[1] == "bulk"
    for spec in ("16,64,512,512:8:float32", "1,512,256,256:32:float32", "1,128,1024,1024:32:float16",
                 "2,512,512,512:32:bfloat16", "2,256,512,512:32:bfloat16"):
        assert _plan(spec, "h100", act="silu")[1] == "bulk", spec
    for spec, act in (("16,64,512,512:8:float32", "relu"), ("1,128,1024,1024:32:float16", "relu"),
                      ("1,512,256,256:32:float32", "gelu")):
        assert _plan(spec, "h100", act=act)[1] == "bulk", (spec, act)
    for spec, act in (("1,192,1024,1024:32:float16", "identity"), ("4,128,512,512:32:float16", "identity"),
                      ("4,128,512,512:32:float16", "silu"), ("16,64,512,512:8:float32", "gelu"),
                      ("1,128,1024,1024:32:float16", "gelu"), ("2,256,512,512:32:bfloat16", "gelu"),
                      ("1,512,256,256:32:float32", "tanh")):
        assert _plan(spec, "h100", act=act)[1] != "bulk", (spec, act)
    assert _plan("1,128,1024,1024:32:float16", "a100")[1] != "bulk"
    for spec, act in (("1,128,1024,1024:32:float16", "identity"), ("1,128,1024,1024:32:float16", "relu"),
                      ("2,256,512,512:32:bfloat16", "relu"), ("16,64,512,512:8:float32", "silu"),
                      ("1,512,256,256:32:float32", "silu")):
        assert _plan(spec, "h200", act=act)[1] == "bulk", (spec, act)
    for spec, act in (("1,128,1024,1024:32:float16", "silu"), ("2,512,512,512:32:float16", "silu"),
                      ("1,512,256,256:32:float32", "gelu"), ("1,256,1024,1024:32:bfloat16", "identity")):
        assert _plan(spec, "h200", act=act)[1] != "bulk", (spec, act)


@needs_planner
@pytest.mark.parametrize("spec,fwd,bwd", [
    ("256,1024,1,1:32:bfloat16", "small-group", "small-group"),
    ("32,2048,7,7:32:bfloat16", "small-group", "small-group"),
    ("2,320,64,64:32:float16", "one-pass", "one-pass"),
    ("16,512,128,128:32:bfloat16:cl", "two-pass", "two-pass"),
    ("1,512,128,128:32:float16:cl", "wide channels_last", "two-pass"),
    ("32,256,32,32:32:bfloat16:cl", "bulk channels_last", "two-pass"),  # 512 KiB images, teams of 8 CTAs
    ("8,512,64,64:32:bfloat16:cl", "bulk channels_last", "two-pass"),  # 4 MiB images
    ("4,256,128,128:32:bfloat16:cl", "bulk channels_last", "two-pass"),  # 8 MiB images: the H100's bound
    ("8,512,96,96:32:float16:cl", "two-pass", "two-pass"),  # 9 MiB images: over it
    ("2,64,33,35:16:float32", "two-pass", "two-pass"),  # rows not 16-byte multiples: scalar two-pass
])
def test_plan_choice(spec, fwd, bwd):
    assert _plan(spec, "h100")[:2] == (fwd, bwd)


@needs_planner
def test_plan_bulk_nhwc_shapes():
    """The channels_last bulk forward takes images of <= 2 MiB whose rows are a power of two of 16-byte vectors with
    each vector in one group or two halves, on both GPUs, and images of up to 8 MiB in tensors over half of L2 below
    3.8 TB/s (the H100); C / V not a power of two (C = 320), D = 2 with 8-element vectors, or an NCHW input do not
    take it."""
    for dev in ("h100", "h200"):
        for spec in ("32,256,32,32:32:bfloat16:cl", "16,128,64,64:32:bfloat16:cl", "16,512,32,32:32:float16:cl"):
            assert _plan(spec, dev)[0] == "bulk channels_last", (spec, dev)
        for spec in ("32,320,32,32:32:bfloat16:cl", "32,64,112,112:32:bfloat16:cl", "32,256,32,32:32:bfloat16"):
            assert _plan(spec, dev)[0] != "bulk channels_last", (spec, dev)
    assert _plan("8,512,64,64:32:bfloat16:cl", "h100")[0] == "bulk channels_last"
    assert _plan("8,512,64,64:32:bfloat16:cl", "h200")[0] != "bulk channels_last"
    # Images over 2 MiB in a tensor that half of L2 holds: two-pass (it reads the tensor twice from L2 in a graph).
    for spec in ("2,64,16,64,64:8:bfloat16:cl", "4,512,64,64:32:float16:cl"):
        assert _plan(spec, "h100")[0] != "bulk channels_last", spec


@needs_planner
def test_two_pass_forward_fills_whole_waves(tuning):
    """NCHW rows split for the two-pass kernels (docs/decisions/two-pass-split.md): the forward takes 4 chunks per
    row of a 128-row map (512 CTAs, one wave of 4 x 132) where 5 would start a second wave of 112; the backward keeps
    at least its target (9 chunks of 1056); 512 rows keep 2 chunks (two full waves)."""
    def chunks(text, direction):
        part = text.split(f"{direction}: ")[1]
        return int(part.split("reduce: ")[1].split(" chunk")[0])

    _, _, text = _plan("1,128,2048,2048:32:bfloat16", "h200")
    assert (chunks(text, "forward"), chunks(text, "backward")) == (4, 9)
    tuning.set("GNEXT_BULK", "0")  # by the rule its 2 MiB groups take the bulk forward in teams
    _, _, text = _plan("2,256,256,256:32:float32", "h200")
    assert chunks(text, "forward") == 2


@needs_planner
def test_two_pass_elementwise_tiles():
    """The NCHW elementwise pass in tiles of 2048 vectors, a CTA each (docs/decisions/two-pass-split.md): on the H100
    in both directions, on the H200 for the backward, 4-byte forwards and 2-byte forwards other than GELU's; the H200's
    2-byte forward with GELU keeps CTAs looping over chunks."""
    def elementwise(text, direction):
        return text.split(f"{direction}: ")[1].split("elementwise: ")[1].split("\n")[0]

    _, _, text = _plan("1,128,2048,2048:32:float32", "h100")
    assert elementwise(text, "forward") == "grid 65536 x 1, 512 threads, tiles of 8192 elements"
    _, _, text = _plan("1,128,2048,2048:32:bfloat16", "h200")
    assert elementwise(text, "forward") == "grid 32768 x 1, 512 threads, tiles of 16384 elements"
    assert elementwise(text, "backward") == "grid 32768 x 1, 512 threads, tiles of 16384 elements"
    _, _, text = _plan("1,128,2048,2048:32:bfloat16", "h200", act="silu")
    assert elementwise(text, "forward") == "grid 32768 x 1, 512 threads, tiles of 16384 elements"
    _, _, text = _plan("1,128,2048,2048:32:bfloat16", "h200", act="gelu")
    assert elementwise(text, "forward") == "grid 128 x 6, 512 threads"
    assert elementwise(text, "backward") == "grid 32768 x 1, 512 threads, tiles of 16384 elements"
    _, _, text = _plan("1,128,2048,2048:32:float32", "h200")
    assert elementwise(text, "forward") == "grid 65536 x 1, 512 threads, tiles of 8192 elements"
    # 2^22 rows of 2048 tiles: past a 1-D grid's 2^31 CTAs, a CTA per row chunk as before
    _, _, text = _plan("4096,1024,4096,4096:32:float32", "h100")
    assert elementwise(text, "forward") == "grid 4194304 x 1, 512 threads"


@needs_planner
def test_looping_elementwise_counts_resident_waves(tuning):
    """The H200's 2-byte forward with GELU (erf or tanh form) loops (affine_tiles): chunks per row from target_ctas
    (528) CTAs up, the fewest whose last wave of the 396 that fit (3 of 512 threads per SM) is >= 70% full or that
    make 8 waves (docs/decisions/two-pass-split.md#looping-ctas-in-resident-waves). GNEXT_TARGET_CTAS keeps the plain
    split, GNEXT_AFFINE_K sets the chunks; other activations, GroupNorm alone, float32 and the H100 take tiles."""
    def elementwise(spec, device="h200", act="gelu"):
        text = _plan(spec, device, act)[2].split("backward:")[0]
        return text.split("elementwise: ")[1].split("\n")[0]

    for spec, k in (("1,288,768,768:32:float16", 4),    # 2 chunks: 576 CTAs, a last wave of 180; 4: 1152, last 360
                    ("1,160,1024,1024:32:float16", 7),  # 4: 640, last 244; 7: 1120, last 328
                    ("1,320,1024,1024:32:float16", 6),  # 1920 = 4 x 396 + 336
                    ("1,256,768,768:32:bfloat16", 3),   # 768 = 396 + 372
                    ("2,544,512,512:32:float16", 1)):   # 1088 = 2 x 396 + 296
        rows = int(spec.split(",")[0]) * int(spec.split(",")[1])
        assert elementwise(spec) == f"grid {rows} x {k}, 512 threads", spec
        assert elementwise(spec, act="gelu_tanh") == f"grid {rows} x {k}, 512 threads", spec
    for act in ("identity", "silu", "relu", "tanh", "hardswish", "tanh_hardswish"):
        assert "tiles" in elementwise("1,288,768,768:32:float16", act=act), act
    assert "tiles" in elementwise("1,288,768,768:32:float32")
    tuning.set("GNEXT_TARGET_CTAS", "528")
    assert elementwise("1,288,768,768:32:float16") == "grid 288 x 2, 512 threads"
    tuning.set("GNEXT_TARGET_CTAS", "-1")
    tuning.set("GNEXT_AFFINE_K", "5")
    assert elementwise("1,288,768,768:32:float16") == "grid 288 x 5, 512 threads"
    for knob in ("GNEXT_BULK", "GNEXT_ONEPASS", "GNEXT_WIDE"):  # two-pass on the H100 too
        tuning.set(knob, "0")
    assert "tiles" in elementwise("1,288,768,768:32:float16", "h100")


@needs_planner
def test_forward_reduction_counts_resident_waves(tuning):
    """The NCHW forward reduction without a prologue: from nchw_row_split's chunks per row up to the first whose last
    wave of resident CTAs (reduce_fwd_ctas_per_sm: 2 of 512 threads per SM for 16-byte vectors of 2-byte elements,
    else 4) is >= 70% full or that make 4 waves (docs/decisions/two-pass-split.md#the-reduction-in-resident-waves).
    GNEXT_TARGET_CTAS keeps the plain split."""
    def reduce(spec, device="h200", act="silu"):
        text = _plan(spec, device, act)[2].split("backward:")[0]
        return text.split("reduce: ")[1].split(" chunk(s)")[0]

    for knob in ("GNEXT_BULK", "GNEXT_ONEPASS", "GNEXT_WIDE"):  # two-pass on every shape
        tuning.set(knob, "0")
    for spec, k in (("1,288,768,768:32:float16", 4),    # 2: 576 CTAs = 2 x 264 + 48; 3: 864, last 72; 4: 4.4 waves
                    ("1,256,768,768:32:bfloat16", 2),   # 512 = 264 + 248
                    ("1,160,1024,1024:32:float16", 3),  # 480 = 264 + 216
                    ("1,128,2048,2048:32:bfloat16", 4),  # 512
                    ("1,288,768,768:32:float32", 5)):   # 4 per SM: 576 = 528 + 48; 1440 = 2 x 528 + 384
        assert reduce(spec) == str(k), spec
        assert reduce(spec, "h100") == str(k), spec  # 132 SMs on both
    assert reduce("1,288,768,768:32:float16", act="identity") == "4"
    tuning.set("GNEXT_TARGET_CTAS", "528")
    assert reduce("1,288,768,768:32:float16") == "2"


@needs_planner
@pytest.mark.parametrize("spec,act,bwd", [
    ("32,256,56,56:32:bfloat16", "silu", "two-pass"),  # 1024 groups of 2 tiles, 16-bit, with an activation
    ("12,256,56,56:32:bfloat16", "relu", "two-pass"),
    ("32,256,56,56:32:bfloat16", "identity", "one-pass"),  # no activation
    ("8,256,56,56:32:bfloat16", "silu", "one-pass"),  # 256 groups: one wave
    ("32,512,28,28:32:float32", "silu", "one-pass"),  # float32
])
def test_backward_with_activation_two_pass_for_many_16bit_groups(spec, act, bwd):
    """docs/decisions/onepass.md: the streamed one-pass backward loses to two-pass with an output activation on
    16-bit groups of <= 2 tiles in more than a wave (H100)."""
    assert _plan(spec, "h100", act)[1] == bwd


@needs_planner
def test_tuning_overrides_change_the_plan():
    before = groupnorm_ext.set_tuning({"ONEPASS": 0, "GNEXT_WIDE_NHWC": 0})
    try:
        assert groupnorm_ext.tuning()["GNEXT_ONEPASS"] == 0
        assert _plan("2,320,64,64:32:float16", "h100")[:2] == ("two-pass", "two-pass")
        assert _plan("1,512,128,128:32:float16:cl", "h100")[0] == "two-pass"
    finally:
        groupnorm_ext.set_tuning(before)
    assert _plan("2,320,64,64:32:float16", "h100")[0] == "one-pass"


def test_tuning_rejects_unknown_knobs_and_reads_the_environment_once():
    with pytest.raises(ValueError, match="GNEXT_NO_SUCH_KNOB"):
        groupnorm_ext.set_tuning({"NO_SUCH_KNOB": 1})
    env = dict(os.environ, GNEXT_ONEPASS="0", GNEXT_SMALL_FILL="5")
    code = ("import os, groupnorm_ext as g; t = g.tuning(); os.environ['GNEXT_ONEPASS'] = '2'; "
            "print(t['GNEXT_ONEPASS'], t['GNEXT_SMALL_FILL'], g.tuning()['GNEXT_ONEPASS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "5", "0"]


@needs_planner
def test_plan_cli_prints_both_directions_and_rejects_bad_specs(capsys):
    assert cli.main(["--plan", "1,128,1024,1024:32:float16:cl", "--device", "h200", "--act", "silu"]) == 0
    out = capsys.readouterr().out
    assert "forward: " in out and "backward: " in out and "why: " in out and "channels_last" in out
    for bad in ("1,130,8,8:32:float16", "1,128,8,8:32:int8", "1,128,8,8:32", "1,128,8,8:32:float16:nhwc"):
        with pytest.raises(SystemExit):
            cli.main(["--plan", bad, "--device", "h100"])


@needs_planner
def test_input_bias_rule():
    """A forward with input_bias (a convolution's bias that the op adds as it reads) takes the kernels that hold
    per-channel sums: the wide channels_last kernel where its rule applies, else two-pass (2R + 1W, less than a
    bias pass before a one-pass kernel); the backward's plan does not change. The AutoencoderKL decoder's maps."""
    for device in ("h100", "h200"):
        for spec in ("1,512,128,128:32:float16:cl", "1,256,512,512:32:float16:cl", "1,512,256,256:32:bfloat16:cl",
                     "1,128,256,256:32:float16", "2,64,40,40:16:float32", "64,64,4,4:16:float16",
                     "1,128,1024,1024:32:float16", "112,64,512,512:8:float32"):
            plain = _plan(spec, device, "silu")
            fwd, bwd, text = _plan(spec, device, "silu", input_bias=True)
            assert "input bias" in text.split("\n")[0], text
            expected = "wide channels_last" if plain[0] == "wide channels_last" else "two-pass"
            assert fwd == expected and bwd == plain[1], (spec, device, text)
            assert "input shift" in text.split("backward:")[0], text
    assert _plan("1,512,128,128:32:float16:cl", "h200", "silu", input_bias=True)[0] == "wide channels_last"


@needs_planner
def test_small_group_cta_forward_holds_64kb_groups():
    """A CTA per group holds up to 16 vectors per thread in the forward (groups of 32-64 KB: ResNet-GN's 28x28 and
    56x56 maps), 8 in the backward (x and dy) and in the 2-byte GELU forward, on both GPUs; groups over 64 KB or fewer
    groups than SMs take the other kernels (docs/decisions/small-groups.md)."""
    for dev in ("h100", "h200"):
        for spec, act in (("32,512,28,28:32:float32", "silu"), ("32,512,28,28:32:float32", "gelu"),
                          ("32,256,56,56:32:bfloat16", "identity"), ("8,512,32,32:32:float32", "relu")):
            fwd, bwd, text = _plan(spec, dev, act=act)
            assert fwd == "small-group" and bwd != "small-group", (spec, act, dev)
            assert "registers for 16" in text.split("backward:")[0], text
        assert _plan("32,256,56,56:32:bfloat16", dev, act="gelu")[0] != "small-group"
        assert _plan("8,1024,32,32:32:float32", dev)[0] != "small-group"  # 128 KB groups
        assert _plan("2,512,28,28:32:float32", dev)[0] != "small-group"  # 64 groups
