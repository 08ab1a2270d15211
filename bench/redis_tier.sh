#!/usr/bin/env bash
# Cold, Redis-warm and locally warm TTFT of per-document caching methods, and the bytes per cached
# token each leaves in Redis. A redis-server is started here on a free loopback port (nothing saved).
#
#   bench/redis_tier.sh DATA N [METHOD...]        (default methods: naive comb)
#
# Per method, on the first N items of DATA (comb eval, greedy, --priming auto):
#   run 1 (Redis emptied first): its cold TTFT is cold (nothing cached anywhere; a document an
#         earlier item already wrote to Redis is counted in "reused cold"); every document it
#         computes is written to Redis in the background;
#   run 2 (a new process, the same items): its local tiers start empty, so its cold TTFT is
#         Redis-warm (documents from Redis), and its warm TTFT is locally warm (host memory).
# Environment: THREADS (per process, default 2), OUT (directory for the per-item files, default a
# temporary one), COMB_BUILD_DIR, and extra comb eval options in EVAL_ARGS (e.g. "--plugin FILE").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
comb="${COMB_BUILD_DIR:-$root/build}/comb"
[ $# -ge 2 ] || { echo "usage: $0 DATA N [METHOD...]" >&2; exit 2; }
data=$1 n=$2
shift 2
methods=("$@")
[ ${#methods[@]} -gt 0 ] || methods=(naive comb)
[ -x "$comb" ] || { echo "$0: no comb binary at '$comb' (run scripts/build.sh)" >&2; exit 1; }
[ -f "$data" ] || { echo "$0: no data file '$data'" >&2; exit 1; }
command -v redis-server >/dev/null && command -v redis-cli >/dev/null ||
  { echo "$0: needs redis-server and redis-cli (scripts/setup.sh installs them)" >&2; exit 1; }
threads=${THREADS:-2}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=$((20000 + RANDOM % 40000))
while ! port_free "$port"; do port=$((port + 1)); done
redis-server --port "$port" --bind 127.0.0.1 --dir "$work" --save "" --appendonly no --logfile "$work/redis.log" &
pid=$!
for _ in $(seq 200); do port_free "$port" || break; sleep 0.05; done
cli=(redis-cli -p "$port")
url="redis://127.0.0.1:$port/0"
field() { grep -o "\"$1\":[-0-9.e+]*" | head -1 | cut -d: -f2; }
median_of() {  # median_of FILE FIELD: the median of FIELD over FILE's lines
  grep -o "\"$2\":[-0-9.e+]*" "$1" | cut -d: -f2 | sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'
}
mean_of() { grep -o "\"$2\":[-0-9.e+]*" "$1" | cut -d: -f2 | awk '{s+=$1} END {printf "%.1f", s/NR}'; }

printf '| method | cold p50 (ms) | Redis-warm p50 (ms) | locally warm p50 (ms) | Redis-warm / locally warm | computed tokens: cold, Redis-warm, locally warm | reused cold (run 1) | bytes/token (entry) | bytes/token (Redis memory) |\n'
printf '|---|---:|---:|---:|---:|---|---:|---:|---:|\n'
for m in "${methods[@]}"; do
  "${cli[@]}" flushall >/dev/null
  for run in 1 2; do
    echo "[bench] $m run $run: $n items" >&2
    # shellcheck disable=SC2086
    "$comb" eval --method "$m" --data "$data" --limit "$n" --threads "$threads" --cache-url "$url" \
      --out "$out/$m.run$run.jsonl" ${EVAL_ARGS:-} >&2
  done
  r1=$out/$m.run1.jsonl r2=$out/$m.run2.jsonl
  cold=$(median_of "$r1" ttft_cold_ms) rwarm=$(median_of "$r2" ttft_cold_ms) lwarm=$(median_of "$r2" ttft_warm_ms)
  bpt=$(field cache_bytes_per_token <"$r1")
  # Every entry in Redis: its value's length (header + payload) and Redis's memory for the key.
  strlen=0 mem=0 tokens=0
  while read -r k; do
    l=$("${cli[@]}" strlen "$k") u=$("${cli[@]}" memory usage "$k")
    strlen=$((strlen + l)) mem=$((mem + u))
    tokens=$(awk -v a="$tokens" -v l="$l" -v b="$bpt" 'BEGIN {printf "%d", a + (l - 72) / b}')
  done < <("${cli[@]}" --scan --pattern 'comb:kv:*')
  printf '| %s | %.0f | %.0f | %.0f | %.2f | %s, %s, %s | %s | %.0f | %.0f |\n' "$m" "$cold" "$rwarm" "$lwarm" \
    "$(awk -v a="$rwarm" -v b="$lwarm" 'BEGIN {print a / b}')" \
    "$(mean_of "$r1" computed_tokens_cold)" "$(mean_of "$r2" computed_tokens_cold)" "$(mean_of "$r2" computed_tokens_warm)" \
    "$(mean_of "$r1" reused_tokens_cold)" \
    "$(awk -v s="$strlen" -v t="$tokens" 'BEGIN {print s / t}')" "$(awk -v s="$mem" -v t="$tokens" 'BEGIN {print s / t}')"
done
echo "[bench] per-item files in $out; computed tokens are means over the items" >&2
