#!/usr/bin/env python3
"""Per-kernel durations of one decode step's graph, from `ncu --graph-profiling node --csv
--metrics gpu__time_duration.sum` over `generate`: the last step (from the last launch of
the first node's kernel, the embedding) summed by kernel name. Set beside the step's time
by CUDA events, the difference is what the graph spends between kernels.
Usage: graph_nodes.py NCU_CSV [FIRST_KERNEL_SUBSTRING]"""
import csv
import sys
from collections import OrderedDict

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main():
    path = sys.argv[1]
    first = sys.argv[2] if len(sys.argv) > 2 else "embedding"
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    launches = {}
    for r in csv.DictReader(lines):
        if not r.get("Metric Name", "").startswith("gpu__time_duration"):
            continue
        try:
            us = float(r["Metric Value"].replace(",", "")) * SCALE.get(r.get("Metric Unit", ""), 1.0)
            launches[int(r["ID"])] = (r.get("Kernel Name", "?"), us)
        except (KeyError, ValueError):
            continue
    seq = [launches[k] for k in sorted(launches)]
    starts = [i for i, (name, _) in enumerate(seq) if first in name]
    if len(starts) < 2:
        sys.exit(f"graph_nodes: fewer than two launches of a kernel named *{first}* in {path}")
    # The last complete step: between the last two starts.
    step = seq[starts[-2]:starts[-1]]
    by_name = OrderedDict()
    for name, us in step:
        n, t = by_name.get(name, (0, 0.0))
        by_name[name] = (n + 1, t + us)
    total = sum(us for _, us in step)
    print(f"one decode step's kernel nodes ({len(step)}), durations by ncu (each node alone):")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name[:60]:60} {n:4} nodes {t:9.1f} us ({100 * t / total:4.1f}%)")
    print(f"  {'sum':60} {len(step):4} nodes {total:9.1f} us")


if __name__ == "__main__":
    main()
