#!/usr/bin/env bash
# Measures one table of docs/evaluation.md: every method over the first N items of one data file,
# in chunks of items (comb eval --offset), so that a stopped run resumes where it stopped and the
# table can be measured across several sittings. Chunks already complete in OUTDIR are skipped.
#
#   scripts/eval_table.sh DATA N OUTDIR [METHOD...]
#
# Environment: CHUNK (items per chunk, default 10), WORKERS (processes, default 1), THREADS (per
# process, default: cores / workers), and PAUSE_FILE: worker 2 and up wait between chunks while
# that file exists (room for a build); PLUGIN, the plug-in file for the method comb, and LABEL, its
# rows' --label (a plug-in variant beside the shipped one's rows in one `comb report`; its chunks are
# files comb-LABEL.*, apart from another plug-in's); PRIMING,
# comb eval's --priming (default auto). Each worker is pinned to its own cores when taskset
# exists. One run per OUTDIR at a time.
# At the end, `comb report --data DATA` of the current build (not the table's copy) prints one
# summary line per method from all chunks, every stored prediction scored by the current rule.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
comb="${COMB_BUILD_DIR:-$root/build}/comb"
[ $# -ge 3 ] || { echo "usage: $0 DATA N OUTDIR [METHOD...]" >&2; exit 2; }
data=$1 n=$2 outdir=$3
shift 3
methods=("$@")
[ ${#methods[@]} -gt 0 ] || methods=(full prefix naive epic cacheblend)
[ -f "$data" ] || { echo "$0: no data file '$data'" >&2; exit 1; }
[ -x "$comb" ] || { echo "$0: no comb binary at '$comb' (run scripts/build.sh)" >&2; exit 1; }
if [ -n "${LABEL:-}" ] && ! [[ "$LABEL" =~ ^[A-Za-z0-9._-]{1,64}$ ]]; then
  echo "$0: LABEL should be up to 64 letters, digits, '-', '_' or '.', found '$LABEL'" >&2; exit 1
fi
for m in "${methods[@]}"; do
  if [ "$m" = comb ] && [ ! -f "${PLUGIN:-}" ]; then
    echo "$0: the method comb needs PLUGIN=FILE (a plug-in), found '${PLUGIN:-}'" >&2; exit 1
  fi
done
# One table, one build: the first run copies the comb binary and its libraries (libcomb,
# libcomb_core, and libcomb_cuda where the build has it: libcomb_core loads it from its own folder)
# into OUTDIR/.bin, and every resumption measures with those copies (the libraries found through
# LD_LIBRARY_PATH, which comes before the binary's run path), so a rebuild between sittings cannot
# mix two builds in one table.
mkdir -p "$outdir"
bin=$(cd "$outdir" && pwd)/.bin
build=$(dirname "$comb")
required=(libcomb.so.0 libcomb_core.so.0)
libs=("${required[@]}")
[ -f "$build/libcomb_cuda.so" ] && libs+=(libcomb_cuda.so)
if [ -x "$bin/comb" ]; then
  for l in "${required[@]}"; do
    [ -f "$bin/$l" ] || { echo "$0: $bin holds a comb binary without $l (copied by an older version of this script, or cut short): delete $bin to measure the rest of the table with the current build" >&2; exit 1; }
  done
  echo "[table] measuring with the build this table started with, in $bin (delete it to use a new build)" >&2
else
  for l in "${libs[@]}"; do
    [ -f "$build/$l" ] || { echo "$0: no library '$l' beside '$comb'" >&2; exit 1; }
  done
  mkdir -p "$bin"
  for l in "${libs[@]}"; do cp -L "$build/$l" "$bin/$l.part"; done
  cp "$comb" "$bin/comb.part"
  for l in "${libs[@]}"; do mv "$bin/$l.part" "$bin/$l"; done
  mv "$bin/comb.part" "$bin/comb"
  echo "[table] measuring with a copy of $comb and its libraries in $bin" >&2
fi
current=$comb current_ld=${LD_LIBRARY_PATH:-}
comb=$bin/comb
export LD_LIBRARY_PATH=$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
chunk=${CHUNK:-10} workers=${WORKERS:-1}
cores=$(nproc)
threads=${THREADS:-$(( cores / workers > 0 ? cores / workers : 1 ))}
name=$(basename "$data"); name=${name%.gz}; name=${name%.jsonl}

# The work list: chunks in item order, every method at each offset, so that a run stopped early
# leaves all methods on the same items.
queue="$outdir/.queue"
: > "$queue"
for ((off = 0; off < n; off += chunk)); do
  len=$(( n - off < chunk ? n - off : chunk ))
  for m in "${methods[@]}"; do
    tag=$m
    [ "$m" = comb ] && [ -n "${LABEL:-}" ] && tag=comb-$LABEL
    f="$outdir/$tag.$name.$(printf %05d "$off").jsonl"
    if [ -f "$f" ] && [ "$(wc -l < "$f")" -eq "$len" ]; then continue; fi
    echo "$m $off $len $f" >> "$queue"
  done
done
echo "[table] $name: $(wc -l < "$queue") chunks of $chunk items to run, $workers worker(s) x $threads thread(s)" >&2

worker() {
  local w=$1 pin=""
  if command -v taskset > /dev/null && [ "$workers" -gt 1 ]; then
    pin="taskset -c $(( (w - 1) * threads ))-$(( w * threads - 1 ))"
  fi
  while :; do
    while [ "$w" -gt 1 ] && [ -n "${PAUSE_FILE:-}" ] && [ -e "$PAUSE_FILE" ]; do sleep 5; done
    local job
    job=$(flock "$queue" bash -c 'head -n 1 "$0"; sed -i 1d "$0"' "$queue")
    [ -n "$job" ] || return 0
    read -r m off len f <<< "$job"
    echo "[table] worker $w: $m items $off..$(( off + len - 1 ))" >&2
    local extra=()
    [ "$m" = comb ] && extra=(--plugin "$PLUGIN" ${LABEL:+--label "$LABEL"})
    $pin "$comb" eval --method "$m" "${extra[@]}" --priming "${PRIMING:-auto}" --data "$data" --offset "$off" --limit "$len" --threads "$threads" \
      --out "$f.part" > /dev/null 2> "$f.log" || { echo "[table] $m at $off failed: see $f.log" >&2; return 1; }
    mv "$f.part" "$f"
  done
}

pids=()
for ((w = 1; w <= workers; ++w)); do worker "$w" & pids+=($!); done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ $status -eq 0 ] || exit $status
LD_LIBRARY_PATH=$current_ld "$current" report --data "$data" "$outdir"/*."$name".[0-9]*.jsonl
