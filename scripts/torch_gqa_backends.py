#!/usr/bin/env python3
"""The reference layer's GQA prefill (32 query heads over 8 KV heads, head dim 128,
causal) on PyTorch's `flash` (FlashAttention-2) and `cudnn` SDPA backends, named.

`torch_reference.py attn` times these shapes with SDPA's default backend only, so
its figure cannot stand for FlashAttention-2. Same timing (torch_reference.bench)
and FLOP count; the rows are merged into the JSON given with --json.
"""
import argparse, json, os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_reference as ref

ap = argparse.ArgumentParser()
ap.add_argument("--json")
args = ap.parse_args()

for s in (2048, 8192):
    q = torch.randn(1, ref.N_HEADS, s, ref.HEAD_DIM, device=ref.DEV, dtype=ref.BF16)
    k = torch.randn(1, ref.N_KV_HEADS, s, ref.HEAD_DIM, device=ref.DEV, dtype=ref.BF16)
    v = torch.randn_like(k)
    # Expanded K/V for backends that reject enable_gqa; the expansion is not timed.
    rep = ref.N_HEADS // ref.N_KV_HEADS
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    flops = 2 * ref.N_HEADS * s * s * ref.HEAD_DIM
    for backend, tag in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
        name = f"attn {tag} gqa32/8 hd128 s{s} causal1"
        try:
            with sdpa_kernel(backend):
                ms = ref.bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            ref.report(name, ms, flops=flops)
        except RuntimeError:
            try:
                with sdpa_kernel(backend):
                    ms = ref.bench(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
                ref.report(name + " (K/V expanded)", ms, flops=flops)
                ref.RESULTS[name] = ref.RESULTS[name + " (K/V expanded)"]
            except RuntimeError as err:
                print(f"{name}: unavailable ({str(err).splitlines()[0]})")

if args.json:
    merged = json.load(open(args.json)) if os.path.exists(args.json) else {}
    merged.update(ref.RESULTS)
    json.dump(merged, open(args.json, "w"), indent=1)
