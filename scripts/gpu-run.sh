#!/usr/bin/env bash
# Runs on the GPU machine, from the folder `cargo xtask bundle` made (no Rust there):
# GPU tests, compute-sanitizer on odd shapes, and our figures beside PyTorch's from
# the same run. Prints a short table last. Logs go to $OUT (default ./out).
#
# PERF_ONLY="a b,c" keeps perf's cases whose names contain one of the comma-separated keys.
#   TESTS="tests/gemm" STEPS="tests sanitizer perf" TORCH_GROUPS="copy softmax rmsnorm attn" PERF_ARGS="--attention" bash run.sh
# PERF_REPEATS=3 runs both sides of perf three times in one job and merges them into medians.
set -u
cd "$(dirname "$0")"
. ./pack_out.sh
OUT=${OUT:-$PWD/out}
# Binaries load their modules' cubins; a base tree from before them, or a driver
# that refuses them, JIT-compiles the PTX on first load (over 80 s for perf's on a
# fresh machine) and caches the result: room for two trees' modules.
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
# PRESET names a measurement the open issues ask for, each case by its exact name
# (so no dev version comes along), PyTorch in the same job; a STEPS given is kept
# (STEPS=ab PRESET=attn-sweep: the preset's cases, base against this tree):
#   serving-gemm   issue 20: the four large GEMMs, the Llama projections at
#                  M = 64–1024 and the MLP at t32–t512, three repeats (~200 s warm);
#   serving-layer  issue 20: layer prefill t128–t2048 and t8192, decode b64/b128
#                  in a graph, the mixed step, three repeats (~220 s warm);
#   attn-sweep     issue 19: the shipped attention at every head dim, length,
#                  mask and GQA case, once, beside SDPA's backends;
#   attn-counter   issue 19: the shipped kernel on the counter walk past the
#                  walk's reach (`[HopperCounter]`) beside Auto, and hd64's
#                  turns at 512 queries beside the free consumers, interleaved;
#   attn-hd256     issue 19: head dim 256 as shipped beside its free consumers
#                  (`[HopperStrided]`, `[HopperOneTile]`) where it takes turns at
#                  issuing, those turns on the counter walk's 128-key tiles
#                  (`[HopperIssueTurns]`, `[HopperN128Counter]` free) where not,
#                  and the turns at the exponentials (`[HopperTurns]`), interleaved;
#   attn-candidates issue 19: the shipped kernel beside the versions not yet
#                  measured, interleaved: at hd64 the three consumers on one tile
#                  per block (`[HopperM192]`) where Auto runs them on the counter
#                  walk or runs two, and on the counter walk (`[HopperCounter]`)
#                  where Auto runs them one tile per block.
exact() { local IFS=,; echo "$*"; }
case "${PRESET:-}" in
  serving-gemm)
    keys=()
    for s in "m4096 n4096 k4096" "m8192 n8192 k8192" "m2048 n28672 k4096" "m2048 n4096 k14336"; do
      keys+=("=gemm bf16 x@w.T $s")
    done
    for m in 64 128 256 512 1024; do
      for nk in "n6144 k4096" "n4096 k4096" "n28672 k4096" "n4096 k14336"; do keys+=("=gemm bf16 x@w.T m$m $nk"); done
    done
    for t in 32 64 128 256 512; do keys+=("=swiglu mlp+residual t$t"); done
    STEPS=${STEPS:-perf} PERF_REPEATS=${PERF_REPEATS:-3} PERF_ARGS=--gemm TORCH_GROUPS="gemm mlp" PERF_ONLY=$(exact "${keys[@]}") ;;
  serving-layer)
    keys=("=layer decode b64 L4096 [graph]" "=layer decode b128 L4096 [graph]" "=layer mixed t512 + b16 L4096")
    for t in 128 256 512 1024 2048 8192; do keys+=("=layer prefill t$t"); done
    STEPS=${STEPS:-perf} PERF_REPEATS=${PERF_REPEATS:-3} PERF_ARGS=--layer TORCH_GROUPS=layer PERF_ONLY=$(exact "${keys[@]}") ;;
  attn-sweep)
    keys=("=attn ours gqa32/8 hd128 s2048 causal1" "=attn ours gqa32/8 hd128 s8192 causal1")
    for hd in 64 128 256; do
      h=$((2048 / hd))
      for s in 512 1024 2048 4096 8192 16384; do
        for c in 0 1; do keys+=("=attn ours hd$hd s$s b$((16384 / s)) h$h causal$c"); done
      done
    done
    STEPS=${STEPS:-perf} PERF_ARGS=--attention TORCH_GROUPS=attn PERF_ONLY=$(exact "${keys[@]}") ;;
  attn-counter)
    keys=()
    for n in "hd64 s8192 b2 h32 causal0" "hd64 s16384 b1 h32 causal0" "hd64 s16384 b1 h32 causal1" \
      "hd128 s16384 b1 h16 causal1" "hd256 s4096 b4 h8 causal0" "hd256 s8192 b2 h8 causal0" "hd256 s8192 b2 h8 causal1"; do
      keys+=("=attn ours $n" "=attn ours $n [HopperCounter]")
    done
    for c in 0 1; do keys+=("=attn ours hd64 s512 b32 h32 causal$c" "=attn ours hd64 s512 b32 h32 causal$c [HopperPersistent]"); done
    STEPS=${STEPS:-perf} PERF_ARGS="--attention --versions --interleave" TORCH_GROUPS=attn PERF_ONLY=$(exact "${keys[@]}") ;;
  attn-hd256)
    keys=()
    # Auto's consumers take turns at issuing without a mask and with one past
    # 2048 queries (one tile per block); causal up to 2048 they run free on the
    # counter walk's 64-key tiles, beside the turns at issuing on its 128-key
    # tiles and those tiles free. Beside it everywhere the turns at the
    # exponentials, and elsewhere the free consumers on its walk.
    for s in 512 1024 2048 4096 8192 16384; do
      for c in 0 1; do
        n="hd256 s$s b$((16384 / s)) h8 causal$c"
        keys+=("=attn ours $n" "=attn ours $n [HopperTurns]")
        if [ "$c" = 0 ]; then keys+=("=attn ours $n [HopperStrided]"); fi
        if [ "$c" = 1 ] && [ "$s" -gt 2048 ]; then keys+=("=attn ours $n [HopperOneTile]"); fi
        if [ "$c" = 1 ] && [ "$s" -le 2048 ]; then
          keys+=("=attn ours $n [HopperIssueTurns]" "=attn ours $n [HopperN128Counter]")
        fi
      done
    done
    STEPS=${STEPS:-perf} PERF_ARGS="--attention --versions --interleave" TORCH_GROUPS=attn PERF_ONLY=$(exact "${keys[@]}") ;;
  attn-candidates)
    keys=()
    for n in "s2048 b8 h32 causal0" "s4096 b4 h32 causal0" "s4096 b4 h32 causal1" "s8192 b2 h32 causal1"; do
      keys+=("=attn ours hd64 $n" "=attn ours hd64 $n [HopperM192]")
    done
    for n in "s8192 b2 h32 causal0" "s16384 b1 h32 causal0" "s16384 b1 h32 causal1"; do
      keys+=("=attn ours hd64 $n" "=attn ours hd64 $n [HopperCounter]")
    done
    STEPS=${STEPS:-perf} PERF_ARGS="--attention --versions --interleave" TORCH_GROUPS=attn PERF_ONLY=$(exact "${keys[@]}") ;;
  "") ;;
  *) echo "run.sh: unknown PRESET $PRESET" >&2; exit 2 ;;
esac
STEPS=${STEPS:-tests sanitizer perf}  # also: ab, profile, detail, cublas
TORCH_GROUPS=${TORCH_GROUPS:-copy softmax rmsnorm attn}
PERF_ARGS=${PERF_ARGS:---attention}
mkdir -p "$OUT"
status=0
summary=()

{ echo "commit $(cat COMMIT 2>/dev/null || echo unknown), $(date -u +%Y-%m-%d)"; \
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader; } | tee "$OUT/gpu.txt"

has() { [[ " $STEPS " == *" $1 "* ]]; }

if has tests; then
  for t in ${TESTS:-tests/*}; do
    log="$OUT/tests.log"
    echo "=== $t" >>"$log"
    timeout "${TEST_TIMEOUT:-180}" "$t" >"$OUT/one.log" 2>&1
    rc=$?
    cat "$OUT/one.log" >>"$log"
    line=$(grep -E "passed|test result" "$OUT/one.log" | tail -1)
    summary+=("test $(basename "$t"): rc=$rc  $line")
    [ $rc -eq 0 ] || { status=1; grep -E "FAILED|panicked|error" "$OUT/one.log" | head -20; }
    rm -f "$OUT/one.log"
  done
fi

if has perf; then
  # PERF_REPEATS=N (default 1): both sides N times, alternating, merged into
  # per-case medians (repeats.py), each case's spread in $OUT/repeats.md.
  reps=${PERF_REPEATS:-1}
  for r in $(seq 1 "$reps"); do
    sfx=$([ "$reps" -gt 1 ] && echo "-$r")
    timeout "${PERF_TIMEOUT:-300}" examples/perf $PERF_ARGS ${PERF_ONLY:+--only "$PERF_ONLY"} --json "$OUT/ours$sfx.json" | tee "$OUT/ours$sfx.txt"
    [ -f torch_reference.py ] && [ "$reps" -gt 1 ] && python3 torch_reference.py $TORCH_GROUPS --json "$OUT/torch$sfx.json" >"$OUT/torch$sfx.txt"
  done
  if [ "$reps" -gt 1 ]; then
    python3 repeats.py --out "$OUT/ours.json" "$OUT"/ours-*.json | tee "$OUT/repeats.md"
    [ -f torch_reference.py ] && python3 repeats.py --out "$OUT/torch.json" "$OUT"/torch-*.json | tee -a "$OUT/repeats.md"
  fi
  if [ -f torch_reference.py ]; then
    [ "$reps" -gt 1 ] || python3 torch_reference.py $TORCH_GROUPS --json "$OUT/torch.json" | tee "$OUT/torch.txt"
    case " $TORCH_GROUPS " in
      *" attn "*) python3 torch_gqa_backends.py --json "$OUT/torch.json" | tee -a "$OUT/torch.txt" ;;
    esac
    case " $TORCH_GROUPS " in
      *" rmsnorm "*|*" mlp "*|*" decode "*) python3 torch_copy_sizes.py --json "$OUT/torch.json" | tee -a "$OUT/torch.txt" ;;
    esac
  fi
  # This run's rows in docs/PERF.md's table format, kernel versions included
  # (COMPARE_ARGS=""  leaves them out). To bring the run into docs/PERF.md, run the
  # same command without --versions and with --markdown docs/PERF.md.
  python3 compare.py "$OUT/ours.json" "$OUT/torch.json" ${COMPARE_ARGS---versions} \
    --commit "$(cat COMMIT 2>/dev/null || echo unknown)" --date "$(date -u +%Y-%m-%d)" \
    --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$OUT/compare.md"
fi

# The base revision's perf (examples/perf_base, from `cargo xtask bundle --base REV`)
# against this tree's, alternating AB_REPEATS times (default 3) with PERF_ARGS and
# PERF_ONLY: each case's medians, change and every run in $OUT/ab.md.
if has ab; then
  if [ -x examples/perf_base ]; then
    # One untimed pass of each side first, so that no timed run pays for the
    # JIT of its modules (nor hits PERF_TIMEOUT doing so).
    for bin in examples/perf_base examples/perf; do
      timeout "${JIT_TIMEOUT:-600}" "$bin" $PERF_ARGS ${PERF_ONLY:+--only "$PERF_ONLY"} >/dev/null 2>&1 \
        || summary+=("ab warm-up $bin: rc=$?")
    done
    for r in $(seq 1 "${AB_REPEATS:-3}"); do
      for side in base new; do
        bin=examples/perf; [ "$side" = base ] && bin=examples/perf_base
        timeout "${PERF_TIMEOUT:-300}" "$bin" $PERF_ARGS ${PERF_ONLY:+--only "$PERF_ONLY"} \
          --json "$OUT/ab-$side-$r.json" >"$OUT/ab-$side-$r.txt" 2>&1 || summary+=("ab $side $r: rc=$?")
      done
    done
    python3 ab_summary.py "$OUT" | tee "$OUT/ab.md"
    summary+=("ab: base $(cat BASE 2>/dev/null || echo unknown) against $(cat COMMIT 2>/dev/null || echo unknown)")
  else
    summary+=("ab: no examples/perf_base (cargo xtask bundle --base REV)"); status=1
  fi
fi

# Kernel durations by ncu (clocks not locked), one perf call per ';'-separated
# PROFILE_CASES entry (perf's --only keys), e.g. PROFILE_CASES="rmsnorm bf16 16384x4096;mlp+residual t1".
# NCU_CACHE=none keeps L2 between launches (ncu flushes it before each by default).
if has profile; then
  IFS=';' read -ra groups <<<"${PROFILE_CASES:-}"
  for g in "${groups[@]}"; do
    csvf="$OUT/ncu-$(echo "$g" | tr -c 'a-zA-Z0-9\n' '_').csv"
    PERF_WARM_MS=0 timeout "${PROFILE_TIMEOUT:-300}" ncu --clock-control none --cache-control "${NCU_CACHE:-all}" --csv \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      examples/perf ${PROFILE_ARGS:-} --only "$g" >"$csvf" 2>"$OUT/ncu.err"
    python3 profile_summary.py "$csvf" "$g${NCU_CACHE:+ (cache-control ${NCU_CACHE})}" | tee -a "$OUT/profile.md"
  done
fi

# One launch of a kernel in full detail (ncu --set full, text), for where its time goes:
# DETAIL="decode_wide_hd128=decode attn gqa32/8 b1 L4096" (kernel name regex, '=', perf --only
# key; ';'-separated), with PROFILE_ARGS choosing perf's groups. Writes $OUT/detail-*.txt.
if has detail; then
  IFS=';' read -ra items <<<"${DETAIL:-}"
  for item in "${items[@]}"; do
    kernel=${item%%=*}; key=${item#*=}
    txt="$OUT/detail-$(echo "$kernel" | tr -c 'a-zA-Z0-9\n' '_').txt"
    rep="$OUT/detail-$(echo "$kernel" | tr -c 'a-zA-Z0-9\n' '_')"
    PERF_WARM_MS=0 timeout "${PROFILE_TIMEOUT:-300}" ncu --clock-control none --set full -k "regex:$kernel" \
      --launch-skip 10 --launch-count 1 --import-source no -f -o "$rep" \
      examples/perf ${PROFILE_ARGS:-} --only "$key" >"$txt.log" 2>&1
    rc=$?
    ncu --import "$rep.ncu-rep" >"$txt" 2>&1
    # Per-SASS-instruction counts (executed instructions, stall samples): where a warp's time goes.
    [ -n "${DETAIL_SOURCE:-}" ] && ncu --import "$rep.ncu-rep" --page source --print-source sass --csv >"$rep-sass.csv" 2>&1
    rm -f "$rep.ncu-rep"
    summary+=("detail $kernel: rc=$rc ($(wc -l <"$txt") lines)")
  done
fi

# cuBLAS's kernel for a GEMM in the same detail, to set beside ours (`detail`):
# CUBLAS="8192,8192,8192;2048,28672,4096" (m,n,k of x·Wᵀ in bf16, ';'-separated).
# Writes $OUT/cublas-MxNxK.txt: its name (tile, stages, cluster), launch and ncu sections.
if has cublas; then
  IFS=';' read -ra shapes <<<"${CUBLAS:-8192,8192,8192}"
  for shape in "${shapes[@]}"; do
    txt="$OUT/cublas-${shape//,/x}.txt"
    timeout "${PROFILE_TIMEOUT:-300}" ncu --clock-control none --set full -k "regex:gemm|nvjet|xmma|cutlass" \
      --launch-skip 3 --launch-count 1 --import-source no python3 -c "
import torch
m, n, k = ${shape}
x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
w = torch.randn(n, k, device='cuda', dtype=torch.bfloat16) * 0.02
for _ in range(6):
    y = x @ w.T
torch.cuda.synchronize()" >"$txt" 2>&1
    summary+=("cublas $shape: rc=$? ($(grep -m1 -oE '(nvjet|sm90|cutlass)[a-zA-Z0-9_]*' "$txt"))")
  done
fi

if has sanitizer; then
  for tool in memcheck racecheck; do
    for t in ${SANITIZE_TESTS:-tests/softmax tests/rmsnorm tests/attention}; do
      log="$OUT/one.log"
      GPU_TEST_QUICK=1 timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" ${SANITIZE_FILTER:-} >"$log" 2>&1
      rc=$?
      { echo "=== $tool $t"; cat "$log"; } >>"$OUT/sanitizer.log"
      summary+=("$tool $(basename "$t"): rc=$rc  $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed" "$log" | tail -2 | tr '\n' ' ')")
      rm -f "$log"
      [ $rc -eq 0 ] || status=1
    done
  done
fi

echo
echo "== summary ($(head -1 "$OUT/gpu.txt")) =="
[ -f "$OUT/compare.md" ] && cat "$OUT/compare.md"
[ -f "$OUT/ab.md" ] && cat "$OUT/ab.md"
[ -f "$OUT/profile.md" ] && cat "$OUT/profile.md"
printf '%s\n' "${summary[@]}"
pack_out 'compare[.]md|ab[.]md|profile[.]md|gpu[.]txt|repeats[.]md'
exit $status
