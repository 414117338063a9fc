#!/usr/bin/env python3
"""PyTorch's device-to-device copy at the plain RMSNorm's size (16384×4096 bf16 read
and written: 268 MB moved), and its sum of bf16 arrays of the decode sizes (read
once: 268, 352 and 1074 MB), timed like torch_reference.py (one call between CUDA
events, median of 30): the figures kernels moving those bytes are measured against.
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

if args.json:
    merged = json.load(open(args.json)) if os.path.exists(args.json) else {}
    merged.update(ref.RESULTS)
    json.dump(merged, open(args.json, "w"), indent=1)
