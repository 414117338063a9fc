#!/usr/bin/env python3
"""Summarizes `ncu --csv` output: per kernel, launches, median duration (µs) and
median DRAM throughput (% of peak). Usage: profile_summary.py NCU_CSV [TITLE]"""
import csv
import statistics
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    title = sys.argv[2] if len(sys.argv) > 2 else path
    rows = defaultdict(lambda: defaultdict(list))
    order = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        name = r.get("Kernel Name", "?")
        if name not in rows:
            order.append(name)
        try:
            rows[name][r["Metric Name"]].append((r["Metric Unit"], float(r["Metric Value"].replace(",", ""))))
        except (KeyError, ValueError):
            pass
    print(f"### {title}")
    print("| kernel | launches | median duration (µs) | DRAM % of peak |")
    print("| --- | --- | --- | --- |")
    for name in order:
        m = rows[name]
        dur = m.get("gpu__time_duration.sum", [])
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
        us = [v * scale.get(u, 1e-3) for u, v in dur]
        dram = [v for _, v in m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", [])]
        med = lambda xs: f"{statistics.median(xs):.2f}" if xs else "-"
        print(f"| {name[:60]} | {len(us)} | {med(us)} | {med(dram)} |")


if __name__ == "__main__":
    main()
