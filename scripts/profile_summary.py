#!/usr/bin/env python3
"""Summarizes `ncu --csv` output of one perf case (CALLS calls: 5 warm-up + 30
timed): per launch position within a call, the kernel, its grid, launches,
median duration (µs) and median DRAM throughput (% of peak), so e.g. a GEMM's
gate/up and down launches show apart. Launches before the last CALLS × period
are setup and dropped.
Usage: profile_summary.py NCU_CSV [TITLE]"""
import csv
import statistics
import sys
from collections import defaultdict

CALLS = 35
SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def main():
    path = sys.argv[1]
    title = sys.argv[2] if len(sys.argv) > 2 else path
    launches = {}  # ID -> {"name", "grid", metrics}
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        try:
            lid = int(r["ID"])
            value = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        entry = launches.setdefault(lid, {"name": r.get("Kernel Name", "?"), "grid": r.get("Grid Size", "?"), "m": {}})
        unit = r.get("Metric Unit", "")
        entry["m"][r["Metric Name"]] = value * SCALE.get(unit, 1.0) if r["Metric Name"].startswith("gpu__time") else value
    seq = [launches[k] for k in sorted(launches)]
    # Setup launches (before the timed calls) are dropped from the front.
    period = len(seq) // CALLS
    seq = seq[len(seq) - period * CALLS:]
    groups = defaultdict(list)
    order = []
    for i, e in enumerate(seq):
        key = (i % period, e["name"], e["grid"])
        if key not in groups:
            order.append(key)
        groups[key].append(e["m"])
    print(f"### {title}")
    print("| # | kernel | grid | launches | median duration (µs) | DRAM % of peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    total = 0.0
    for key in order:
        ms = groups[key]
        us = [m["gpu__time_duration.sum"] for m in ms if "gpu__time_duration.sum" in m]
        dram = [m[k] for m in ms for k in m if k.startswith("dram__throughput")]
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        total += med(us) if us else 0.0
        print(f"| {key[0]} | {key[1][:48]} | {key[2]} | {len(us)} | {med(us):.2f} | {med(dram):.1f} |")
    if period:
        print(f"| | sum per call | | | {total:.2f} | |")


if __name__ == "__main__":
    main()
