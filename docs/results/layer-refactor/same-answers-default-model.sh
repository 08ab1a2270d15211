#!/bin/bash
# The default model (SmolLM2-135M-Instruct Q4_1) and the shipped plug-in: greedy answers of every method,
# the build before the refactor (old: 504fa1a) against after (new), on one device and dtype.
#   real.sh MODEL DEVICE DTYPE OUTDIR TORCH_LIB
set -u
model=$1 dev=$2 dtype=$3 out=$4 torchlib=$5
here=$(cd "$(dirname "$0")" && pwd)
plugin=$here/../../examples/plugins/smollm2-135m-instruct.comb.safetensors
mkdir -p "$out"
for b in old new; do
  export LD_LIBRARY_PATH=$here/$b:$here/lib:$torchlib
  C="$here/$b/comb"
  f="$out/$b.txt"; : > "$f"
  common=(--model "$model" --device "$dev" --dtype "$dtype" --threads 2)
  for m in full prefix naive cacheblend epic comb; do
    "$C" eval "${common[@]}" --method $m --plugin "$plugin" --data "$here/items.jsonl" --max-new-tokens 12 \
      --out "$out/$b-$m.jsonl" >/dev/null 2>>"$out/$b.err" || echo "FAILED eval $m" >> "$f"
    python3 -c "import json,sys; [print('eval $m', r['index'], json.dumps(r['prediction'])) for r in map(json.loads, open(sys.argv[1])) if 'index' in r]" "$out/$b-$m.jsonl" >> "$f"
  done
  "$C" generate "${common[@]}" --prompt "What is the capital of France?" --max-tokens 12 --json 2>>"$out/$b.err" \
    | python3 -c "import json,sys; print('generate plain', json.load(sys.stdin)['tokens'])" >> "$f"
  # The build before rendered a document file as its text alone; after, as every prompt holds it
  # ("Title: <file name>\n<text>\n\n"): the old build is given the files so rendered.
  docs=$here; [ $b = old ] && docs=$here/rendered
  "$C" generate "${common[@]}" --plugin "$plugin" --document "$docs/doc0.txt" --document "$docs/doc1.txt" \
    --prompt "Which code word?" --max-tokens 12 --json 2>>"$out/$b.err" \
    | python3 -c "import json,sys; print('generate documents', json.load(sys.stdin)['tokens'])" >> "$f"
done
n=$(wc -l < "$out/new.txt")
if cmp -s "$out/old.txt" "$out/new.txt"; then echo "$dev $dtype: old and new identical, $n answers"; else echo "$dev $dtype: DIFFER"; diff "$out/old.txt" "$out/new.txt" | head -20; fi
