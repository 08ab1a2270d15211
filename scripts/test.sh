#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (oracles included).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
COMB_SETUP_TESTS=1 bash "$root/scripts/build.sh"
ctest --test-dir "${COMB_BUILD_DIR:-$root/build}" --output-on-failure "$@"
