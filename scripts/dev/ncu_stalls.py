#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Where a kernel's warps stall, per SASS instruction: reads Nsight Compute's source page (CSV) of one launch and
prints the instructions holding the most warp-state samples, with their execution count and top stall reasons,
then the share of samples per window of instructions (to find the region: producer, consumers, mergers).

Capture on the GPU machine (one launch; -lineinfo is not needed, the SASS is listed):
    ncu --clock-control none --kernel-name regex:bulk_nhwc --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -f -o rep \\
        python3 scripts/dev/ncu_case.py 16,512,128,128 32 bfloat16 cl fwd
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
Then, anywhere:
    python3 scripts/dev/ncu_stalls.py rep.csv [--top 0.5] [--window 150]

A wait loop shows as a branch (BRA) after SYNCS.PHASECHK...TRYWAIT with long-scoreboard samples; an input that every
warp waits for shows as samples on the first instruction that uses its load. Idle warps (a producer, publisher or
merger spinning on a barrier) take samples too, so a share is of all warps, not of the busy ones."""
from __future__ import annotations

import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """The header row and the instruction rows of the source page (the first row names the kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for k, row in enumerate(rows):
        if SAMPLES in row:
            return row, [r for r in rows[k + 1:] if len(r) == len(row)]
    raise SystemExit(f"ncu_stalls: {path!r} has no {SAMPLES!r} column: export with --page source --csv "
                     "--print-source sass from a report taken with --section SourceCounters")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=float, default=0.5, help="list instructions with at least this %% of samples")
    p.add_argument("--window", type=int, default=150, help="instructions per window in the region summary")
    a = p.parse_args(argv)
    hdr, rows = load(a.csv)
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]

    def num(r: list[str], col: str) -> int:
        v = r[ix[col]] if col in ix else ""
        return int(float(v)) if v not in ("", "-") else 0

    samples = [num(r, SAMPLES) for r in rows]
    total = sum(samples)
    if total == 0:
        raise SystemExit("ncu_stalls: no samples in this launch")
    print(f"{total} samples over {len(rows)} instructions")
    print(f"{'#':>5} {'share':>6} {'executed':>10}  instruction / top stall reasons (samples)")
    for k, (r, s) in enumerate(zip(rows, samples)):
        if 100 * s >= a.top * total:
            top = sorted(((num(r, h), h[len("stall_"):]) for h in reasons), reverse=True)[:3]
            why = ", ".join(f"{name} {n}" for n, name in top if n)
            print(f"{k:5d} {100 * s / total:5.1f}% {num(r, 'Instructions Executed'):10d}  "
                  f"{r[ix['Source']].strip()[:64]:64s} {why}")
    print(f"samples per {a.window} instructions (first index: share):")
    print(" ".join(f"{k}: {100 * sum(samples[k:k + a.window]) / total:.1f}" for k in range(0, len(rows), a.window)))


if __name__ == "__main__":
    main(sys.argv[1:])
