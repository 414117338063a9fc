#!/usr/bin/env python3
"""transformers' side of the whole-model check of `host::model::Model`.

  model_reference.py make OUTDIR [--device cuda|cpu]
  model_reference.py compare OUTDIR
  model_reference.py tokenizer OUTDIR/CASE

`make` writes, for each case of CASES, a random bf16 Llama checkpoint as
`save_pretrained` writes it (OUTDIR/CASE/config.json, generation_config.json,
model.safetensors; no lm_head.weight when tied) and OUTDIR/CASE/reference.json:
  config               the case's LlamaConfig arguments
  prompt               the prompt's token ids
  prefill_logits_bf16  [prompt_len][vocab]: logits of every prompt position, bf16 run
  prefill_logits_fp32  [prompt_len][vocab]: the same, the checkpoint upcast to fp32
  greedy               [64] greedy tokens (bf16 run: prefill, then one token at a time
                       through the KV cache); greedy[0] is the argmax of the prompt's
                       last position
  margins              [64] top-1 minus top-2 logit of the step that chose each token
  decode_logits_fp32   [64][vocab]: the fp32 run's logits for each greedy step, fed the
                       prompt and the bf16 run's tokens (one forward of prompt + greedy[:63])
The weights and prompts are seeded on the CPU, so every machine makes the same files.
The references are read back from the saved files with `from_pretrained`, so they
are of exactly the weights the Rust side loads; attention is "eager" (the literal
softmax(QK^T/sqrt(d) + mask) V), fp32 matmuls at full precision (no TF32); greedy
takes the first of tied maxima.

`compare` reads OUTDIR/CASE/ours.json, written by our side:
  {"prefill_logits": [[f32; vocab]; prompt_len], "greedy": [u32; 64],
   "decode_logits": [[f32; vocab]; 64]}
where greedy is our own greedy run and the optional decode_logits come from a second,
teacher-forced run: prefill the prompt, then decode reference.json's greedy[0..63] one
token at a time through the KV cache; row 0 is the prefill's last position, row i the
logits after feeding greedy[i-1]. A free greedy run agrees with transformers' only up
to the first near-tie (often within a few steps for random weights), so these rows are
what checks the decode path over all 64 steps. Our side reads the prompt (and the
forced tokens) from reference.json and the checkpoint from OUTDIR/CASE.

`compare` prints one JSON line per case. A case FAILs, and the exit status is 1, when
  - prefill: rel_l2(ours, hf_fp32) > 2 * rel_l2(hf_bf16, hf_fp32) + 1e-2, where
    rel_l2(a, b) = ||a - b|| / ||b|| over all positions and the vocabulary; or
  - decode (where ours.json has decode_logits): the same rule over the 64 rows,
    against decode_logits_fp32; or
  - greedy: the first step at which our token differs from transformers' bf16 run
    has a margin above tol = 3 * max|hf_bf16 - hf_fp32| over the prefill logits
    (a near-tie that bf16 rounding alone can flip passes; the steps after the first
    difference are not compared, since the two runs no longer see the same tokens);
  - or ours.json is missing or has the wrong shape.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 64
# name: (seed, prompt length, LlamaConfig arguments)
CASES = {
    "gqa_tied": (1, 37, dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=688, vocab_size=1000, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True)),
    "mha_untied": (2, 1, dict(
        hidden_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
        intermediate_size=1376, vocab_size=1537, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False)),
    # original_max_position_embeddings 64: the llama3 scaling changes every frequency
    # whose wavelength exceeds 16 positions, which the 129 + 64 positions cover.
    "gqa_llama31": (3, 129, dict(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, vocab_size=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False)),
}
COMMON = dict(rms_norm_eps=1e-5, max_position_embeddings=2048, hidden_act="silu", bos_token_id=1, eos_token_id=2)


def init_weights(model, hidden):
    """Variance-preserving projections (std 1/sqrt(fan_in)), so every layer moves
    the residual stream as much as the embedding does; norm weights 1 + 0.1 N(0, 1),
    so a norm that drops or misplaces its weight shows; embeddings and lm_head of std
    4/sqrt(hidden), so logits spread over a few units. Seeded on the CPU."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is embed_tokens, listed once
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            elif "embed_tokens" in name or name.startswith("lm_head"):
                p.copy_(torch.randn(p.shape) * (4 / math.sqrt(hidden)))
            else:
                p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[1]))


def make(outdir, device):
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the fp32 run
    for case, (seed, prompt_len, args) in CASES.items():
        d = Path(outdir) / case
        torch.manual_seed(seed)
        config = LlamaConfig(**COMMON, **args)
        model = LlamaForCausalLM(config)
        init_weights(model, config.hidden_size)
        model.to(torch.bfloat16).save_pretrained(d)  # safetensors; v5 has no other format
        if not (d / "generation_config.json").exists():
            GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(d)
        prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))

        def load(dtype):
            m = LlamaForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager")
            return m.to(device).eval()

        with torch.inference_mode():
            m = load(torch.bfloat16)
            ids = prompt.to(device)
            out = m(ids, use_cache=True)
            prefill_bf16 = out.logits[0].float().cpu()
            cache, last, greedy, margins = out.past_key_values, out.logits[0, -1].float(), [], []
            for step in range(STEPS):
                top = last.topk(2).values
                greedy.append(int(last.argmax()))  # the first of tied maxima
                margins.append(float(top[0] - top[1]))
                if step + 1 < STEPS:
                    nxt = torch.tensor([[greedy[-1]]], device=device)
                    out = m(nxt, past_key_values=cache, use_cache=True)
                    cache, last = out.past_key_values, out.logits[0, -1].float()
            del m
            m = load(torch.float32)
            prefill_fp32 = m(ids).logits[0].float().cpu()
            fed = torch.cat([ids, torch.tensor([greedy[:-1]], device=device)], dim=1)
            decode_fp32 = m(fed).logits[0, prompt_len - 1:].float().cpu()

        ref = {
            "case": case, "transformers": transformers.__version__, "torch": torch.__version__,
            "device": str(device), "attn_implementation": "eager",
            "config": {**COMMON, **args}, "prompt": prompt[0].tolist(),
            "prefill_logits_bf16": prefill_bf16.tolist(), "prefill_logits_fp32": prefill_fp32.tolist(),
            "greedy": greedy, "margins": margins, "decode_logits_fp32": decode_fp32.tolist(),
        }
        (d / "reference.json").write_text(json.dumps(ref))
        print(f"{case}: prompt {prompt_len}, greedy {greedy[:8]}..., min margin {min(margins):.4f} -> {d}")


def compare(outdir):
    import torch

    def rel_l2(a, b):
        return float((a - b).norm() / b.norm())

    def logits(rows, name, shape):
        t = torch.tensor(rows, dtype=torch.float64)
        if t.shape != shape:
            raise ValueError(f"{name} is {list(t.shape)}, want {list(shape)}")
        return t

    failed = False
    for case in CASES:
        d = Path(outdir) / case
        ref = json.loads((d / "reference.json").read_text())
        bf16 = torch.tensor(ref["prefill_logits_bf16"], dtype=torch.float64)
        fp32 = torch.tensor(ref["prefill_logits_fp32"], dtype=torch.float64)
        hf_greedy, margins = ref["greedy"], ref["margins"]
        floor_abs, floor_rel = float((bf16 - fp32).abs().max()), rel_l2(bf16, fp32)
        tol, limit = 3 * floor_abs, 2 * floor_rel + 1e-2
        line = {"case": case, "hf_bf16_vs_fp32": {"max_abs": floor_abs, "rel_l2": floor_rel},
                "rel_l2_limit": limit, "rel_l2_rule": "2 * hf_bf16_vs_fp32.rel_l2 + 1e-2"}
        try:
            mine = json.loads((d / "ours.json").read_text())
            ours = logits(mine["prefill_logits"], "prefill_logits", fp32.shape)
            our_greedy = [int(t) for t in mine["greedy"]]
            if len(our_greedy) != STEPS:
                raise ValueError(f"greedy has {len(our_greedy)} tokens, want {STEPS}")
            decode_ref = torch.tensor(ref["decode_logits_fp32"], dtype=torch.float64)
            decode = mine.get("decode_logits")
            decode = None if decode is None else logits(decode, "decode_logits", decode_ref.shape)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(json.dumps({**line, "result": "FAIL: ours.json", "error": str(e)}))
            failed = True
            continue
        reasons = []
        for name, r in (("vs_hf_bf16", bf16), ("vs_hf_fp32", fp32)):
            agree = ours.argmax(1) == r.argmax(1)
            line[name] = {"max_abs": float((ours - r).abs().max()), "rel_l2": rel_l2(ours, r),
                          "argmax_agree": f"{int(agree.sum())}/{len(agree)}",
                          "argmax_differs_at": agree.logical_not().nonzero().flatten().tolist()}
        if not line["vs_hf_fp32"]["rel_l2"] <= limit:  # NaN fails too
            reasons.append("prefill")
        first = next((i for i, (a, b) in enumerate(zip(our_greedy, hf_greedy)) if a != b), None)
        greedy = {"first_difference": first, "tolerance": tol, "tolerance_rule": "3 * hf_bf16_vs_fp32.max_abs"}
        if first is not None:
            greedy.update(ours=our_greedy[first], hf=hf_greedy[first], hf_margin=margins[first])
            if margins[first] > tol:
                reasons.append("greedy")
        line["greedy"] = greedy
        if decode is not None:
            agree = decode.argmax(1) == decode_ref.argmax(1)
            line["decode_vs_hf_fp32"] = {"max_abs": float((decode - decode_ref).abs().max()),
                                         "rel_l2": rel_l2(decode, decode_ref),
                                         "argmax_agree": f"{int(agree.sum())}/{len(agree)}"}
            if not line["decode_vs_hf_fp32"]["rel_l2"] <= limit:
                reasons.append("decode")
        line["result"] = "FAIL: " + ", ".join(reasons) if reasons else "PASS"
        failed |= bool(reasons)
        print(json.dumps(line))
    return 1 if failed else 0


def tokenizer(case_dir, vocab_size):
    """Writes a byte-level BPE tokenizer.json of at most `vocab_size` tokens,
    trained on a fixed text, into a case folder: the checkpoint then runs through
    `generate`'s whole text path (its weights are random, so is the text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    text = ("Memory bandwidth bounds decoding: every weight is read once per step. "
            "Prefill is bound by arithmetic on the tensor cores. ") * 20
    tok.train_from_iterator([text], trainer)
    tok.save(str(Path(case_dir) / "tokenizer.json"))
    print(f"{case_dir}: tokenizer.json with {tok.get_vocab_size()} tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the checkpoints and reference.json")
    mk.add_argument("outdir")
    mk.add_argument("--device", default="cuda")
    cp = sub.add_parser("compare", help="check each case's ours.json against reference.json")
    cp.add_argument("outdir")
    tk = sub.add_parser("tokenizer", help="add a trained byte-level BPE tokenizer.json to a case folder")
    tk.add_argument("case_dir")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.outdir, a.device)
        return 0
    if a.cmd == "tokenizer":
        cfg = json.loads((Path(a.case_dir) / "config.json").read_text())
        tokenizer(a.case_dir, min(cfg["vocab_size"], 512))
        return 0
    return compare(a.outdir)


if __name__ == "__main__":
    sys.exit(main())
