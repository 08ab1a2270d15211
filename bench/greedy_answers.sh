#!/usr/bin/env bash
# Greedy answers of every caching method on one device and dtype, one line per answer, so that two
# runs (the CPU and a GPU, float32) can be compared with cmp:
#   bench/greedy_answers.sh DIR DEVICE DTYPE > answers.txt
# DIR holds model/ (a Hugging Face folder with a chat template), items.jsonl (comb make-data) and
# plugins/*.safetensors (comb plugin init for that model); COMB_BIN names the binary (default
# build/comb). eval: full, prefix, naive, cacheblend, epic, and comb with each plug-in, its caches as
# the plug-in declares, int8 and int8-int4; generate: plain and with two of the items' documents.
# Errors go to DIR/answers-DEVICE-DTYPE.err; a method that fails prints "FAILED".
set -u
dir=$1 dev=$2 dtype=$3
comb=${COMB_BIN:-$(cd "$(dirname "$0")" && pwd)/../build/comb}
err="$dir/answers-$dev-$dtype.err"
: > "$err"
common=(--model "$dir/model" --device "$dev" --dtype "$dtype" --threads 2)
predictions() {  # label, eval --out file
  python3 -c "import json,sys; [print(sys.argv[1], r['index'], json.dumps(r['prediction'])) for r in map(json.loads, open(sys.argv[2])) if 'index' in r]" "$1" "$2"
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for m in full prefix naive cacheblend epic; do
  "$comb" eval "${common[@]}" --method $m --data "$dir/items.jsonl" --max-new-tokens 12 --out "$tmp/$m.jsonl" >/dev/null 2>>"$err" \
    && predictions "eval $m" "$tmp/$m.jsonl" || echo "eval $m FAILED"
done
for p in "$dir"/plugins/*.safetensors; do
  name=$(basename "$p" .safetensors)
  for cd in auto int8 int8-int4; do
    "$comb" eval "${common[@]}" --method comb --plugin "$p" --cache-dtype $cd --data "$dir/items.jsonl" --max-new-tokens 12 \
      --out "$tmp/comb-$name-$cd.jsonl" >/dev/null 2>>"$err" && predictions "eval comb $name $cd" "$tmp/comb-$name-$cd.jsonl" \
      || echo "eval comb $name $cd FAILED"
  done
done
head -2 "$dir/items.jsonl" | python3 -c "
import json, sys
for i, l in enumerate(sys.stdin): open(sys.argv[1] + f'/doc{i}.txt', 'w').write(json.loads(l)['documents'][0]['text'])" "$tmp"
"$comb" generate "${common[@]}" --prompt "What is the capital of France?" --max-tokens 12 --json 2>>"$err" \
  | python3 -c "import json,sys; print('generate plain', json.load(sys.stdin)['tokens'])" || echo "generate plain FAILED"
first=$(ls "$dir"/plugins/*.safetensors | head -1)
"$comb" generate "${common[@]}" --plugin "$first" --document "$tmp/doc0.txt" --document "$tmp/doc1.txt" \
  --prompt "Which code word?" --max-tokens 12 --json 2>>"$err" \
  | python3 -c "import json,sys; print('generate documents', json.load(sys.stdin)['tokens'])" || echo "generate documents FAILED"
