#!/usr/bin/env python3
"""Merges repeated runs of one side (perf's or torch_reference.py's JSON) into one
JSON of per-case medians, and prints each case's spread across the repeats.

    repeats.py --out ours.json ours-1.json ours-2.json ours-3.json

The median is taken of the time; the rate fields are recomputed from it, so a
merged case reads as one run of the median time. Cases missing from a repeat
are merged over the repeats that have them.
"""
import argparse
import json
import statistics


def merge(runs):
    merged, spread = {}, {}
    names = []
    for run in runs:
        names.extend(n for n in run if n not in names)
    for name in names:
        cases = [run[name] for run in runs if name in run and run[name].get("ms", 0) > 0]
        if not cases:
            continue
        times = sorted(c["ms"] for c in cases)
        ms = statistics.median(times)
        # The repeat nearest the median gives the rates' scale (work per call is fixed).
        ref = min(cases, key=lambda c: abs(c["ms"] - ms))
        out = dict(ref)
        for key in ("tflops", "gbs"):
            if ref.get(key):
                out[key] = ref[key] * ref["ms"] / ms
        out["ms"] = ms
        merged[name] = out
        spread[name] = (times[0], ms, times[-1], len(times))
    return merged, spread


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    runs = []
    for path in a.runs:
        with open(path) as f:
            runs.append(json.load(f))
    merged, spread = merge(runs)
    with open(a.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"| case ({a.out}) | min ms | median ms | max ms | spread | repeats |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (lo, mid, hi, n) in spread.items():
        print(f"| {name} | {lo:.4f} | {mid:.4f} | {hi:.4f} | {100 * (hi - lo) / mid:.1f}% | {n} |")


if __name__ == "__main__":
    main()
