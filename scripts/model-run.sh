#!/usr/bin/env bash
# Whole-model runs on the GPU machine, from the folder `cargo xtask bundle` made:
#   check     transformers' LlamaForCausalLM against Model (model_reference.py make/compare)
#   generate  the seeded Llama-3-8B-sized model: b1 (also --wait-each-step, and speculative by
#             prompt lookup) and b64 decode at
#             context 4096 (a prompt copy per sequence, then forked), with the per-stage ledger, and a
#             2048-token prompt's time to first token
#             (whole, and in 512-token chunks)
#   serve     serve-bench at 8B size (continuous batching; again with --mixed, with --mixed --chunked
#             in 512-token steps, and so with a 1024-token system prompt shared by fork), then the soak: 100,000 decode
#             steps of a 2-layer model of the same width (SOAK_ARGS to change)
#   serve-ab  serve-bench as built at the bundle's base revision (`cargo xtask bundle --base REV`)
#             and as built here, alternately, SERVE_AB_REPEATS times each (default 2) on the same
#             traffic (SERVE_AB_ARGS; default chunked and mixed, 64 requests): a serving change
#             against its base in one job
#   torch     torch_model_decode.py (compiled) and torch_reference.py's layer group
#   profile   ncu over the b1 ctx 4096 graph step, node by node (graph_nodes.py): each kernel's
#             duration; set beside the step's time, what the graph spends between kernels
# MODEL_STEPS picks them (default: check generate). Logs go to $OUT (default ./out).
set -u
cd "$(dirname "$0")"
. ./pack_out.sh
OUT=${OUT:-$PWD/out}
MODEL_STEPS=${MODEL_STEPS:-check generate}
W=${WORK:-/tmp/model-run}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
status=0
summary=()
has() { [[ " $MODEL_STEPS " == *" $1 "* ]]; }
step() { # name, command...: runs it, logs to $OUT/model.log, keeps its status
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$OUT/model.log"
  "$@" 2>&1 | tee -a "$OUT/model.log"
  local rc=${PIPESTATUS[0]}
  summary+=("$name: rc=$rc")
  [ "$rc" -eq 0 ] || status=1
}

if has check; then
  step "reference make" python3 model_reference.py make "$W/ref" --device cuda
  step "model_check" examples/model_check "$W"/ref/*/
  step "reference compare" python3 model_reference.py compare "$W/ref"
  # The text path end to end: a checkpoint folder with a tokenizer, streamed to stdout.
  step "tokenizer" python3 model_reference.py tokenizer "$W/ref/gqa_tied"
  step "generate text" timeout 60 examples/generate --model "$W/ref/gqa_tied" --raw \
    --prompt "Memory bandwidth bounds" --max-tokens 24 --context 256
fi

if has generate; then
  step "generate b1" timeout 300 examples/generate --prompt-tokens 3968 --max-tokens "${STEPS_B1:-128}" --ignore-eos --ledger
  step "generate b1 waiting for each step" timeout 300 examples/generate --prompt-tokens 3968 --max-tokens "${STEPS_B1:-128}" --ignore-eos --prefill-repeats 0 --wait-each-step
  step "generate b1 speculative" timeout 300 examples/generate --prompt-tokens 3968 --max-tokens "${STEPS_B1:-128}" --ignore-eos --prefill-repeats 0 --temperature 0 --speculate 4
  # --copies: a prompt for each sequence, as torch_model_decode.py's batch of distinct prompts
  # reads (the PERF row); then forked, the prompt's pages shared (parallel samples of one prompt).
  step "generate b64" timeout 300 examples/generate --batch 64 --copies --prompt-tokens 4032 --max-tokens "${STEPS_B64:-48}" --ignore-eos --ledger --prefill-repeats 0
  step "generate b64 forked" timeout 300 examples/generate --batch 64 --prompt-tokens 4032 --max-tokens "${STEPS_B64:-48}" --ignore-eos --prefill-repeats 0
  step "prefill t2048" timeout 120 examples/generate --prompt-tokens 2048 --max-tokens 8 --ignore-eos
  step "prefill t2048 in 512-token chunks" timeout 120 examples/generate --prompt-tokens 2048 --max-tokens 8 --ignore-eos --prefill-chunk 512 --prefill-repeats 0
fi

if has serve; then
  step "serve-bench" timeout 300 examples/serve_bench ${SERVE_ARGS:-} --svg "$OUT/serve.svg"
  step "serve-bench mixed" timeout 300 examples/serve_bench --mixed ${SERVE_ARGS:-} --svg "$OUT/serve-mixed.svg"
  step "serve-bench chunked" timeout 300 examples/serve_bench --mixed --chunked --prefill-tokens 512 ${SERVE_ARGS:-} --svg "$OUT/serve-chunked.svg"
  step "serve-bench shared prefix" timeout 300 examples/serve_bench --mixed --chunked --prefill-tokens 512 --shared-prefix 1024 ${SERVE_ARGS:-} --svg "$OUT/serve-prefix.svg"
  step "serve-bench prefix unshared" timeout 300 examples/serve_bench --mixed --chunked --prefill-tokens 512 --shared-prefix 1024 --unshared ${SERVE_ARGS:-}
  step "soak" timeout 400 examples/serve_bench ${SOAK_ARGS:---layers 2 --requests 64 --soak-steps 100000}
fi

if has serve-ab; then
  if [ -x examples/serve_bench_base ]; then
    args=${SERVE_AB_ARGS:---mixed --chunked --prefill-tokens 512 --requests 64}
    for r in $(seq "${SERVE_AB_REPEATS:-2}"); do
      step "serve-ab base $r" timeout 300 examples/serve_bench_base $args
      step "serve-ab new $r" timeout 300 examples/serve_bench $args
    done
    awk '/^=== /{keep = /^=== serve-ab/} keep && /^(=== serve-ab|serve:)/' "$OUT/model.log" | cut -c1-400 >"$OUT/serve-ab.md"
    summary+=("serve-ab: base $(cat BASE 2>/dev/null || echo unknown) against $(cat COMMIT 2>/dev/null || echo unknown), $args (serve-ab.md)")
  else
    summary+=("serve-ab: no examples/serve_bench_base (cargo xtask bundle --base REV)"); status=1
  fi
fi

if has profile; then
  # ncu's CSV and generate's own lines share stdout; graph_nodes.py reads the quoted ones.
  step "profile b1" bash -c 'timeout 300 ncu --graph-profiling node --clock-control none --csv \
    --metrics gpu__time_duration.sum examples/generate --prompt-tokens 3968 --max-tokens 5 \
    --ignore-eos --prefill-repeats 0 >"$0"; rc=$?; grep -v "^\"" "$0"; exit $rc' "$OUT/ncu-b1.csv"
  step "graph nodes b1" python3 graph_nodes.py "$OUT/ncu-b1.csv"
fi

if has torch; then
  step "torch layer" timeout 200 python3 torch_reference.py layer --json "$OUT/torch-layer.json"
  step "torch model decode" timeout "${TORCH_TIMEOUT:-400}" python3 torch_model_decode.py \
    --batches "${TORCH_BATCHES:-1,64}" --modes "${TORCH_MODES:-compiled}"
fi

echo
echo "== model summary ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), commit $(cat COMMIT 2>/dev/null)) =="
grep -hE "^time to first token|^prefill, warm|FAIL|PASS|ms/step|ms_per_step|error" "$OUT/model.log" | cut -c1-400
[ -f "$OUT/serve-ab.md" ] && cat "$OUT/serve-ab.md"
printf '%s\n' "${summary[@]}"
pack_out 'model[.]log|serve-ab[.]md'
exit $status
