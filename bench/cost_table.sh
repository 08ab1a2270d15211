#!/usr/bin/env bash
# What each caching method costs on one data file, measured in one run on this machine: accuracy,
# TTFT cold and warm (p50), tokens computed warm, bytes the store holds per document token.
# Methods run one after another (never side by side), each a new `comb eval` process, so that the
# times compare within the table.
#
#   bench/cost_table.sh DATA N OUTDIR [VARIANT...]
#
# A variant is a method (full, prefix, naive, epic, cacheblend, comb; its cache dtype auto: the
# decoder's K/V as computed, a plug-in's documents in the dtype it declares) or a method and a
# cache dtype (comb:float32, comb:bfloat16, naive:int8, ...). Default: full naive comb comb:float32.
# Environment: THREADS (default 2), EVAL_ARGS (more comb eval options, e.g. "--plugin FILE"),
# COMB_BUILD_DIR. Per-item files: OUTDIR/<variant>.jsonl; a variant whose file has N lines is
# not run again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
comb="${COMB_BUILD_DIR:-$root/build}/comb"
[ $# -ge 3 ] || { echo "usage: $0 DATA N OUTDIR [VARIANT...]" >&2; exit 2; }
data=$1 n=$2 outdir=$3
shift 3
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(full naive comb comb:float32)
[ -f "$data" ] || { echo "$0: no data file '$data'" >&2; exit 1; }
[ -x "$comb" ] || { echo "$0: no comb binary at '$comb' (run scripts/build.sh)" >&2; exit 1; }
mkdir -p "$outdir"
for v in "${variants[@]}"; do
  method=${v%%:*} dtype=auto
  [ "$v" != "$method" ] && dtype=${v#*:}
  file="$outdir/${v/:/.}.jsonl"
  if [ -f "$file" ] && [ "$(wc -l < "$file")" -ge "$n" ]; then
    echo "[cost] $v: $file is complete, not run again" >&2
    continue
  fi
  echo "[cost] $v ($n items of $(basename "$data"))" >&2
  # shellcheck disable=SC2086
  "$comb" eval --method "$method" --cache-dtype "$dtype" --data "$data" --limit "$n" --threads "${THREADS:-2}" \
    --out "$file" ${EVAL_ARGS:-} >/dev/null
done
echo "| variant | accuracy | same answer as full | TTFT cold p50 (ms) | TTFT warm p50 (ms) | tokens computed warm | bytes/token |"
echo "|---|---:|---:|---:|---:|---:|---:|"
full="$outdir/full.jsonl"
for v in "${variants[@]}"; do
  file="$outdir/${v/:/.}.jsonl"
  args=("$file")
  # comb report compares with full's answers when it reads full's file too (another method only).
  [ -f "$full" ] && [ "$v" != full ] && [ "${v%%:*}" != full ] && args=("$full" "$file")
  "$comb" report "${args[@]}" | awk -v v="$v" -v m="${v%%:*}" '
    index($0, "\"method\":\"" m "\"") {
      line = $0
      acc = get(line, "accuracy"); same = get(line, "same_answer_as_full")
      if (get(line, "compared_with_full") + 0 == 0) same = ""
      printf "| %s | %.1f%% | %s | %.0f | %.0f | %.1f | %.0f |\n", v, 100 * acc,
             same == "" ? "-" : sprintf("%.1f%%", 100 * same), get(line, "ttft_cold_ms_p50"),
             get(line, "ttft_warm_ms_p50"), get(line, "computed_tokens_warm_mean"), get(line, "cache_bytes_per_token")
    }
    function get(s, key,   i, rest) {
      i = index(s, "\"" key "\":"); if (!i) return ""
      rest = substr(s, i + length(key) + 3); sub(/[,}].*/, "", rest); return rest
    }'
done
