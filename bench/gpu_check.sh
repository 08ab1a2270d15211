#!/usr/bin/env bash
# What a GPU run checks and measures, in one command (every step: about 12 minutes on one H200):
#   bench/gpu_check.sh TOKENIZER_DIR GREEDY_DIR DATA OUT_DIR [WORK_DIR]
# 1. comb_tests "[cuda]" (the fused ops, the device tier, the one-launch fills, the packed encoder)
#    on a random model of the default model's shape (bench/make_random_llama.py --shape 135m),
#    with transformers' float32 and bfloat16 logits of it on this GPU for comb's bf16 against them
#    (tests/oracle/bf16_reference.py);
# 2. bench/greedy_answers.sh GREEDY_DIR cuda float32 against GREEDY_DIR/cpu-float32.txt (the same
#    script run on a CPU): every method's greedy answers, compared line for line;
# 3. bench/gpu.sh with the caching methods on DATA (items of the nq-multidoc-10 kind) for the 1b
#    and 8b shapes (COMB_GPU_SHAPES, COMB_GPU_PIC_SHAPES to change), without the own-GEMV and
#    generic columns;
# 4. the caching methods' requests by operation (comb bench --profile 1, 1b shape; first over 10
#    further items, whose lengths the process has not met);
# 5. COMB's requests with the packed encoder (the default) against the padded batch (COMB_CUDA_VARLEN=0; 1b),
#    then full's, naive's and COMB's with short forwards as CUDA graphs (the default) against the
#    fused layers launched one by one (COMB_CUDA_GRAPHS=0; 1b), then with forwards of up to 64
#    rows (the default) or 128 as graphs (COMB_CUDA_STEP_ROWS=64, 128; 1b); each A/B's table by
#    bench/pic_ab.py;
# 6. the serving engine's batched decoding step on the 8b shape (comb bench --batch-decode 1,16,64:
#    tokens/s with 1, 16 and 64 sequences running, bf16, 128-token prompts), its kernels launched
#    one by one and then replayed as CUDA graphs (COMB_CUDA_PAGED_GRAPHS=0, 1), then every row
#    sampling (temperature 0.8, top-p 0.95; batch-decode-8b-sampled.txt);
# 7. comb serve on the 8b shape (bf16) under comb loadgen: DATA's first 20 items as the document
#    pool, 16 tokens out, prefix caching then COMB at a few Poisson rates (COMB_GPU_SERVE_S seconds
#    each, default 15), then full and naive reuse at 2 requests/s (warm TTFT against full's at
#    COMB's lowest rate), the decoding steps taking prompts' pieces (the mixed step);
# 8. step 7's server with --mixed-step 0 at its higher rates;
# 9. comb serve on the 8b shape under a plain load: 16 and 64 closed-loop clients (comb loadgen
#    --concurrency), prompts of 48 words (about 128 tokens), 128 tokens out; then 16 sampling
#    (--temperature 0.8);
# 10. the document store's host tier (1b): warm requests with a device tier of 8 MiB (comb bench
#    --device-cache-mb), most documents promoted from the host tier at each, its entries in
#    pageable then page-locked memory (COMB_CUDA_PINNED_HOST=0, 1); then put() of device entries
#    with a disk tier, its writes queued against waited for (comb bench --store-put; store-put-1b.txt);
# 11. tests/greedy/same_tokens.py on cuda in float32 (the random 135m model, a fresh plug-in):
#    comb serve's greedy answers, alone and batched, equal comb eval's on the same device;
# 12. where a decoding step's GPU time goes (1b and 8b, bf16): the step timed (comb bench; and with
#    the attention fused, COMB_CUDA_FUSED_ATTENTION=1), then 4
#    steps under Nsight Compute (ncu), the graph's nodes one by one and then each replay as one
#    result; bench/decode_kernels.py prints each kernel's time, bytes and share of the bandwidth
#    limit, and what lies outside the kernels. The profile skipped where ncu is missing.
# COMB_GPU_CHECK_STEPS (default "1 2 3 4 5 6 7 8 9 10 11 12") names the steps, run in the order
# given. Each step makes the random models and plug-ins it needs where an earlier call on the same
# machine did not (in WORK_DIR; bench/make_random_llama.py, gpu_env.sh's gpu_plugin), so any subset
# runs on a bare machine. COMB_GPU_DEADLINE_S=N: every step ends within N seconds of the start (a
# step that would need more than what is left is skipped and named; the timeouts inside are cut to
# what is left), so that a caller's time limit does not cut off the results. COMB_GPU_TAR=FILE: OUT_DIR
# packed into FILE (gzip'ed tar) after every step, so that a killed run keeps what its finished steps
# wrote. Each step's output goes to OUT_DIR (tests.txt, bf16-reference.txt, greedy-cuda-float32.txt,
# gpu.txt, gpu.err.txt, gpu-raw.txt, pic-profile-1b.txt, varlen-1b.txt, graphs-1b.txt,
# step-rows-1b.txt, pic-ab.err.txt, batch-decode-8b-graphs{0,1}.txt, batch-decode-8b-sampled.txt, serve-8b.txt, serve-8b.log,
# serve-8b-unmixed.txt, serve-8b-unmixed.log, serve-8b-plain.txt, serve-8b-plain.log,
# host-tier-1b.txt, store-put-1b.txt, same-tokens-cuda.txt, decode-kernels-{1b,8b}.txt and their ncu tables
# decode-kernels-{1b,8b}-{node,graph}.csv, models.log); a summary to stdout. COMB_BIN and
# COMB_TESTS name the binaries (default build/comb, build/tests/comb_tests); python3 with torch and
# transformers is needed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tok=${1:?usage: bench/gpu_check.sh TOKENIZER_DIR GREEDY_DIR DATA OUT_DIR [WORK_DIR]}
greedy=${2:?usage}
data=${3:?usage}
out=${4:?usage}
work=${5:-/tmp/comb-gpu}
comb=${COMB_BIN:-$here/../build/comb}
tests=${COMB_TESTS:-$here/../build/tests/comb_tests}
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)
# shellcheck source=gpu_env.sh
source "$here/gpu_env.sh"  # gpu_plugin
start=$(date +%s)
deadline=${COMB_GPU_DEADLINE_S:-0}
tarball=${COMB_GPU_TAR:-}
export PYTHONUNBUFFERED=1
step() { printf '[gpu_check +%ds] %s\n' "$(($(date +%s) - start))" "$*"; }
# Seconds left before the deadline (a large number without one).
left() { if ((deadline > 0)); then echo $((deadline - ($(date +%s) - start))); else echo 1000000; fi; }
# limit N: N seconds, or what is left before the deadline less 15 (the archive's), at least 1.
limit() {
  local l=$(($(left) - 15))
  ((l < 1)) && l=1
  ((l < $1)) && echo "$l" || echo "$1"
}
# OUT_DIR into COMB_GPU_TAR, whole or not at all.
checkpoint() {
  [ -n "$tarball" ] || return 0
  tar --warning=no-file-changed -czf "$tarball.part" -C "$out" . 2>/dev/null
  (($? <= 1)) && mv -f "$tarball.part" "$tarball"  # 1: a file (a log being written) changed while read
}
# model SHAPE: WORK_DIR/SHAPE, made unless there (its log in models.log); 1 where it failed.
model() {
  [ -f "$work/$1/config.json" ] && return 0
  timeout "$(limit 240)" python3 "$here/make_random_llama.py" --shape "$1" --tokenizer "$tok" --out "$work/$1" \
    >> "$out/models.log" 2>&1 && return 0
  echo "making the $1 shape failed (models.log):"
  tail -3 "$out/models.log"
  return 1
}
# plugin SHAPE: the shape and its fresh joint plug-in (WORK_DIR/SHAPE.plugin.safetensors).
plugin() {
  model "$1" || return 1
  gpu_plugin "$comb" "$work/$1" "$(limit 120)" 2>> "$out/models.log" && return 0
  echo "the $1 shape's plug-in failed (models.log):"
  tail -3 "$out/models.log"
  return 1
}

step1() {  # comb_tests [cuda]
  model 135m || return
  # transformers' float32 and bfloat16 logits of that model on this GPU, for comb's bf16 against them.
  timeout "$(limit 120)" python3 "$here/../tests/oracle/bf16_reference.py" --model "$work/135m" --device cuda \
    --out "$work/135m-bf16-reference.safetensors" > "$out/bf16-reference.txt" 2>&1 || tail -5 "$out/bf16-reference.txt"
  local ref=$work/135m-bf16-reference.safetensors
  [ -s "$ref" ] || ref=  # not made: the case says so and checks nothing
  # Two cases load the default model (COMB_MODEL); where it was not brought, the random one of its shape.
  local t
  t=$(limit 300)
  COMB_MODEL=${COMB_MODEL:-$work/135m} COMB_CUDA_MODEL=$work/135m COMB_CUDA_BF16_REF=$ref \
    timeout "$t" "$tests" "[cuda]" > "$out/tests.txt" 2>&1
  local rc=$?
  echo "rc $rc$([ "$rc" = 124 ] && echo " (timed out after $t s: the cases after the last one listed did not run)")"
  grep -B3 -A15 "FAILED" "$out/tests.txt" | head -60
  tail -3 "$out/tests.txt"
}

step2() {  # greedy answers, cuda float32 against the CPU's
  COMB_BIN=$comb timeout "$(limit 180)" "$here/greedy_answers.sh" "$greedy" cuda float32 > "$out/greedy-cuda-float32.txt"
  if cmp -s "$greedy/cpu-float32.txt" "$out/greedy-cuda-float32.txt"; then
    echo "identical: $(wc -l < "$out/greedy-cuda-float32.txt") answers"
  else
    echo "DIFFER (or cut short: $(wc -l < "$out/greedy-cuda-float32.txt") of $(wc -l < "$greedy/cpu-float32.txt") lines)"
    diff "$greedy/cpu-float32.txt" "$out/greedy-cuda-float32.txt" | head -20
    tail -5 "$greedy/answers-cuda-float32.err" 2>/dev/null
  fi
}

step3() {  # bench/gpu.sh
  local shapes=${COMB_GPU_PIC_SHAPES:-1b 8b} s
  for s in $shapes; do plugin "$s" || return; done  # before any measurement: later steps use them
  COMB_BIN=$comb COMB_GPU_REPEAT=${COMB_GPU_REPEAT:-3} COMB_GPU_GENERIC=0 COMB_GPU_GEMV=0 COMB_GPU_PIC_DATA=$data \
    COMB_GPU_PIC_SHAPES=$shapes COMB_GPU_RAW=$out/gpu-raw.txt timeout "$(limit 330)" "$here/gpu.sh" "$tok" "$work" \
    > "$out/gpu.txt" 2> "$out/gpu.err.txt"
  echo "rc $?"
  if [ ! -s "$out/gpu.txt" ] && [ -s "$out/gpu-raw.txt" ]; then  # cut short: the table of what was measured
    echo "(the table of the lines measured before it stopped)"
    python3 "$here/gpu_table.py" --work "$work" < "$out/gpu-raw.txt" > "$out/gpu.txt" 2>> "$out/gpu.err.txt"
  fi
  cat "$out/gpu.txt"
}

pic=(bench --model "$work/1b" --plugin "$work/1b.plugin.safetensors" --device cuda --dtype bfloat16 --pic-data "$data"
     --pic-items 10)
step4() {  # the caching methods by operation (1b)
  plugin 1b || return
  timeout "$(limit 90)" "$comb" "${pic[@]}" --pic-methods full,naive,comb --repeat 1 --profile 1 2>&1 | tr '\r' '\n' \
    | grep -v '^\[bench\] item' > "$out/pic-profile-1b.txt"
  grep "(profiled" "$out/pic-profile-1b.txt"
}

step5() {  # A/B runs of the caching methods (1b)
  plugin 1b || return
  local v g r
  for v in 0 1; do
    COMB_CUDA_VARLEN=$v timeout "$(limit 60)" "$comb" "${pic[@]}" --pic-methods full,comb --repeat 3 --json \
      2>> "$out/pic-ab.err.txt" | grep -v '"item"' | sed "s/^/varlen=$v /"
  done > "$out/varlen-1b.txt"
  python3 "$here/pic_ab.py" < "$out/varlen-1b.txt"
  for g in 0 1; do  # a warm request's question and a decoding step: launched, then one graph
    COMB_CUDA_GRAPHS=$g timeout "$(limit 60)" "$comb" "${pic[@]}" --pic-methods full,naive,comb --repeat 3 --json \
      2>> "$out/pic-ab.err.txt" | grep -v '"item"' | sed "s/^/graphs=$g /"
  done > "$out/graphs-1b.txt"
  python3 "$here/pic_ab.py" < "$out/graphs-1b.txt"
  # A cold COMB request's prompt (~65 rows) on the fused layers (the graph takes up to 64) or on the
  # graph bucket of 128 (COMB_CUDA_STEP_ROWS=128): its host's launches against the rows kernel's
  # attention over more rows.
  for r in 64 128; do
    COMB_CUDA_STEP_ROWS=$r timeout "$(limit 60)" "$comb" "${pic[@]}" --pic-methods full,naive,comb --repeat 3 --json \
      2>> "$out/pic-ab.err.txt" | grep -v '"item"' | sed "s/^/step_rows=$r /"
  done > "$out/step-rows-1b.txt"
  python3 "$here/pic_ab.py" < "$out/step-rows-1b.txt"
}

step6() {  # the serving engine's batched decoding step (8b, bf16)
  model 8b || return
  local g
  for g in 0 1; do  # the kernels launched one by one, then replayed as a graph per bucket
    COMB_CUDA_PAGED_GRAPHS=$g timeout "$(limit 150)" "$comb" bench --model "$work/8b" --device cuda --dtype bfloat16 \
      --prompt-tokens 128 --decode-tokens 256 --batch-decode 1,16,64 --repeat 1 > "$out/batch-decode-8b-graphs$g.txt" 2>&1
    echo "COMB_CUDA_PAGED_GRAPHS=$g rc $?"
    grep -E "^batch|decode" "$out/batch-decode-8b-graphs$g.txt"
  done
  # Every row sampling (the graphs on): the rows' highest tokens read back instead of their argmax.
  timeout "$(limit 150)" "$comb" bench --model "$work/8b" --device cuda --dtype bfloat16 --prompt-tokens 128 \
    --decode-tokens 256 --batch-decode 1,16,64 --temperature 0.8 --top-p 0.95 --repeat 1 \
    > "$out/batch-decode-8b-sampled.txt" 2>&1
  echo "sampled (temperature 0.8, top-p 0.95) rc $?"
  grep -E "^batch" "$out/batch-decode-8b-sampled.txt"
}

serve_s=${COMB_GPU_SERVE_S:-15}
# The retrieval load: DATA's items as the document pool, prefix caching then COMB at Poisson rates,
# then (when given) full and naive reuse at other rates, for warm TTFT against full's at one rate.
retrieval_load() {
  local port=$1 prefix_rates=$2 comb_rates=$3 other_rates=${4:-}
  timeout "$(limit 180)" "$comb" loadgen --port "$port" --data "$data" --items 20 --methods prefix \
    --rates "$prefix_rates" --duration "$serve_s" --max-tokens 16 || echo "prefix caching's load: rc $?"
  timeout "$(limit 100)" "$comb" loadgen --port "$port" --data "$data" --items 20 --methods comb --rates "$comb_rates" \
    --duration "$serve_s" --max-tokens 16 | tail -n +2
  if [ -n "$other_rates" ]; then
    timeout "$(limit 100)" "$comb" loadgen --port "$port" --data "$data" --items 20 --methods full,naive \
      --rates "$other_rates" --duration "$serve_s" --max-tokens 16 | tail -n +2
  fi
}
# A plain decoding load: closed-loop clients, prompts of 48 words (about 128 tokens), 128 tokens out.
plain_load() {
  local port=$1 clients=$2
  timeout "$(limit 100)" "$comb" loadgen --port "$port" --data "$data" --items 20 --concurrency "$clients" \
    --prompt-words 48 --max-tokens 128 --warm 0 --duration "$serve_s"
  echo "16 clients sampling (temperature 0.8):"
  timeout "$(limit 60)" "$comb" loadgen --port "$port" --data "$data" --items 20 --concurrency 16 \
    --prompt-words 48 --max-tokens 128 --warm 0 --duration "$serve_s" --temperature 0.8 | tail -n +2
}
# comb serve on the 8b shape under comb loadgen: serve_8b NAME "SERVE OPTIONS" LOAD [LOAD ARGS...]
serve_8b() {
  local name=$1 options=$2 load=$3
  shift 3
  plugin 8b || return
  rm -f "$work/serve.port"
  # shellcheck disable=SC2086
  "$comb" serve --model "$work/8b" --plugin "$work/8b.plugin.safetensors" --device cuda --dtype bfloat16 --port 0 \
    --port-file "$work/serve.port" --max-running 64 --max-queued 1024 --kv-mb 16384 --cache-mb 8192 \
    --log-requests 0 --drain-timeout 2 $options 2> "$out/$name.log" &
  local server=$! waited=0
  # Until it listens, or it has stopped, or two minutes (or the deadline is near).
  while [ ! -f "$work/serve.port" ] && kill -0 "$server" 2>/dev/null && ((waited < 600 && $(left) > 30)); do
    sleep 0.2
    waited=$((waited + 1))
  done
  if [ -f "$work/serve.port" ]; then
    local port
    port=$(cat "$work/serve.port")
    head -n 2 "$out/$name.log"
    {
      "$load" "$port" "$@"
      curl -s --max-time 5 "http://127.0.0.1:$port/metrics" | grep -E '^comb_(mixed|decode)_' || true
    } 2>&1 | tee "$out/$name.txt"
  else
    echo "the server did not start:"
    tail -5 "$out/$name.log"
  fi
  kill -TERM "$server" 2>/dev/null
  for _ in $(seq 1 50); do  # its drain (--drain-timeout 2), then no longer
    kill -0 "$server" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL "$server" 2>/dev/null
  wait "$server" 2>/dev/null
}

step7() { serve_8b serve-8b "" retrieval_load 2,8,16 2,8,32 2; }
step8() { serve_8b serve-8b-unmixed "--mixed-step 0" retrieval_load 8 8,32; }
step9() { serve_8b serve-8b-plain "" plain_load 16,64; }

step10() {  # the document store's host tier (1b)
  plugin 1b || return
  local p
  for p in 0 1; do  # each warm request promotes most of its documents from the host tier
    COMB_CUDA_PINNED_HOST=$p timeout "$(limit 60)" "$comb" "${pic[@]}" --pic-methods full,naive,comb --repeat 3 \
      --device-cache-mb 8 2>> "$out/pic-ab.err.txt" | sed "s/^/pinned=$p /"
  done | tee "$out/host-tier-1b.txt"
  # put() of device entries into a store with a disk tier: the writes queued (an event recorded, the
  # copy on the writer's stream) against waited for one by one.
  timeout "$(limit 60)" "$comb" bench --model "$work/1b" --device cuda --dtype bfloat16 --prompt-tokens 8 \
    --decode-tokens 0 --store-put 10 --repeat 3 --cache-dir "$work" 2>> "$out/pic-ab.err.txt" | grep -E "^store" \
    | tee "$out/store-put-1b.txt"
}

step11() {  # greedy answers of comb eval, comb serve and comb generate on cuda float32 (135m)
  model 135m || return
  # The shipped plug-in names the default model's fingerprint: a fresh joint one instead (documents
  # after the prefix, consecutive, as the shipped one reads them; blocks before layers 0 .. 28).
  if [ ! -s "$work/135m.same.plugin.safetensors" ]; then
    "$comb" plugin init --model "$work/135m" --init joint --documents-after-prefix 1 --consecutive-documents 1 \
      --encoder-layers 28 --cross-layers "$(seq -s, 0 28)" --out "$work/135m.same.plugin.safetensors" \
      > /dev/null 2>> "$out/models.log" || { echo "the 135m plug-in failed:"; tail -3 "$out/models.log"; return; }
  fi
  COMB_MODEL=$work/135m COMB_SHIPPED_PLUGIN=$work/135m.same.plugin.safetensors \
    COMB_SAME_TOKENS_DEVICE=cuda timeout "$(limit 400)" python3 "$here/../tests/greedy/same_tokens.py" "$comb" \
    "$work/same-tokens" > "$out/same-tokens-cuda.txt" 2>&1
  echo "tests/greedy/same_tokens.py on cuda: rc $?"
  grep -E "^FAIL|passed|failed" "$out/same-tokens-cuda.txt" | head -20
}

# Tokens a second of 64 decoding steps after 16 prompt tokens (comb bench, median of 3): decode_tps
# SHAPE FUSED (COMB_CUDA_FUSED_ATTENTION's value).
decode_tps() {
  COMB_CUDA_FUSED_ATTENTION=$2 timeout "$(limit 120)" "$comb" bench --model "$work/$1" --device cuda --dtype bfloat16 \
    --prompt-tokens 16 --decode-tokens 64 --repeat 3 --json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("bench") == "decode":
        print(r["tokens_per_s"])'
}

step12() {  # a decoding step's kernels under Nsight Compute (1b, 8b; bf16)
  # On the PATH, else where Nsight Compute installs itself (the newest version), else the toolkit's.
  local ncu shape mode tps step_us
  ncu=$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1)
  [ -n "$ncu" ] || { [ -x /usr/local/cuda/bin/ncu ] && ncu=/usr/local/cuda/bin/ncu; }
  for shape in 1b 8b; do
    model "$shape" || continue
    # The step as users meet it (a token read back each step), without the profiler; then with
    # RoPE, the cache append, attention and its merge in one launch (COMB_CUDA_FUSED_ATTENTION=1).
    tps=$(decode_tps "$shape" 0)
    echo "$shape decode: $tps tokens/s; with COMB_CUDA_FUSED_ATTENTION=1: $(decode_tps "$shape" 1) tokens/s"
    if [ -z "$ncu" ]; then
      echo "no ncu (on the PATH or under /opt/nvidia/nsight-compute): the profile skipped"
      continue
    fi
    # --profile 1 opens the profiler's range around its 4 profiled steps alone.
    for mode in node graph; do
      timeout "$(limit 240)" "$ncu" --profile-from-start off --clock-control none --graph-profiling "$mode" \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum -f -o "$work/step-$shape-$mode" \
        "$comb" bench --model "$work/$shape" --device cuda --dtype bfloat16 --prompt-tokens 16 --decode-tokens 4 \
        --repeat 1 --profile 1 > "$out/ncu-$shape-$mode.log" 2>&1
      echo "ncu $shape ($mode): rc $?"
      "$ncu" --import "$work/step-$shape-$mode.ncu-rep" --csv --page raw --print-units base --print-kernel-base function \
        > "$out/decode-kernels-$shape-$mode.csv" 2>> "$out/ncu-$shape-$mode.log" || tail -5 "$out/ncu-$shape-$mode.log"
    done
    step_us=$(python3 -c "import sys; print(1e6 / float(sys.argv[1]))" "${tps:-0}" 2>/dev/null)
    python3 "$here/decode_kernels.py" "$out/decode-kernels-$shape-node.csv" --graph "$out/decode-kernels-$shape-graph.csv" \
      --steps 4 ${step_us:+--step-us "$step_us"} > "$out/decode-kernels-$shape.txt" 2>&1
    # The summary: the heaviest kernels, every kernel's sum, what lies outside them (the whole table in the file).
    head -n 10 "$out/decode-kernels-$shape.txt"
    grep -E "every kernel|measured without|replay" "$out/decode-kernels-$shape.txt"
  done
}

# What each step is, and about how many seconds it needs to be worth starting (on one H200).
title=([1]='comb_tests [cuda]' [2]='greedy answers, cuda float32 against the CPU'"'"'s'
  [3]='bench/gpu.sh: comb against transformers, the caching methods (1b, 8b)'
  [4]='the caching methods by operation (1b)'
  [5]='the packed encoder against the padded batch, short forwards launched and as graphs, 64 or 128 graph rows (1b)'
  [6]='the serving engine'"'"'s batched decoding step (8b, bf16)'
  [7]='comb serve on the 8b shape (bf16) under comb loadgen'
  [8]='the same without the mixed step (prompts'"'"' pieces between the decoding steps)'
  [9]='comb serve on the 8b shape under a plain decoding load (16 and 64 clients)'
  [10]='the document store'"'"'s host tier: a device tier of 8 MiB, pageable then page-locked; disk writes queued (1b)'
  [11]='greedy answers of comb eval, comb serve (alone and batched) and comb generate on cuda, float32 (135m)'
  [12]='a decoding step'"'"'s kernels under Nsight Compute (1b, 8b; bf16)')
need=([1]=90 [2]=45 [3]=180 [4]=45 [5]=90 [6]=120 [7]=120 [8]=70 [9]=80 [10]=70 [11]=90 [12]=180)
for n in ${COMB_GPU_CHECK_STEPS:-1 2 3 4 5 6 7 8 9 10 11 12}; do
  if ! [[ $n =~ ^[1-9][0-9]*$ ]] || [ -z "${title[$n]:-}" ]; then
    echo "no step $n (1 to 12)"
    continue
  fi
  if (($(left) < need[n])); then
    step "$n. skipped: $(left) s left before the deadline, it needs about ${need[n]} s"
    continue
  fi
  step "$n. ${title[$n]}"
  "step$n"
  checkpoint
done
step "done"
checkpoint
