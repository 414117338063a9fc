#!/usr/bin/env python3
"""Joins our figures with PyTorch's from the same run and prints the PERF.md tables:
memory-bound cases (GB/s, % of the copy roofline measured in the same run) and
compute-bound cases (TFLOP/s; attention against the flash and cuDNN backends)."""
import json, os, sys

ours_all = json.load(open(sys.argv[1]))
# The fused layer has its own table (PyTorch eager, torch.compile and CUDA graphs).
ours = {n: o for n, o in ours_all.items() if not n.startswith("layer ")}
layer = {n: o for n, o in ours_all.items() if n.startswith("layer ")}
torch = json.load(open(sys.argv[2])) if len(sys.argv) > 2 and os.path.exists(sys.argv[2]) else {}
GEMM_PEAK = 750.0  # TFLOP/s, bf16 GEMM ceiling measured through PyTorch on the H200
copy = ours.get("copy f32 2GiB d2d", {}).get("gbs") or torch.get("copy f32 2GiB d2d", {}).get("gbs")

mem = [(n, o) for n, o in ours.items() if o["gbs"] > 0 and o["tflops"] == 0 and not n.startswith("copy")]
if mem:
    print(f"copy roofline (ours, same run): {copy:.0f} GB/s" if copy else "no copy figure")
    print("| case | ours ms | ours GB/s | PyTorch ms | PyTorch GB/s | speedup | % of copy |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, o in mem:
        t = torch.get(name)
        pct = f"{100 * o['gbs'] / copy:.0f}%" if copy else "-"
        if t:
            print(f"| {name} | {o['ms']:.4f} | {o['gbs']:.0f} | {t['ms']:.4f} | {t['gbs']:.0f} | {t['ms'] / o['ms']:.2f}x | {pct} |")
        else:
            print(f"| {name} | {o['ms']:.4f} | {o['gbs']:.0f} | - | - | - | {pct} |")

comp = [(n, o) for n, o in ours.items() if o["tflops"] > 0 and o["gbs"] == 0]
both = [(n, o) for n, o in ours.items() if o["tflops"] > 0 and o["gbs"] > 0]
if comp:
    print()
    print("| case | ours ms | ours TFLOP/s | flash TFLOP/s | ours/flash | cudnn TFLOP/s | ours/cudnn | % of 750 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, o in [(n, o) for n, o in comp if n.startswith("attn")]:
        # Version rows ("… [V1]") compare with the same shape's PyTorch figures.
        rest = name.replace("attn ours ", "").split(" [")[0]
        flash = torch.get("attn flash " + rest) or torch.get("attn " + rest)
        cudnn = torch.get("attn cudnn " + rest)
        cell = lambda t: (f"{t['tflops']:.1f}", f"{o['tflops'] / t['tflops']:.2f}x") if t else ("-", "-")
        (ft, fr), (ct, cr) = cell(flash), cell(cudnn)
        print(f"| {name} | {o['ms']:.4f} | {o['tflops']:.1f} | {ft} | {fr} | {ct} | {cr} | {100 * o['tflops'] / GEMM_PEAK:.0f}% |")

gemm = [(n, o) for n, o in comp if not n.startswith("attn")]
if gemm or both:
    print()
    print("| case | ours ms | ours TFLOP/s | ours GB/s | PyTorch ms | PyTorch TFLOP/s | ours/PyTorch (time) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, o in gemm + both:
        t = torch.get(name)
        tt = (f"{t['ms']:.4f}", f"{t['tflops']:.1f}", f"{t['ms'] / o['ms']:.2f}x") if t else ("-", "-", "-")
        print(f"| {name} | {o['ms']:.4f} | {o['tflops']:.1f} | {o['gbs']:.0f} | {tt[0]} | {tt[1]} | {tt[2]} |")

if layer:
    print()
    print("| case | ours ms | ours TFLOP/s or GB/s | PyTorch eager ms | compiled / graph ms | ours vs eager | ours vs compiled / graph |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, o in layer.items():
        rest = name[len("layer "):].split(" [")[0]
        phase, shape = rest.split(" ", 1)
        eager = torch.get(f"layer {phase} eager {shape}")
        fast = torch.get(f"layer {phase} {'torch.compile' if phase == 'prefill' else 'cuda-graph'} {shape}")
        rate = f"{o['tflops']:.1f} TFLOP/s" if o["tflops"] > 0 else f"{o['gbs']:.0f} GB/s"
        cell = lambda t: (f"{t['ms']:.4f}", f"{t['ms'] / o['ms']:.2f}x") if t else ("-", "-")
        (em, er), (fm, fr) = cell(eager), cell(fast)
        print(f"| {name} | {o['ms']:.4f} | {rate} | {em} | {fm} | {er} | {fr} |")