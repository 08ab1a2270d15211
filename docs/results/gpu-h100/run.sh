#!/bin/bash
# One device call: CUDA op tests, greedy answers CUDA float32 against the CPU's, bench/gpu.sh (1b, 8b, caching methods), a profile of the caching methods' requests.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
T=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
N=$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__file__))' 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$T/lib:$(ls -d $N/*/lib 2>/dev/null | tr '\n' ':')
W=/tmp/w; mkdir -p $W
s0=$(date +%s); el() { echo "[t+$(( $(date +%s) - s0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
python3 bench/make_random_llama.py --shape 135m --tokenizer .gpu/tokenizer --out $W/135m >/dev/null 2>&1
el "=== tests [ops]"
COMB_CUDA_MODEL=$W/135m timeout 120 .gpu/bin/comb_tests "[ops]" > $OUT/tests.txt 2>&1; echo "rc $?"
grep -B3 -A15 "FAILED" $OUT/tests.txt | head -60; tail -3 $OUT/tests.txt
el "=== greedy answers, cuda float32 against the cpu's"
COMB_BIN=.gpu/bin/comb timeout 75 bench/greedy_answers.sh .gpu/greedy cuda float32 > $OUT/greedy-cuda-float32.txt
if cmp -s .gpu/greedy/cpu-float32.txt $OUT/greedy-cuda-float32.txt; then echo "identical: $(wc -l < $OUT/greedy-cuda-float32.txt) answers"; else echo DIFFER; diff .gpu/greedy/cpu-float32.txt $OUT/greedy-cuda-float32.txt | head -20; tail -5 .gpu/greedy/answers-cuda-float32.err; fi
el "=== bench/gpu.sh"
COMB_BIN=.gpu/bin/comb COMB_GPU_REPEAT=3 COMB_GPU_GENERIC=0 COMB_GPU_GEMV=0 COMB_GPU_PIC_DATA=.gpu/nq20.jsonl COMB_GPU_PIC_SHAPES="1b 8b" timeout 300 bench/gpu.sh .gpu/tokenizer $W > $OUT/gpu.txt 2>$OUT/gpu.err; echo "rc $?"; cat $OUT/gpu.txt; grep -v "item " $OUT/gpu.err | tail -4
el "=== pic profile 1b"
timeout 50 .gpu/bin/comb bench --model $W/1b --plugin $W/1b.plugin.safetensors --device cuda --dtype bfloat16 --pic-data .gpu/nq20.jsonl --pic-items 10 --pic-methods full,naive,comb --repeat 1 --profile 1 > $OUT/pic-profile.txt 2>&1
grep -A15 "requests (profiled" $OUT/pic-profile.txt | cut -c1-90
el done
