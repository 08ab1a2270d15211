#!/usr/bin/env bash
# comb report reads an eval --out file compressed (.jsonl.gz) as it reads it plain (.jsonl): the
# same output, byte for byte, as JSON lines and as a table; a gzip file cut short is refused.
#   cli_report_gz.sh COMB FILE...   (each FILE plain or gzip; the other form is made here)
set -euo pipefail
comb=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plain=() packed=()
for f in "$@"; do
  b=$(basename "$f" .gz)
  if [[ $f == *.gz ]]; then
    gzip -dc "$f" >"$tmp/$b"
    plain+=("$tmp/$b") packed+=("$f")
  else
    gzip -9c "$f" >"$tmp/$b.gz"
    plain+=("$f") packed+=("$tmp/$b.gz")
  fi
done
for opts in "" "--markdown"; do
  # shellcheck disable=SC2086
  want=$("$comb" report $opts "${plain[@]}")
  # shellcheck disable=SC2086
  got=$("$comb" report $opts "${packed[@]}")
  if [ "$want" != "$got" ]; then
    echo "FAIL: comb report $opts differs between the plain and the compressed files"
    diff <(echo "$want") <(echo "$got") || true
    exit 1
  fi
done
# A compressed file cut in half: refused, not read as fewer items.
size=$(stat -c %s "${packed[0]}")
head -c $((size / 2)) "${packed[0]}" >"$tmp/cut.jsonl.gz"
if "$comb" report "$tmp/cut.jsonl.gz" >/dev/null 2>"$tmp/err"; then
  echo "FAIL: a gzip file cut short was read"
  exit 1
fi
grep -q "damaged or cut short" "$tmp/err" || { cat "$tmp/err"; exit 1; }
echo "PASS: comb report reads ${#packed[@]} compressed files as their plain forms"
