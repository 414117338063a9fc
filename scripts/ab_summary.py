#!/usr/bin/env python3
"""run.sh's `ab` step: perf as built at the base revision (examples/perf_base,
`cargo xtask bundle --base REV`) against this tree's, run alternately in one job.
Reads $OUT/ab-base-N.json and $OUT/ab-new-N.json; prints each case's median on
both sides, the change, and every run's time, as a markdown table.

    ab_summary.py OUT_DIR
"""
import glob
import json
import statistics
import sys


def runs(out, side):
    times = {}
    for path in sorted(glob.glob(f"{out}/ab-{side}-*.json")):
        with open(path) as f:
            for name, case in json.load(f).items():
                if isinstance(case, dict) and case.get("ms", 0) > 0:
                    times.setdefault(name, []).append(case["ms"])
    return times


def main():
    out = sys.argv[1]
    base, new = runs(out, "base"), runs(out, "new")
    print("| case | base (ms) | new (ms) | change | base runs | new runs |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for name in new:
        b, n = base.get(name), new[name]
        nm = statistics.median(n)
        every = lambda ts: " ".join(f"{t:.4f}" for t in ts)
        if not b:
            print(f"| {name} | — | {nm:.4f} | — | — | {every(n)} |")
            continue
        bm = statistics.median(b)
        print(f"| {name} | {bm:.4f} | {nm:.4f} | {100 * (nm - bm) / bm:+.1f}% | {every(b)} | {every(n)} |")


if __name__ == "__main__":
    main()
