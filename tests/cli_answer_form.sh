#!/usr/bin/env bash
# `make-data --answer-form sentence` writes the same items as the default form (documents,
# questions, ids, gold places: the same draws), with one more answer in front: a sentence that
# holds the short answer and ends with a full stop. Checked for codeword and records, both splits.
#   tests/cli_answer_form.sh COMB_BINARY
set -euo pipefail
comb=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
checked=0
for kind in codeword records; do
  for split in train test; do
    "$comb" make-data --kind $kind --split $split --seed 5 --items 40 --out "$work/short.jsonl" 2>/dev/null
    "$comb" make-data --kind $kind --split $split --seed 5 --items 40 --answer-form sentence \
      --out "$work/sentence.jsonl" 2>/dev/null
    [ "$(wc -l < "$work/sentence.jsonl")" -eq 40 ] || fail "$kind $split: expected 40 items"
    # The sentence removed from the answers, the two files must be the same bytes.
    sed -E 's/"answers":\["[^"]*",/"answers":[/' "$work/sentence.jsonl" > "$work/stripped.jsonl"
    cmp -s "$work/short.jsonl" "$work/stripped.jsonl" || fail "$kind $split: items differ beyond the sentence"
    while IFS= read -r line; do
      answers=$(printf '%s' "$line" | grep -oE '"answers":\["[^"]*","[^"]*"\]') || fail "$kind $split: two answers expected: $line"
      said=$(printf '%s' "$answers" | sed -E 's/"answers":\["([^"]*)","[^"]*"\]/\1/')
      short=$(printf '%s' "$answers" | sed -E 's/"answers":\["[^"]*","([^"]*)"\]/\1/')
      case "$said" in *"$short"*.) ;; *) fail "$kind $split: '$said' does not hold '$short' and end with a full stop" ;; esac
      checked=$((checked + 1))
    done < "$work/sentence.jsonl"
  done
done
if out=$("$comb" make-data --answer-form long --out "$work/x.jsonl" 2>&1); then fail "a bad --answer-form was accepted"; fi
case "$out" in *"--answer-form expects short or sentence, found 'long'"*) ;; *) fail "a bad --answer-form: $out" ;; esac
[ ! -e "$work/x.jsonl" ] || fail "a bad --answer-form left a file"
echo "answer forms: $checked items checked"
