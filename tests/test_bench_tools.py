"""The benchmark scripts' table logic that the committed results depend on (CPU; no timing)."""
from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import real_models  # noqa: E402


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
