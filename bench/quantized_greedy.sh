#!/usr/bin/env bash
# Greedy answers of the default model with its GGUF weights kept quantized (--quantize gguf)
# against the float32 path (every weight dequantized on load), on 20 prompts: prints, per prompt,
# whether the token ids are the same, and where they part when they do not.
#   bench/quantized_greedy.sh [MAX_TOKENS]        (default 48)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
comb="${COMB_BUILD_DIR:-$root/build}/comb"
n=${1:-48}
prompts=(
  "What is the capital of France?"
  "Write a haiku about the sea."
  "Explain photosynthesis in two sentences."
  "List three prime numbers greater than 50."
  "Who wrote Pride and Prejudice?"
  "Translate 'good morning' into Spanish."
  "What is 17 times 23?"
  "Give me a name for a pet turtle."
  "Why is the sky blue?"
  "Summarize the plot of Romeo and Juliet in one sentence."
  "What does a compiler do?"
  "Name a color that rhymes with 'bed'."
  "How many legs does a spider have?"
  "Suggest a title for a story about a lost key."
  "What is the boiling point of water at sea level in Celsius?"
  "Describe a cat to someone who has never seen one."
  "What is the opposite of 'ancient'?"
  "Write one sentence that uses the word 'lantern'."
  "What are the three states of matter?"
  "Recommend a book for a long train journey."
)
same=0
for i in "${!prompts[@]}"; do
  p=${prompts[$i]}
  a=$("$comb" generate --prompt "$p" --max-tokens "$n" --json 2>/dev/null | grep -o '"tokens":\[[0-9,]*\]' | tr -dc '0-9,')
  b=$("$comb" generate --prompt "$p" --max-tokens "$n" --json --quantize gguf 2>/dev/null | grep -o '"tokens":\[[0-9,]*\]' | tr -dc '0-9,')
  if [ "$a" = "$b" ]; then
    same=$((same + 1))
    printf '%2d same (%d tokens)  %s\n' "$((i + 1))" "$(tr ',' '\n' <<<"$a" | grep -c .)" "$p"
  else
    IFS=, read -ra ta <<<"$a"
    IFS=, read -ra tb <<<"$b"
    k=0
    while [ "$k" -lt "${#ta[@]}" ] && [ "$k" -lt "${#tb[@]}" ] && [ "${ta[$k]}" = "${tb[$k]}" ]; do k=$((k + 1)); done
    printf '%2d DIFFERENT from token %d  %s\n' "$((i + 1))" "$k" "$p"
  fi
done
echo "same greedy tokens on $same of ${#prompts[@]} prompts ($n new tokens at most)"
