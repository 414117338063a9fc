#!/usr/bin/env python3
"""Joins our figures with PyTorch's from the same run (same case names) and prints
the PERF.md table: ours, PyTorch, speedup, and % of the copy roofline."""
import json, os, sys

ours = json.load(open(sys.argv[1]))
torch = json.load(open(sys.argv[2])) if len(sys.argv) > 2 and os.path.exists(sys.argv[2]) else {}
copy = ours.get("copy f32 2GiB d2d", {}).get("gbs") or torch.get("copy f32 2GiB d2d", {}).get("gbs")

print(f"copy roofline (ours, same run): {copy:.0f} GB/s" if copy else "no copy figure")
print("| case | ours ms | ours GB/s | PyTorch ms | PyTorch GB/s | speedup | % of copy |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for name, o in ours.items():
    if name.startswith("copy"):
        continue
    t = torch.get(name)
    pct = f"{100 * o['gbs'] / copy:.0f}%" if copy else "-"
    if t:
        print(f"| {name} | {o['ms']:.4f} | {o['gbs']:.0f} | {t['ms']:.4f} | {t['gbs']:.0f} | {t['ms'] / o['ms']:.2f}x | {pct} |")
    else:
        print(f"| {name} | {o['ms']:.4f} | {o['gbs']:.0f} | - | - | - | {pct} |")
