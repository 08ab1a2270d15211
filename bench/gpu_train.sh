#!/usr/bin/env bash
# A training run of the default model's plug-in on a GPU machine, from bench/gpu_train_pack.sh's
# parts, run from the repository root there:
#   bash bench/gpu_train.sh --stash DIR              a call before the last: keeps the parts it
#                                                    carried (in /tmp/comb-train-parts)
#   bash bench/gpu_train.sh DIR OUT_DIR [SECONDS]    the last call: joins the parts (checked against
#                                                    DIR/parts.txt's sha256), trains for at most
#                                                    SECONDS (default 420), writes to OUT_DIR
# What it trains (COMB_TRAIN_STEPS, default 150, sets the schedule's length; COMB_TRAIN_DEVICE,
# _DTYPE, _BATCH and _DEV_ITEMS change the device, cuda, the dtype, bfloat16, the batch, 16, and the
# dev items, 40, as for a short try on a CPU): the plug-in the pack
# holds (the shipped one), its caches read as int4 keeps them (--cache-dtype int4), on many long
# documents (long-records, 12-24 files) mixed with what the shipped plug-in learned from (records
# and code words, answers as sentences), gold answers as targets (on long records `full` itself
# reads 12%: its answers would teach its mistakes), 8 to 24 documents an example, batches of 16,
# learning rate 1e-4, the dev check on 40 long-records dev items every 50 steps.
# OUT_DIR gets plugin.safetensors (the last checkpoint, bfloat16, cache dtype int4), loss.csv,
# dev.csv and train.log; docs/training.md says how to measure the plug-in on the CPU.
set -uo pipefail
keep=/tmp/comb-train-parts
# Keeps DIR's parts that parts.txt names, each checked against its sha256; says which are still missing.
stash() {
  local dir=$1 name sum have=0
  [ -f "$dir/parts.txt" ] || { echo "$dir/parts.txt not found (carry it with each part)"; return 1; }
  mkdir -p "$keep"
  while read -r kind name sum; do
    [ "$kind" = part ] || continue
    have=$((have + 1))
    [ -f "$dir/$name" ] || continue
    [ "$(sha256sum "$dir/$name" | cut -d' ' -f1)" = "$sum" ] || { echo "part $name is damaged (sha256 differs)"; return 1; }
    cp "$dir/$name" "$keep/$name" || return 1
  done < "$dir/parts.txt"
  [ "$have" -gt 0 ] || { echo "$dir/parts.txt names no part"; return 1; }
  echo "kept: $(ls "$keep" | tr '\n' ' ')"
}
if [ "${1:-}" = --stash ]; then
  stash "${2:?usage: bench/gpu_train.sh --stash DIR}"
  exit
fi
dir=${1:?usage: bench/gpu_train.sh DIR OUT_DIR [SECONDS]}
out=${2:?usage: bench/gpu_train.sh DIR OUT_DIR [SECONDS]}
seconds=${3:-420}
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || { echo "SECONDS should be a number of seconds, found '$seconds'"; exit 1; }
# A call runs 10 minutes at most: joining, unpacking and converting take about a minute.
[ "$seconds" -le 500 ] || echo "warning: $seconds s of training and about 60 s around it may pass a call's 600 s"
[ -f bench/gpu_env.sh ] || { echo "run it from the repository root (bench/gpu_env.sh not found)"; exit 1; }
stash "$dir" || exit 1
mkdir -p "$out" && out=$(cd "$out" && pwd) || { echo "cannot make $out"; exit 1; }
parts=$(awk '$1 == "part" {print $2}' "$dir/parts.txt")
for p in $parts; do
  [ -f "$keep/$p" ] || { echo "part $p was not carried to this machine (bash bench/gpu_train.sh --stash DIR in a call that carries it)"; exit 1; }
done
archive=/tmp/comb-train.tgz x=/tmp/comb-train
(cd "$keep" && cat $parts) > "$archive"
want=$(awk '$1 == "sha256" {print $2}' "$dir/parts.txt")
got=$(sha256sum "$archive" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "the joined parts' sha256 is $got, parts.txt says $want"; exit 1; }
rm -rf "$x" && mkdir -p "$x" && tar -C "$x" -xzf "$archive" || { echo "the archive does not unpack"; exit 1; }
source bench/gpu_env.sh
gpu_env "$x" || exit 1
cd "$x" || exit 1
D=data
start=$(date +%s)
timeout -k 30 "$seconds" bin/comb train --model model.gguf --device "${COMB_TRAIN_DEVICE:-cuda}" \
  --dtype "${COMB_TRAIN_DTYPE:-bfloat16}" --plugin plugin.safetensors \
  --cache-dtype int4 --data $D/lr.train.jsonl.gz --data $D/rs7.jsonl.gz --data $D/rs8.jsonl.gz --data $D/cws.jsonl.gz \
  --kv-share 0 --needle-share 0 --targets gold --min-documents 8 --max-documents 24 --max-document-tokens 640 \
  --steps "${COMB_TRAIN_STEPS:-150}" --batch "${COMB_TRAIN_BATCH:-16}" --lr 1e-4 --warmup 10 --save-every 10 --log-every 5 --seed 41 \
  --dev "$D/lr.dev.jsonl:${COMB_TRAIN_DEV_ITEMS:-40}" --dev-every 50 --dev-tokens 24 --out trained.safetensors --dir run 2>&1 | tee "$out/train.log"
rc=${PIPESTATUS[0]}
case $rc in
  0) how="done" ;;
  124 | 137) how="stopped at the time limit" ;;
  *) how="failed (exit $rc)" ;;
esac
echo "[gpu_train] training $how after $(($(date +%s) - start)) s (limit $seconds)" | tee -a "$out/train.log"
for f in run/loss.csv run/dev.csv; do [ -f "$f" ] && cp "$f" "$out/"; done
[ -f run/checkpoint.safetensors ] || { echo "no checkpoint was written"; exit 1; }
# The last checkpoint (written whole, then renamed: a stop in the middle of a step leaves the one before).
bin/comb plugin convert --model model.gguf --plugin run/checkpoint.safetensors --save-dtype bfloat16 \
  --cache-dtype int4 --out "$out/plugin.safetensors" 2>&1 | tee -a "$out/train.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
case $rc in 0 | 124 | 137) exit 0 ;; *) exit "$rc" ;; esac
