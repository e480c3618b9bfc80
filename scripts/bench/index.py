# SPDX-License-Identifier: BSD-3-Clause
"""Collects every result file of bench_results/ (*.json: a `meta` with device, torch and date, and the rows)
into one machine-readable file, bench_results/all.json ({path: contents}), and prints the index table of
bench_results/README.md.
    python scripts/bench/index.py"""
from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "bench_results"


def main() -> None:
    results = {}
    for f in sorted(ROOT.rglob("*.json")):
        rel = f.relative_to(ROOT).as_posix()
        if rel == "all.json":
            continue
        results[rel] = json.loads(f.read_text())
    (ROOT / "all.json").write_text(json.dumps(results, indent=0, sort_keys=True))
    print("| file | device | torch | date |\n|---|---|---|---|")
    for rel, d in results.items():
        m = d.get("meta", {}) if isinstance(d, dict) else {}
        print(f"| `{rel}` | {m.get('device', '-')} | {m.get('torch', '-')} | {m.get('date', '-')} |")


if __name__ == "__main__":
    main()
