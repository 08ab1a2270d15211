#!/bin/bash
# Greedy answers of every caching method, the build before the refactor (old: 504fa1a) against after
# (new), on one device and dtype: run.sh DEVICE DTYPE OUTDIR [TORCH_LIB]
set -u
dev=$1 dtype=$2 out=$3 torchlib=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for b in old new; do
  export LD_LIBRARY_PATH=$here/$b:$here/lib${torchlib:+:$torchlib}
  C="$here/$b/comb"
  f="$out/$b.txt"; : > "$f"
  common=(--model "$here/tiny" --device "$dev" --dtype "$dtype" --threads 2)
  for m in full prefix naive cacheblend epic; do
    "$C" eval "${common[@]}" --method $m --data "$here/items.jsonl" --max-new-tokens 12 --out "$out/$b-$m.jsonl" 2>>"$out/$b.err" \
      || echo "FAILED eval $m" >> "$f"
    python3 -c "import json,sys; [print('eval $m', r['index'], json.dumps(r['prediction'])) for r in map(json.loads, open(sys.argv[1])) if 'index' in r]" "$out/$b-$m.jsonl" >> "$f"
  done
  for p in reads joint joint-consecutive; do
    "$C" eval "${common[@]}" --method comb --plugin "$here/plugins/$p.safetensors" --data "$here/items.jsonl" --max-new-tokens 12 \
      --out "$out/$b-comb-$p.jsonl" 2>>"$out/$b.err" || echo "FAILED eval comb-$p" >> "$f"
    python3 -c "import json,sys; [print('eval comb-$p', r['index'], json.dumps(r['prediction'])) for r in map(json.loads, open(sys.argv[1])) if 'index' in r]" "$out/$b-comb-$p.jsonl" >> "$f"
  done
  "$C" generate "${common[@]}" --prompt "What is the capital of France?" --max-tokens 12 --json 2>>"$out/$b.err" \
    | python3 -c "import json,sys; print('generate plain', json.load(sys.stdin)['tokens'])" >> "$f"
  "$C" generate "${common[@]}" --plugin "$here/plugins/joint.safetensors" --document "$here/doc0.txt" --document "$here/doc1.txt" \
    --prompt "Which code word?" --max-tokens 12 --json 2>>"$out/$b.err" \
    | python3 -c "import json,sys; print('generate documents', json.load(sys.stdin)['tokens'])" >> "$f"
done
n=$(wc -l < "$out/new.txt")
if cmp -s "$out/old.txt" "$out/new.txt"; then echo "$dev $dtype: old and new identical, $n answers"; else echo "$dev $dtype: DIFFER"; diff "$out/old.txt" "$out/new.txt" | head -20; fi
