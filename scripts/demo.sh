#!/usr/bin/env bash
# The multi-document QA demo: installs what is missing, builds, then answers a question over the
# documents in examples/documents with each caching method on the CPU (answer, time to first
# token cold and warm, tokens computed and reused).
#   scripts/demo.sh ["question"] [more comb qa options, e.g. --plugin FILE --methods full,comb]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh" comb_cli >&2  # the command-line tool alone: not the tests
question=${1:-Who first reached the deepest point of the Mariana Trench, and when?}
[ $# -gt 0 ] && shift
docs=()
for f in "$root"/examples/documents/*.txt; do docs+=(--document "$f"); done
exec "${COMB_BUILD_DIR:-$root/build}/comb" qa --threads "$(nproc)" "${docs[@]}" --question "$question" "$@"
