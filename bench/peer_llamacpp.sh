#!/usr/bin/env bash
# llama.cpp against comb on the default model's GGUF file (bench/peer_llamacpp.py). llama-cpp-python
# is installed for this benchmark alone, in .venv-peer (built from source for this CPU: a few
# minutes the first time), never in the project's environment.
#   bench/peer_llamacpp.sh [--quantize gguf|none] [--threads 1,2] [--rounds 2] ...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${COMB_PEER_VENV:-$root/.venv-peer}
comb="${COMB_BUILD_DIR:-$root/build}/comb"
[ -x "$comb" ] || { echo "$0: no comb binary at '$comb' (run scripts/build.sh)" >&2; exit 1; }
if ! "$peer/bin/python" -c 'import llama_cpp' 2>/dev/null; then
  echo "[peer] installing llama-cpp-python 0.3.36 into $peer (compiled for this CPU)" >&2
  python3 -m venv "$peer"
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$peer/bin/pip" install -q --disable-pip-version-check llama-cpp-python==0.3.36
fi
model=$(grep -o 'COMB_DEFAULT_MODEL:FILEPATH=.*' "${COMB_BUILD_DIR:-$root/build}/CMakeCache.txt" | cut -d= -f2)
exec "$peer/bin/python" "$root/bench/peer_llamacpp.py" --comb "$comb" --model "$model" "$@"
