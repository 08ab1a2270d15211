#!/usr/bin/env bash
# comb serve against llama.cpp's llama-server on the same traffic, in one run.
#   bench/peer_serve.sh DATA [DURATION] [PEER_RATES] [COMB_RATES] [ITEMS]
# DATA: QA items (nq-multidoc-10.dev.jsonl.gz); the first ITEMS (default 20) are the document pool.
# llama-server is built once from the llama-cpp-python 0.3.36 source distribution (its
# vendor/llama.cpp, native CPU build, no web UI) into .peer/ (ignored by git): the download is
# the set-up's, never the benchmark's. Both servers load the same GGUF file (the default model) with
# THREADS (default 2) threads, one after the other, never together.
#
# The traffic is comb loadgen's: Poisson arrivals, each request one item's question over its
# documents in a shuffled order (retrieval-augmented generation), 16 greedy tokens, streamed.
# llama-server gets the documents written into the user message (the text of comb's QA prompt,
# loadgen --documents prompt) and keeps its prompt cache with --cache-reuse (chunks of
# a cached prompt reused at other positions by shifting their K/V); comb gets them as documents and
# serves them with each caching method. Each server or method first sends every item once, then
# each rate for DURATION seconds (default 30). PEER_CACHE_REUSE (default 256) sets --cache-reuse;
# SERVERS=llama-server or SERVERS=comb runs one side. Prints loadgen's table per server and method, and the
# peak resident memory of each server (VmHWM) with its context: llama-server -c 32768 -np 16
# (16 slots of 2,048 tokens), comb serve with its defaults (16 running, a 1 GiB K/V pool).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
data=${1:?usage: bench/peer_serve.sh DATA [DURATION] [PEER_RATES] [COMB_RATES] [ITEMS]}
duration=${2:-30}
peer_rates=${3:-0.25,0.5,1}
comb_rates=${4:-0.5,1,2,3}
items=${5:-20}
threads=${THREADS:-2}
methods=${METHODS:-prefix,naive,epic,cacheblend,comb}
reuse=${PEER_CACHE_REUSE:-256}   # llama-server --cache-reuse: the shortest chunk it shifts into place
servers=${SERVERS:-llama-server,comb}
comb=${COMB_BUILD_DIR:-$root/build}/comb
[ -x "$comb" ] || { echo "$0: no comb binary at '$comb' (run scripts/build.sh)" >&2; exit 1; }
model=$(grep -o 'COMB_DEFAULT_MODEL:FILEPATH=.*' "${COMB_BUILD_DIR:-$root/build}/CMakeCache.txt" | cut -d= -f2)
peer=$root/.peer
version=0.3.36
server_bin=$peer/build/bin/llama-server
if [ ! -x "$server_bin" ]; then
  echo "[peer] building llama-server from llama-cpp-python $version (native CPU build, a few minutes)" >&2
  mkdir -p "$peer"
  if [ ! -d "$peer/llama_cpp_python-$version" ]; then
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$version" -d "$peer"
    tar -xzf "$peer/llama_cpp_python-$version.tar.gz" -C "$peer"
  fi
  cmake -S "$peer/llama_cpp_python-$version/vendor/llama.cpp" -B "$peer/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
  cmake --build "$peer/build" --target llama-server -j"$(nproc)" >/dev/null
fi
dir=$(mktemp -d)
server=
stop() { [ -n "$server" ] && { kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }; server=; }
trap 'stop; rm -rf "$dir"' EXIT
free_port() {  # a loopback port nothing listens on
  local p
  while :; do
    p=$((20000 + RANDOM % 20000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
}
peak() { grep VmHWM "/proc/$1/status" | awk '{printf "%.0f MiB", $2 / 1024}'; }

if [[ ,$servers, == *,llama-server,* ]]; then
  port=$(free_port)
  "$server_bin" -m "$model" -t "$threads" -tb "$threads" -c 32768 -np 16 --cache-reuse "$reuse" --no-webui \
    --host 127.0.0.1 --port "$port" >"$dir/peer.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { tail -20 "$dir/peer.log" >&2; exit 1; }
  echo "== llama-server (llama.cpp from llama-cpp-python $version), -t $threads -c 32768 -np 16 --cache-reuse $reuse"
  "$comb" loadgen --port "$port" --data "$data" --items "$items" --documents prompt --methods llama-server \
    --rates "$peer_rates" --duration "$duration" --max-tokens 16
  echo "llama-server peak resident memory: $(peak "$server")"
  stop
fi
[[ ,$servers, == *,comb,* ]] || exit 0

# comb serve, its defaults
"$comb" serve --port 0 --port-file "$dir/port" --threads "$threads" --max-queued 1024 --log-requests 0 \
  2>"$dir/comb.log" &
server=$!
for _ in $(seq 1 600); do [ -f "$dir/port" ] && break; sleep 0.1; done
[ -f "$dir/port" ] || { cat "$dir/comb.log" >&2; exit 1; }
echo "== comb serve (defaults), --threads $threads"
first=1
for m in ${methods//,/ }; do
  rates=$comb_rates
  [ "$m" = prefix ] && rates=$peer_rates
  "$comb" loadgen --port "$(cat "$dir/port")" --data "$data" --items "$items" --methods "$m" --rates "$rates" \
    --duration "$duration" --max-tokens 16 | if [ $first = 1 ]; then cat; else tail -n +2; fi
  first=0
done
echo "comb serve peak resident memory: $(peak "$server")"
