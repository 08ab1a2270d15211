#!/usr/bin/env bash
# Installs what is missing, builds, and answers a question with the default model on the CPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh" >&2
"${COMB_BUILD_DIR:-$root/build}/comb" generate --threads "$(nproc)" \
  --prompt "${1:-In two sentences, why do retrieval-augmented LLMs benefit from caching the documents they read?}"
