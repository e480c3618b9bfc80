# SPDX-License-Identifier: BSD-3-Clause
"""The benchmark scripts' table logic that the committed results depend on, and the developer tools' parsers (CPU;
no timing)."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import real_models  # noqa: E402
import sweep  # noqa: E402


def _run(path, date, timing, names):
    meta = {"device": "dev", "torch": "t", "date": date, "timing": timing}
    path.write_text(json.dumps({"meta": meta, "rows": [{"row": n, "ms": {}} for n in names]}))
    return str(path)


def test_real_models_merge_keeps_each_rows_run(tmp_path):
    """Rows keep the date and timing of the run that made them, also through a second merge."""
    a = _run(tmp_path / "a.json", "D1", "9 rounds", ["vae", "sd15"])
    b = _run(tmp_path / "b.json", "D2", "15 rounds", ["unet", "bit"])
    c = _run(tmp_path / "c.json", "D3", "9 rounds", ["vae"])
    meta, rows = real_models.merge([a, b], ["vae", "unet", "sd15", "bit"])
    assert [r["row"] for r in rows] == ["vae", "unet", "sd15", "bit"]
    assert meta["date"] == "D1 / D2"
    assert meta["timing"] == "9 rounds (vae, sd15) / 15 rounds (unet, bit)"
    merged = tmp_path / "ab.json"
    merged.write_text(json.dumps({"meta": meta, "rows": rows}))
    meta, rows = real_models.merge([str(merged), c], ["vae", "unet", "sd15", "bit"])
    assert [(r["row"], r["date"]) for r in rows] == [("vae", "D3"), ("unet", "D2"), ("sd15", "D1"), ("bit", "D2")]
    assert meta["date"] == "D3 / D2 / D1"
    assert meta["timing"] == "9 rounds (vae) / 15 rounds (unet, bit) / 9 rounds (sd15)"


def test_real_models_table_with_a_subset_of_variants(tmp_path):
    """A run of the eager variants only (--variants eager,gnext,gnext-aten) and an older row without gnext-aten
    render in one table: the missing cells read "–", the per-round ratios of the pairs each row has."""
    def row(name, ms_rounds):
        return {"row": name, "ms": {v: min(t) for v, t in ms_rounds.items()},
                "ms_min": {v: min(t) for v, t in ms_rounds.items()},
                "ms_max": {v: max(t) for v, t in ms_rounds.items()}, "ms_rounds": ms_rounds, "orders": [],
                "rel_diff_vs_fp32": dict.fromkeys(ms_rounds, 1e-3), "fusion_rewrites": None}

    new = row("unet", {"eager": [10.0, 12.0], "gnext": [11.0, 12.0], "gnext-aten": [9.0, 10.0]})
    old = row("vae", {"eager": [20.0, 20.0], "gnext": [10.0, 10.0], "compile": [8.0, 8.0],
                      "compile+fusion": [6.4, 6.4]})
    old["fusion_rewrites"] = 19
    meta = {"device": "dev", "torch": "t", "date": "D", "timing": "2 rounds"}
    md = real_models.write(tmp_path, meta, [new, old], "t")
    lines = md.splitlines()
    assert "gnext-aten eager ms (x)" in lines[2] and "compile + fusion ms (x)" in lines[2]
    unet = next(line for line in lines if line.startswith("| unet |"))
    assert "9.00 [9.00–10.00] (1.11x)" in unet and unet.count("–") >= 4
    vae = next(line for line in lines if line.startswith("| vae |"))
    assert "1.25x | 19" in vae
    ratios = next(line for line in lines if line.startswith("| unet (random order)"))
    assert "1.156 [1.11–1.20] 2/2" in ratios  # gnext-aten vs eager per round: 10/9, 12/10
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.md").exists()


def test_real_models_every_variant_has_a_column_label():
    """write() labels its columns from LABELS: a variant without a label would end a device run in a KeyError after
    its rounds, with no table written."""
    assert set(real_models.VARIANTS + real_models.EXTRA_VARIANTS) <= set(real_models.LABELS)


def test_ncu_stalls_attributes_samples_to_instructions(tmp_path, capsys):
    """scripts/dev/ncu_stalls.py on a source page of three instructions: the wait loop's branch holds 80% of the
    samples and is listed with its top stall reason; the window summary adds up to 100%; a page without the
    sampling column is refused with a message naming it."""
    sys.path.insert(0, str(ROOT / "scripts" / "dev"))
    import ncu_stalls

    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
           "stall_math", "stall_long_sb (Not Issued)"]
    rows = [["0x0", "LDS.128 R4, [R2]", "10", "64", "2", "8", "2"],
            ["0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R5", "10", "64", "10", "0", "10"],
            ["0x20", "@!P0 BRA 0x10", "80", "6400", "79", "1", "79"]]
    page = tmp_path / "page.csv"
    page.write_text("\n".join(",".join(f'"{v}"' for v in r) for r in [["Kernel Name", "k"], hdr, *rows]) + "\n")
    ncu_stalls.main([str(page), "--top", "50", "--window", "2"])
    out = capsys.readouterr().out
    assert "100 samples over 3 instructions" in out
    listed = [line for line in out.splitlines() if "%" in line and "BRA" in line]
    assert len(listed) == 1 and "80.0%" in listed[0] and "long_sb 79" in listed[0] and "6400" in listed[0]
    assert "LDS.128" not in out.split("samples per")[0]  # 10% < --top 50
    assert "0: 20.0 2: 80.0" in out
    bad = tmp_path / "bad.csv"
    bad.write_text('"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(SystemExit, match=r"Warp Stall Sampling \(All Samples\)"):
        ncu_stalls.main([str(bad)])


def test_sweep_ratio_is_the_median_of_per_round_ratios():
    """Round 2 stalled gnext alone and round 3 both: the ratio of the medians (20 / 30) reads gnext slower, the
    median of the per-round ratios (19/12, 20/30, 40/31) does not. Rows of older sweeps (no per-round times) keep
    the ratio of the medians."""
    row = {"gnext fwd": 30.0, "eager fwd": 20.0, "gnext fwd rounds": [12.0, 30.0, 31.0],
           "eager fwd rounds": [19.0, 20.0, 40.0]}
    assert sweep.ratio(row, "eager fwd", "gnext fwd") == pytest.approx(40.0 / 31.0)
    assert sweep.ratio({"gnext f+b": 0.25, "eager f+b": 0.20}, "eager f+b", "gnext f+b") == pytest.approx(0.8)
    uneven = dict(row, **{"eager fwd rounds": [19.0, 20.0]})  # a peer that failed in a later round
    assert sweep.ratio(uneven, "eager fwd", "gnext fwd") == pytest.approx(20.0 / 30.0)
