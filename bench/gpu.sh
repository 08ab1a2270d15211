#!/usr/bin/env bash
# comb on one CUDA GPU against transformers on the same weights, in one run (docs/benchmarks.md, "On a GPU").
#   bench/gpu.sh TOKENIZER_DIR [WORK_DIR]
# Makes Llama-3.2-1B- and Llama-3.1-8B-shaped models with random bfloat16 weights in WORK_DIR (default
# /tmp/comb-gpu; bench/make_random_llama.py, TOKENIZER_DIR's vocabulary), then for each: prefill of 128,
# 512 and 2048 tokens and decoding (batch 1, 128 tokens after a 128-token prompt) by comb (its fused
# kernels and CUDA graph), by comb with its own GEMV for the step's matrices (COMB_CUDA_GEMV=1), by comb
# without its CUDA kernels (COMB_CUDA_KERNELS=0: the generic ATen path) and by transformers, and
# prints the table (bench/gpu_table.py): ratios to transformers and the share of the memory-bandwidth
# limit (the weights' bytes over a device-to-device copy's rate, measured in the same run).
# With COMB_GPU_PIC_DATA=FILE (items of the nq-multidoc-10 kind, e.g. the first 20 of
# ../shared/data's nq-multidoc-10.dev), also the caching methods (full, naive, EPIC, CacheBlend, COMB)
# on COMB_GPU_PIC_ITEMS items (default 10) of the shapes in COMB_GPU_PIC_SHAPES (default 1b), with a
# fresh joint plug-in made there (only speed is measured), the fused kernels on and off.
# Needs: the comb binary (COMB_BIN, default build/comb), python3 with torch and transformers.
# COMB_GPU_RAW=FILE keeps the measurements' lines, the table's input (a run cut short: its lines so far).
# COMB_GPU_SHAPES="1b" runs one shape; COMB_GPU_GEMV=0 and COMB_GPU_GENERIC=0 leave out the own-GEMV
# and generic-ATen columns (a shorter run).
set -uo pipefail  # a failed measurement is named and the others go on
here=$(cd "$(dirname "$0")" && pwd)
tok=${1:?usage: bench/gpu.sh TOKENIZER_DIR [WORK_DIR]}
work=${2:-/tmp/comb-gpu}
comb=${COMB_BIN:-$here/../build/comb}
shapes=${COMB_GPU_SHAPES:-1b 8b}
pic_shapes=${COMB_GPU_PIC_SHAPES:-1b}
repeat=${COMB_GPU_REPEAT:-5}
raw=${COMB_GPU_RAW:-/dev/null}
mkdir -p "$work"
# shellcheck source=gpu_env.sh
source "$here/gpu_env.sh"  # gpu_plugin
log() { printf '[gpu] %s\n' "$*" >&2; }
# Every model and plug-in first (each made unless there), so that a measurement that fails or a
# timeout leaves them for what comes after.
for s in $shapes $([[ -n ${COMB_GPU_PIC_DATA:-} ]] && echo "$pic_shapes"); do
  [ -f "$work/$s/config.json" ] && continue
  log "making the $s shape"
  python3 "$here/make_random_llama.py" --shape "$s" --tokenizer "$tok" --out "$work/$s" >&2 || { log "failed"; exit 1; }
done
if [[ -n ${COMB_GPU_PIC_DATA:-} ]]; then
  for s in $pic_shapes; do
    log "$s: a fresh joint plug-in"
    gpu_plugin "$comb" "$work/$s" || { log "failed"; exit 1; }
  done
fi
# run NAME COMMAND...: a measurement whose failure is named (stderr) without ending the run.
run() {
  local name=$1
  shift
  "$@" || log "$name: failed (rc $?)"
}
{
  for s in $shapes; do
    m=$work/$s
    common=(--model "$m" --device cuda --dtype bfloat16 --repeat "$repeat" --json)
    log "$s: comb"
    run "$s comb" "$comb" bench "${common[@]}" --prompt-tokens 128,512,2048 --decode-tokens 128 | sed "s/^/$s comb /"
    if [[ ${COMB_GPU_GEMV:-1} != 0 ]]; then
      log "$s: comb with its own GEMV for the step's matrices"
      COMB_CUDA_GEMV=1 run "$s gemv" "$comb" bench "${common[@]}" --prompt-tokens 128 --decode-tokens 128 \
        | grep '"decode"' | sed "s/^/$s gemv /"
    fi
    if [[ ${COMB_GPU_GENERIC:-1} != 0 ]]; then
      log "$s: comb without its CUDA kernels (the generic ATen path)"
      COMB_CUDA_KERNELS=0 run "$s generic" "$comb" bench "${common[@]}" --prompt-tokens 128,512,2048 --decode-tokens 128 \
        | sed "s/^/$s generic /"
    fi
    log "$s: transformers"
    run "$s transformers" python3 "$here/hf_baseline.py" --model "$m" --device cuda --dtype bfloat16 --repeat "$repeat" \
      --prompt-tokens 128,512,2048 --decode-tokens 128 | sed "s/^/$s transformers /"
  done
  if [[ -n ${COMB_GPU_PIC_DATA:-} ]]; then
    for s in $pic_shapes; do
      m=$work/$s
      pic=(bench --model "$m" --plugin "$m.plugin.safetensors" --device cuda --dtype bfloat16 --json --repeat 3
           --pic-data "$COMB_GPU_PIC_DATA" --pic-items "${COMB_GPU_PIC_ITEMS:-10}"
           --pic-methods full,naive,epic,cacheblend,comb)
      log "$s: caching methods"
      run "$s caching methods" "$comb" "${pic[@]}" | grep -v '"item"' | sed "s/^/$s comb /"
      if [[ ${COMB_GPU_GENERIC:-1} != 0 ]]; then
        log "$s: caching methods, generic ATen path"
        COMB_CUDA_KERNELS=0 run "$s caching methods, generic" "$comb" "${pic[@]}" | grep -v '"item"' | sed "s/^/$s generic /"
      fi
    done
  fi
} | tee "$raw" | python3 "$here/gpu_table.py" --work "$work"
