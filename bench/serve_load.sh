#!/usr/bin/env bash
# comb serve under Poisson load: COMB against prefix caching on the same server, in one run.
#   bench/serve_load.sh DATA [DURATION] [PREFIX_RATES] [COMB_RATES] [ITEMS]
# DATA: QA items (nq-multidoc-10.dev.jsonl.gz); their documents are the shared pool (the first
# ITEMS items, default 20). Each method first sends every item once (the caches a running server
# has), then each rate for DURATION seconds (default 60). Prints comb loadgen's table per method.
# The document store and the prefix cache hold 4 GiB each (CACHE_MB): the pool of 200 documents
# (1.4 GB of encoder K/V) fits; THREADS (default 2); SERVE_ARGS: more options of comb serve
# (say "--cpu-kernels 0 --mixed-step 0").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
data=${1:?usage: bench/serve_load.sh DATA [DURATION] [PREFIX_RATES] [COMB_RATES] [ITEMS]}
duration=${2:-60}
prefix_rates=${3:-0.25,0.5,0.75}
comb_rates=${4:-1,2,3,4}
items=${5:-20}
comb=${COMB_BUILD_DIR:-$root/build}/comb
dir=$(mktemp -d)
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -rf "$dir"' EXIT
"$comb" serve --port 0 --port-file "$dir/port" --threads "${THREADS:-2}" --max-queued 1024 --log-requests 0 \
  --cache-mb "${CACHE_MB:-4096}" ${SERVE_ARGS:-} \
  2>"$dir/server.log" &
server=$!
for _ in $(seq 1 600); do [ -f "$dir/port" ] && break; sleep 0.1; done
[ -f "$dir/port" ] || { cat "$dir/server.log" >&2; exit 1; }
port=$(cat "$dir/port")
head -n 2 "$dir/server.log" >&2
"$comb" loadgen --port "$port" --data "$data" --items "$items" --methods prefix --rates "$prefix_rates" \
  --duration "$duration" --max-tokens 16
"$comb" loadgen --port "$port" --data "$data" --items "$items" --methods comb --rates "$comb_rates" \
  --duration "$duration" --max-tokens 16 | tail -n +2
