#!/usr/bin/env python3
"""PyTorch's device-to-device copy at the plain RMSNorm's size (16384×4096 bf16 read
and written: 268 MB moved), and its sum of bf16 arrays of the decode sizes (read
once: 268, 352 and 1074 MB; 16.8 MB and 8 elements for decode b1 L4096's floors),
timed like torch_reference.py (one call between CUDA events, median of 30): the
figures kernels moving those bytes are measured against.
Rows are merged into the JSON given with --json."""
import argparse, json, os

import torch

import torch_reference as ref

ap = argparse.ArgumentParser()
ap.add_argument("--json")
args = ap.parse_args()

a = torch.randn(16384, 4096, device=ref.DEV, dtype=ref.BF16)
b = torch.empty_like(a)
ref.report("copy bf16 16384x4096 d2d", ref.bench(lambda: b.copy_(a)), nbytes=2 * a.numel() * 2)
del a, b

for nbytes, name in [
    (268435456, "read bf16 268MB (decode b16 KV)"),
    (3 * 4096 * 14336 * 2, "read bf16 352MB (MLP weights)"),
    (1073741824, "read bf16 1074MB (decode b64 KV)"),
]:
    x = torch.full((nbytes // 2,), 1.5, device=ref.DEV, dtype=ref.BF16)
    ref.report(name, ref.bench(lambda: x.sum(dtype=torch.float32)), nbytes=x.numel() * 2)
    del x

# The floors of decode b1 L4096's one call (perf's `decode floor` rows): a sum of 8
# elements (the launch itself) and of 16.8 MB (its KV bytes, re-read as the decode
# row re-reads its cache), each as a plain call and as a CUDA-graph replay.
for elems, what in [(8, "launch, 1 block"), (2 * 8 * 4096 * 128, "read 16.8 MB")]:
    x = torch.full((elems,), 1.5, device=ref.DEV, dtype=ref.BF16)
    name = f"decode floor b1 L4096: {what}"
    ref.report(name, ref.bench(lambda: x.sum(dtype=torch.float32)), nbytes=elems * 2)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.sum(dtype=torch.float32)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        x.sum(dtype=torch.float32)
    ref.report(name + " [graph]", ref.bench(graph.replay), nbytes=elems * 2)
    del x, graph

if args.json:
    merged = json.load(open(args.json)) if os.path.exists(args.json) else {}
    merged.update(ref.RESULTS)
    json.dump(merged, open(args.json, "w"), indent=1)
