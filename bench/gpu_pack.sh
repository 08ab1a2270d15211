#!/usr/bin/env bash
# Packs what bench/gpu_check.sh needs on a GPU machine that has python3 with torch and transformers
# but neither this project's build nor its Debian libraries, from a build made here:
#   bench/gpu_pack.sh DIR        (after scripts/build.sh and `ctest -R oracle`; DIR: e.g. .gpu)
# then, on the GPU machine, from a copy of the repository with DIR beside it:
#   bash DIR/run.sh OUT_DIR [STEPS]     (STEPS: gpu_check.sh's, in the order to run, default "1 2 ... 12";
#                                        COMB_GPU_DEADLINE_S: gpu_check.sh's; the results: OUT_DIR/gpu-check.tgz)
# DIR gets bin/ (comb, comb_tests), lib/ (libcomb*, and the libraries they link that a bare machine
# may lack; run.sh puts only those it does not find there on the library path), tokenizer/ (the
# default model's), greedy/ (bench/greedy_answers.sh's inputs: the tests' tiny random Llama stored
# bfloat16 with the default model's chat template, 4 code-word items, three fresh plug-ins, and
# the answers on this CPU in float32), items.jsonl (the first 20 items of $COMB_DATA's
# nq-multidoc-10.dev, the caching methods' data), torch-version.txt (the LibTorch it was built
# against: run.sh refuses another), gpu_env.sh (run.sh's environment) and run.sh. About 37 MB.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:?usage: bench/gpu_pack.sh DIR}
build=${COMB_BUILD_DIR:-$root/build}
py=${COMB_VENV:-$root/.venv}/bin/python
data=${COMB_DATA:-$root/../shared/data}/nq-multidoc-10.dev.jsonl.gz
tiny=$build/oracle/tiny-llama
for f in "$build/comb" "$build/tests/comb_tests" "$tiny/config.json" "$data"; do
  [ -e "$f" ] || { echo "gpu_pack: $f is missing (scripts/build.sh, ctest -R oracle, COMB_DATA)" >&2; exit 1; }
done
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
rm -rf "$dir/tokenizer" "$dir/greedy"
mkdir -p "$dir/greedy/plugins"
say() { echo "[gpu_pack] $*" >&2; }
# shellcheck source=gpu_env.sh
source "$root/bench/gpu_env.sh"

say "binaries and libraries"
PY=$py gpu_pack_binaries "$dir" "$build" "$build/comb" "$build/tests/comb_tests"
cp "$root/bench/gpu_env.sh" "$dir/"  # run.sh's environment, of the same version as the pack

say "the default model's tokenizer"
"$py" "$root/bench/export_tokenizer.py" "$dir/tokenizer" >/dev/null

say "the greedy check's inputs"
mkdir -p "$dir/greedy/model"
cp "$tiny"/*.json "$dir/greedy/model/"
"$py" - "$tiny" "$dir/greedy/model" <<'EOF'
import sys, glob, os
from safetensors.torch import load_file, save_file
import torch
src, out = sys.argv[1], sys.argv[2]
for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
    t = {k: v.to(torch.bfloat16) for k, v in load_file(f).items()}
    path = os.path.join(out, os.path.basename(f))
    save_file(t, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
EOF
cp "$dir/tokenizer"/tokenizer_config.json "$dir/tokenizer"/chat_template.* "$dir/greedy/model/"  # the chat template
"$build/comb" make-data --split test --items 4 --seed 7 --out "$dir/greedy/items.jsonl" >/dev/null
"$build/comb" plugin init --model "$dir/greedy/model" --init reads --cross-layers 0,1,2 \
  --out "$dir/greedy/plugins/reads.safetensors" >/dev/null
"$build/comb" plugin init --model "$dir/greedy/model" --init joint --cross-layers 0,1,2 \
  --out "$dir/greedy/plugins/joint.safetensors" >/dev/null
"$build/comb" plugin init --model "$dir/greedy/model" --init joint --cross-layers 0,1,2 --consecutive-documents 1 \
  --out "$dir/greedy/plugins/joint-consecutive.safetensors" >/dev/null
say "the greedy answers on this CPU (float32)"
COMB_BIN=$build/comb bash "$root/bench/greedy_answers.sh" "$dir/greedy" cpu float32 > "$dir/greedy/cpu-float32.txt"
if grep -q FAILED "$dir/greedy/cpu-float32.txt"; then
  say "a method failed on the CPU:"; grep FAILED "$dir/greedy/cpu-float32.txt" >&2; exit 1
fi

say "the caching methods' items"
"$py" - "$data" "$dir/items.jsonl" <<'EOF'
import gzip, sys
with gzip.open(sys.argv[1], "rt") as f, open(sys.argv[2], "w") as out:
    for i, line in enumerate(f):
        if i == 20:
            break
        out.write(line)
EOF

cat > "$dir/run.sh" <<'EOF'
#!/usr/bin/env bash
# bench/gpu_pack.sh's folder run on a GPU machine, from the repository root:
#   [COMB_GPU_DEADLINE_S=N] bash DIR/run.sh OUT_DIR [STEPS]
# Every file the steps write (and this summary, summary.txt) lands in one archive,
# OUT_DIR/gpu-check.tgz, remade after every step: what finished steps wrote survives a kill. The
# files themselves are in /tmp/comb-gpu/out (made anew at each call), the models beside them.
set -uo pipefail
pack=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: DIR/run.sh OUT_DIR [STEPS]}
[ -f bench/gpu_check.sh ] || { echo "run it from the repository root (bench/gpu_check.sh not found)"; exit 1; }
source "$pack/gpu_env.sh"
gpu_env "$pack" || exit 1
mkdir -p "$out"
out=$(cd "$out" && pwd)
files=/tmp/comb-gpu/out
rm -rf "$files" && mkdir -p "$files"
COMB_GPU_TAR=$out/gpu-check.tgz COMB_BIN=$pack/bin/comb COMB_TESTS=$pack/bin/comb_tests \
  COMB_GPU_CHECK_STEPS=${2:-1 2 3 4 5 6 7 8 9 10 11 12} \
  bash bench/gpu_check.sh "$pack/tokenizer" "$pack/greedy" "$pack/items.jsonl" "$files" /tmp/comb-gpu 2>&1 |
  tee "$files/summary.txt"
tar -czf "$out/gpu-check.tgz.part" -C "$files" . && mv -f "$out/gpu-check.tgz.part" "$out/gpu-check.tgz"
EOF
chmod +x "$dir/run.sh"
say "$dir: $(du -sh "$dir" | cut -f1)"
