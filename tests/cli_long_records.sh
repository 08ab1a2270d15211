#!/usr/bin/env bash
# `make-data --kind long-records`: 12-24 files of filler paragraphs, 8 of them holding look-alike
# staff records; one or two files hold the asked person's record (the gold index the first); the
# same seed gives the same bytes; the test split's asked names never occur in the train split.
#   tests/cli_long_records.sh COMB_BINARY ESSAYS_DIR
set -euo pipefail
comb=$1
essays=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
for split in train test; do
  "$comb" make-data --kind long-records --essays "$essays" --split $split --items 60 --seed 2 \
    --out "$work/$split.jsonl" 2>/dev/null
done
"$comb" make-data --kind long-records --essays "$essays" --split test --items 60 --seed 2 --out "$work/again.jsonl" 2>/dev/null
cmp -s "$work/test.jsonl" "$work/again.jsonl" || fail "the same seed gave other items"
python3 - "$work/train.jsonl" "$work/test.jsonl" <<'PY'
import json, re, sys
asked = {}
holders = {1: 0, 2: 0}
for path in sys.argv[1:]:
    split = "train" if path.endswith("train.jsonl") else "test"
    names = set()
    for line in open(path):
        item = json.loads(line)
        docs = item["documents"]
        assert 12 <= len(docs) <= 24, f"{item['id']}: {len(docs)} documents"
        name = re.search(r"(?:was|does) (\w+ \w+) (?:born|work|play)", item["question"]).group(1)
        names.add(name)
        holding = [d for d, doc in enumerate(docs) if f"Record: {name}." in doc["text"]]
        assert len(holding) in (1, 2), f"{item['id']}: {len(holding)} files hold the asked record"
        assert item["gold_index"] == holding[0], f"{item['id']}: gold {item['gold_index']}, holders {holding}"
        record = next(s for s in docs[holding[0]]["text"].split("\n\n") if s.startswith(f"Record: {name}."))
        assert any(a in record for a in item["answers"]), f"{item['id']}: the record does not hold {item['answers']}"
        assert sum(doc["text"].count("Record: ") for doc in docs) == 8 + len(holding) - 1, item["id"]
        holders[len(holding)] += 1
    asked[split] = names
assert not asked["train"] & asked["test"], f"asked in both splits: {asked['train'] & asked['test']}"
assert holders[1] > 0 and holders[2] > 0, holders
print(f"long records: 120 items checked, {holders[1]} with one file holding the answer, {holders[2]} with two")
PY
if out=$("$comb" make-data --kind long-records --essays "$essays" --records 12 --out "$work/x.jsonl" 2>&1); then
  fail "12 records among 12 files were accepted"
fi
case "$out" in *"--records 12: needs 2 to --min-docs - 1 (11)"*) ;; *) fail "too many records: $out" ;; esac
[ ! -e "$work/x.jsonl" ] || fail "a refused call left a file"
