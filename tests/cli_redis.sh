#!/usr/bin/env bash
# Two processes share document caches through one Redis (redis-server started here on a free
# loopback port with a throw-away directory): the second's documents come from Redis and its answer
# is the first's, token for token; with Redis stopped a request still succeeds from its own tiers;
# with Redis back, sharing resumes.
#   tests/cli_redis.sh COMB_BINARY REDIS_SERVER DOCUMENT...
set -euo pipefail
comb=$1 redis=$2
shift 2
docs=()
for d in "$@"; do docs+=(--document "$d"); done
work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=$((20000 + RANDOM % 40000))
while ! port_free "$port"; do port=$((port + 1)); done
start_redis() {
  "$redis" --port "$port" --bind 127.0.0.1 --dir "$work" --save "" --appendonly no --logfile "$work/redis.log" &
  pid=$!
  for _ in $(seq 200); do port_free "$port" || return 0; sleep 0.05; done
  fail "redis-server did not start on port $port"
}
stop_redis() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }
url="redis://127.0.0.1:$port/0"
ask() {  # ask NAME: one process, its answer's tokens in NAME.tokens, its stderr in NAME.err
  "$comb" generate "${docs[@]}" --cache-url "$url" --prompt "What is the capital of France?" --max-tokens 16 \
    --json >"$work/$1.json" 2>"$work/$1.err" || { cat "$work/$1.err" >&2; fail "$1: comb generate failed"; }
  grep -o '"tokens":\[[0-9,]*\]' "$work/$1.json" >"$work/$1.tokens" || fail "$1: no tokens in its output"
  echo "$1: $(grep -o '[0-9]* from the cache.*' "$work/$1.err")"
}
n=$#

start_redis
ask first
grep -q "0 from the cache, $n encoded" "$work/first.err" || fail "first: expected every document encoded"
ask second
grep -q "$n from the cache, 0 encoded.*($n from Redis)" "$work/second.err" || fail "second: expected every document from Redis"
cmp -s "$work/first.tokens" "$work/second.tokens" || fail "second: another answer than the first's"

stop_redis
ask offline
grep -q "0 from the cache, $n encoded" "$work/offline.err" || fail "offline: expected the documents encoded"
grep -q "Redis at 127.0.0.1:$port/0 failed" "$work/offline.err" || fail "offline: expected one warning about Redis"
cmp -s "$work/first.tokens" "$work/offline.tokens" || fail "offline: another answer"

start_redis  # empty: it saved nothing
ask again
grep -q "0 from the cache, $n encoded" "$work/again.err" || fail "again: expected the documents encoded"
ask shared
grep -q "$n from the cache, 0 encoded.*($n from Redis)" "$work/shared.err" || fail "shared: expected the documents from Redis"
cmp -s "$work/first.tokens" "$work/shared.tokens" || fail "shared: another answer"
echo "PASS: $n documents shared through Redis, the same answer in every process"
