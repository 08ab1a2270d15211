#!/bin/bash
cd "$(dirname "$0")/.."
T=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
N=$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__file__))' 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$T/lib:$(ls -d $N/*/lib 2>/dev/null | tr '\n' ':')
W=/tmp/w; mkdir -p $W
python3 bench/make_random_llama.py --shape 135m --tokenizer .gpu/tokenizer --out $W/135m >/dev/null 2>&1
echo "=== tests [ops]"
COMB_CUDA_MODEL=$W/135m timeout 120 .gpu/bin/comb_tests "[ops]" > $OUT/tests.txt 2>&1; echo "rc $?"
grep -B3 -A12 "FAILED" $OUT/tests.txt | head -80; tail -3 $OUT/tests.txt
echo "=== bench/gpu.sh"
COMB_BIN=.gpu/bin/comb COMB_GPU_REPEAT=3 timeout 260 bench/gpu.sh .gpu/tokenizer $W > $OUT/gpu.txt 2>$OUT/gpu.err; echo "rc $?"; cat $OUT/gpu.txt; tail -3 $OUT/gpu.err
echo "=== pic 1b"
P=$W/1b.plugin.safetensors
timeout 40 .gpu/bin/comb plugin init --model $W/1b --device cuda --dtype bfloat16 --out $P --init joint --documents-after-prefix 1 --encoder-layers 14 --cross-layers $(seq -s, 0 14) 2>&1 | tail -2
for k in 1 0; do COMB_CUDA_KERNELS=$k timeout 70 .gpu/bin/comb bench --model $W/1b --plugin $P --device cuda --dtype bfloat16 --pic-data .gpu/nq20.jsonl --pic-items 10 --pic-methods full,naive,epic,cacheblend,comb --repeat 3 --json 2>&1 | sed "s/^/kernels=$k /"; done > $OUT/pic.txt; grep -v '"item"' $OUT/pic.txt | tail -30
