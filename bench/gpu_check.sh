#!/usr/bin/env bash
# What a GPU run checks and measures, in one command (about 5 minutes on one H100):
#   bench/gpu_check.sh TOKENIZER_DIR GREEDY_DIR DATA OUT_DIR [WORK_DIR]
# 1. comb_tests "[cuda]" (the fused ops, the device tier, the one-launch fills, the packed encoder)
#    on a random model of the default model's shape (bench/make_random_llama.py --shape 135m);
# 2. bench/greedy_answers.sh GREEDY_DIR cuda float32 against GREEDY_DIR/cpu-float32.txt (the same
#    script run on a CPU): every method's greedy answers, compared line for line;
# 3. bench/gpu.sh with the caching methods on DATA (items of the nq-multidoc-10 kind) for the 1b
#    and 8b shapes (COMB_GPU_SHAPES, COMB_GPU_PIC_SHAPES to change), without the own-GEMV and
#    generic columns;
# 4. the caching methods' requests by operation (comb bench --profile 1, 1b shape);
# 5. COMB's requests with the packed encoder (COMB_CUDA_VARLEN=1) against the padded batch (1b).
# Each step's output goes to OUT_DIR (tests.txt, greedy-cuda-float32.txt, gpu.txt, gpu.err.txt,
# pic-profile-1b.txt, varlen-1b.txt); a summary to stdout. COMB_BIN and COMB_TESTS name the binaries
# (default build/comb, build/tests/comb_tests); python3 with torch and transformers is needed.
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
start=$(date +%s)
step() { printf '[gpu_check +%ds] %s\n' "$(($(date +%s) - start))" "$*"; }
export PYTHONUNBUFFERED=1

step "1. comb_tests [cuda]"
python3 "$here/make_random_llama.py" --shape 135m --tokenizer "$tok" --out "$work/135m" >/dev/null 2>&1
COMB_CUDA_MODEL=$work/135m timeout 180 "$tests" "[cuda]" > "$out/tests.txt" 2>&1
echo "rc $?"
grep -B3 -A15 "FAILED" "$out/tests.txt" | head -60
tail -3 "$out/tests.txt"

step "2. greedy answers, cuda float32 against the CPU's"
COMB_BIN=$comb timeout 120 "$here/greedy_answers.sh" "$greedy" cuda float32 > "$out/greedy-cuda-float32.txt"
if cmp -s "$greedy/cpu-float32.txt" "$out/greedy-cuda-float32.txt"; then
  echo "identical: $(wc -l < "$out/greedy-cuda-float32.txt") answers"
else
  echo "DIFFER"
  diff "$greedy/cpu-float32.txt" "$out/greedy-cuda-float32.txt" | head -20
  tail -5 "$greedy/answers-cuda-float32.err"
fi

step "3. bench/gpu.sh"
COMB_BIN=$comb COMB_GPU_REPEAT=${COMB_GPU_REPEAT:-3} COMB_GPU_GENERIC=0 COMB_GPU_GEMV=0 COMB_GPU_PIC_DATA=$data \
  COMB_GPU_PIC_SHAPES=${COMB_GPU_PIC_SHAPES:-1b 8b} timeout 330 "$here/gpu.sh" "$tok" "$work" > "$out/gpu.txt" 2> "$out/gpu.err.txt"
echo "rc $?"
cat "$out/gpu.txt"

pic=(bench --model "$work/1b" --plugin "$work/1b.plugin.safetensors" --device cuda --dtype bfloat16 --pic-data "$data"
     --pic-items 10)
step "4. the caching methods by operation (1b)"
timeout 90 "$comb" "${pic[@]}" --pic-methods full,naive,comb --repeat 1 --profile 1 2>&1 | tr '\r' '\n' \
  | grep -v '^\[bench\] item' > "$out/pic-profile-1b.txt"
grep "requests (profiled" "$out/pic-profile-1b.txt"

step "5. COMB with the packed encoder (COMB_CUDA_VARLEN=1) against the padded batch (1b)"
for v in 0 1; do
  COMB_CUDA_VARLEN=$v timeout 60 "$comb" "${pic[@]}" --pic-methods full,comb --repeat 3 --json 2>/dev/null \
    | grep -v '"item"' | sed "s/^/varlen=$v /"
done | tee "$out/varlen-1b.txt"
step "done"
