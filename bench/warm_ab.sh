#!/usr/bin/env bash
# Two caching methods' TTFT on the same items, alternated in rounds so that the machine's drift
# falls on both: each round runs A then B (every item cold, then warm, as `comb eval` does), and
# the table gives each round's p50s and their ratio B / A, then the median ratio over the rounds.
# On a shared machine one run of each, minutes apart, can differ by 10% from load alone.
#
#   bench/warm_ab.sh DATA N OUTDIR ROUNDS [A B]      (default A = naive, B = comb)
#
# Environment: THREADS (default 2), EVAL_ARGS (more comb eval options), COMB_BUILD_DIR.
# Per-item files: OUTDIR/<method>.<round>.jsonl; a round whose two files are complete is not run again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
comb="${COMB_BUILD_DIR:-$root/build}/comb"
[ $# -ge 4 ] || { echo "usage: $0 DATA N OUTDIR ROUNDS [A B]" >&2; exit 2; }
data=$1 n=$2 outdir=$3 rounds=$4 a=${5:-naive} b=${6:-comb}
[ -f "$data" ] || { echo "$0: no data file '$data'" >&2; exit 1; }
[ -x "$comb" ] || { echo "$0: no comb binary at '$comb' (run scripts/build.sh)" >&2; exit 1; }
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "$0: ROUNDS must be a positive number, found '$rounds'" >&2; exit 2; }
mkdir -p "$outdir"
p50() {  # FILE KEY: the p50 comb report gives for it
  "$comb" report "$1" | sed -n "s/.*\"$2\":\([0-9.]*\).*/\1/p"
}
echo "| round | $a cold p50 (ms) | $b cold p50 (ms) | cold $b / $a | $a warm p50 (ms) | $b warm p50 (ms) | warm $b / $a |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
cold_ratios=() warm_ratios=()
for r in $(seq 1 "$rounds"); do
  for m in "$a" "$b"; do
    file="$outdir/$m.$r.jsonl"
    if [ -f "$file" ] && [ "$(wc -l < "$file")" -ge "$n" ]; then continue; fi
    echo "[warm_ab] round $r: $m ($n items of $(basename "$data"))" >&2
    # shellcheck disable=SC2086
    "$comb" eval --method "$m" --data "$data" --limit "$n" --threads "${THREADS:-2}" --out "$file" ${EVAL_ARGS:-} \
      >/dev/null
  done
  ac=$(p50 "$outdir/$a.$r.jsonl" ttft_cold_ms_p50) bc=$(p50 "$outdir/$b.$r.jsonl" ttft_cold_ms_p50)
  aw=$(p50 "$outdir/$a.$r.jsonl" ttft_warm_ms_p50) bw=$(p50 "$outdir/$b.$r.jsonl" ttft_warm_ms_p50)
  cr=$(awk -v x="$bc" -v y="$ac" 'BEGIN { printf "%.3f", x / y }')
  wr=$(awk -v x="$bw" -v y="$aw" 'BEGIN { printf "%.3f", x / y }')
  cold_ratios+=("$cr") warm_ratios+=("$wr")
  printf "| %d | %.0f | %.0f | %s | %.0f | %.0f | %s |\n" "$r" "$ac" "$bc" "$cr" "$aw" "$bw" "$wr"
done
median() { printf "%s\n" "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo
echo "median over $rounds rounds: cold $b / $a $(median "${cold_ratios[@]}"), warm $b / $a $(median "${warm_ratios[@]}")"
