#!/usr/bin/env python3
"""Joins our figures with PyTorch's from the same run into the per-op tables of
docs/PERF.md.

Usage:
  compare.py OURS.json [TORCH.json] [--commit C] [--date D] [--gpu G]
             [--markdown docs/PERF.md] [--versions] [--copy-gbs N] [--gemm-tflops N]

OURS.json is `examples/perf --json`'s output and TORCH.json `torch_reference.py
--json`'s (plus `torch_gqa_backends.py` and `torch_copy_sizes.py`, which merge into
it); both map a case name to {"ms", "gbs", "tflops"}, and the names join. Without
--markdown the tables are printed. With it, each op's table in that file (between
`<!-- compare.py: OP -->` and `<!-- end -->`) gets this run's rows: a case this run
measured replaces its row, the other rows stay, so every row keeps the commit and
date it was measured at. A file or op section that does not exist yet is created.

Rows: every case of OURS.json, except kernel versions (a bracket tag other than a
measuring condition such as [graph] or [cold]) unless --versions. Columns: our
figure, PyTorch's figure from the same run (— if it did not time the case), ratio
= PyTorch's time / ours (above 1: ours is faster), our share of the ceiling (the
device copy for memory-bound ops, the bf16 GEMM ceiling for compute-bound ones).
"""
import argparse
import datetime
import json
import os
import re
import sys

# (op, title, kind, name prefixes). The first op with a matching prefix takes a case
# (`decode floor` rows belong to the ceilings).
# kind: "memory" shows GB/s (µs below LATENCY_BYTES), "compute" TFLOP/s, "time" ms.
OPS = [
    ("softmax", "Softmax", "memory", ("softmax",)),
    ("rmsnorm", "RMSNorm and add+RMSNorm", "memory", ("rmsnorm", "add+rmsnorm")),
    ("attn", "FlashAttention forward", "compute", ("attn",)),
    ("gemm", "GEMM", "compute", ("gemm",)),
    ("mlp", "SwiGLU MLP", "time", ("swiglu", "mlp")),
    ("decode", "Decode attention", "memory", ("decode",)),
    ("layer", "Decoder layer", "time", ("layer",)),
    ("ceilings", "Memory ceilings and floors", "memory", ("copy", "read", "decode floor")),
]
# Bracket tags that say how a case was measured rather than which kernel version ran.
CONDITIONS = {"graph", "cold", "cold, graph", "page16", "contiguous", "spec"}
# A memory-bound case moving fewer bytes than this is latency-bound: shown in µs.
LATENCY_BYTES = 64e6
HEADER = "| case | ours | PyTorch | ratio | % of ceiling | commit | date | GPU |"
RULE = "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |"
DASH = "—"


def op_of(name):
    for op, _, kind, prefixes in OPS:
        if name.startswith(prefixes) and not (op == "decode" and name.startswith("decode floor")):
            return op, kind
    return "other", "memory"


def is_version(name):
    return any(tag not in CONDITIONS for tag in re.findall(r"\[([^\]]*)\]", name))


def torch_for(name, torch):
    """PyTorch's figure(s) for our case: the same name, or for attention the `flash`
    (FlashAttention-2) and `cudnn` backends, or for the layer its fastest form
    (torch.compile for prefill, a CUDA graph for decode)."""
    if name.startswith("attn"):
        rest = name.replace("attn ours ", "").split(" [")[0]
        return [torch.get("attn flash " + rest) or torch.get("attn " + rest), torch.get("attn cudnn " + rest)]
    if name.startswith("layer "):
        phase, shape = name[len("layer "):].split(" [")[0].split(" ", 1)
        form = "torch.compile" if phase == "prefill" else "cuda-graph"
        return [torch.get(f"layer {phase} {form} {shape}")]
    return [torch.get(name)]


def unit_of(o, kind):
    """Our figure in the op's unit, and the unit (PyTorch's figure takes the same)."""
    if kind == "compute":
        return "tflops"
    if kind == "time":
        return "ms"
    return "us" if o["gbs"] * o["ms"] * 1e6 < LATENCY_BYTES else "gbs"


def number(o, unit):
    if unit == "tflops":
        return f"{o['tflops']:.1f}"
    if unit == "ms":
        return f"{o['ms']:.4f}"
    if unit == "us":
        return f"{o['ms'] * 1e3:.1f}"
    return f"{o['gbs']:.0f}"


UNITS = {"tflops": "TFLOP/s", "ms": "ms", "us": "µs", "gbs": "GB/s"}


def ceiling(o, kind, args):
    """Our share of the ceiling that bounds the op (for `time` ops, the larger share)."""
    mem, comp = (o["gbs"] / args.copy_gbs, "copy"), (o["tflops"] / args.gemm_tflops, "GEMM")
    share, what = mem if kind == "memory" else comp if kind == "compute" else max(mem, comp)
    return f"{100 * share:.0f}% {what}" if share >= 0.005 else DASH


def row(name, o, torch, kind, args):
    unit = unit_of(o, kind)
    theirs = torch_for(name, torch)
    if any(theirs):
        pytorch = " / ".join(number(t, unit) if t else DASH for t in theirs) + " " + UNITS[unit]
        ratio = " / ".join(f"{t['ms'] / o['ms']:.2f}×" if t else DASH for t in theirs)
    else:
        pytorch = ratio = DASH
    ours = number(o, unit) + " " + UNITS[unit]
    cells = [name, ours, pytorch, ratio, ceiling(o, kind, args), args.commit, args.date, args.gpu]
    return "| " + " | ".join(cells) + " |"


def tables(ours, torch, args):
    """{op: [(case, row)]}, ops in OPS' order, cases in OURS.json's."""
    out = {op: [] for op, _, _, _ in OPS}
    for name, o in ours.items():
        if is_version(name) and not args.versions:
            continue
        op, kind = op_of(name)
        out.setdefault(op, []).append((name, row(name, o, torch, kind, args)))
    return {op: rows for op, rows in out.items() if rows}


def block(op, rows):
    return [f"<!-- compare.py: {op} -->", HEADER, RULE] + rows + ["<!-- end -->"]


def title(op):
    return next((t for o, t, _, _ in OPS if o == op), "Other cases")


def merge(path, new):
    """Writes `new`'s rows into the op blocks of the markdown file at `path`."""
    lines = open(path).read().splitlines() if os.path.exists(path) else ["# Performance record"]
    for op, fresh in new.items():
        start = next((i for i, l in enumerate(lines) if l.strip() == f"<!-- compare.py: {op} -->"), None)
        if start is None:
            while lines and not lines[-1].strip():
                lines.pop()
            lines += ["", f"## {title(op)}", ""] + block(op, [r for _, r in fresh])
            continue
        end = next(i for i in range(start, len(lines)) if lines[i].strip() == "<!-- end -->")
        old = [l for l in lines[start + 1:end] if l.startswith("| ") and l not in (HEADER, RULE)]
        keyed = {l[2:].split(" | ", 1)[0]: l for l in old}
        order = list(keyed)
        for name, r in fresh:
            if name not in keyed:
                order.append(name)
            keyed[name] = r
        lines[start:end + 1] = block(op, [keyed[n] for n in order])
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours")
    ap.add_argument("torch", nargs="?")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    ap.add_argument("--gpu", default="unknown")
    ap.add_argument("--markdown", help="update this file's tables instead of printing")
    ap.add_argument("--versions", action="store_true", help="keep kernel-version rows ([V1], [SkinnyK128Fill], …)")
    ap.add_argument("--copy-gbs", type=float, default=4200.0, help="memory ceiling (device copy), GB/s")
    ap.add_argument("--gemm-tflops", type=float, default=750.0, help="compute ceiling (bf16 GEMM), TFLOP/s")
    args = ap.parse_args()
    args.gpu = args.gpu.removeprefix("NVIDIA ") or "unknown"

    ours = json.load(open(args.ours))
    torch = json.load(open(args.torch)) if args.torch and os.path.exists(args.torch) else {}
    new = tables(ours, torch, args)
    if args.markdown:
        merge(args.markdown, new)
        print(f"{args.markdown}: {sum(len(r) for r in new.values())} rows from {args.ours} ({args.commit}, {args.date})")
        return
    for op, rows in new.items():
        print(f"\n## {title(op)}\n")
        print("\n".join([HEADER, RULE] + [r for _, r in rows]))


if __name__ == "__main__":
    sys.exit(main())
