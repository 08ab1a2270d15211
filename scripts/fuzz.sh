#!/usr/bin/env bash
# Runs one fuzz target (libFuzzer, ASan and UBSan) for SECONDS on one core:
#   scripts/fuzz.sh TARGET SECONDS
# TARGET: gguf safetensors safetensors_index tokenizer_json tokenizer_config chat_template qa plugin
# store_entry serve_request. The first run configures a clang build in $COMB_FUZZ_BUILD_DIR (default build-fuzz/)
# and makes the seed corpora from real files (tests/fuzz/make_seeds.sh, with the regular build).
# New inputs go to build-fuzz/corpus/TARGET; a crash, leak or hang is written to
# build-fuzz/findings/TARGET/ (keep it in tests/fuzz/regressions/TARGET/ once fixed). The last line
# is a summary: target, seconds, executions, findings.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${1:?usage: scripts/fuzz.sh TARGET SECONDS}
seconds=${2:?usage: scripts/fuzz.sh TARGET SECONDS}
fuzz_build=${COMB_FUZZ_BUILD_DIR:-$root/build-fuzz}
build=${COMB_BUILD_DIR:-$root/build}
bash "$root/scripts/build.sh" comb_cli >&2  # the set-up, and the tool that makes seeds
py=${COMB_VENV:-$root/.venv}/bin/python
torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
if [ ! -f "$fuzz_build/build.ninja" ]; then
  command -v clang++ >/dev/null || { echo "$0: clang++ not found (Debian: apt-get install clang)" >&2; exit 1; }
  cmake -S "$root" -B "$fuzz_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
        -DCMAKE_C_COMPILER=clang -DCOMB_FUZZ=ON -DCOMB_BUILD_CLI=OFF -DCMAKE_PREFIX_PATH="$torch_prefix" >/dev/null
fi
cmake --build "$fuzz_build" --target "fuzz_$target" >&2
seeds=$fuzz_build/seeds
if [ ! -f "$seeds/.complete" ]; then  # made whole or not at all
  rm -rf "$seeds.tmp"
  bash "$root/tests/fuzz/make_seeds.sh" "$seeds.tmp" >&2
  rm -rf "$seeds" && mv "$seeds.tmp" "$seeds" && touch "$seeds/.complete"
fi
corpus=$fuzz_build/corpus/$target
findings=$fuzz_build/findings/$target
mkdir -p "$corpus" "$findings"
export COMB_FUZZ_BASE=$build/oracle/tiny-llama
# LibTorch is not instrumented: containers it shares with comb would give false container-overflow
# reports. Options the caller sets come after these, so they win.
export ASAN_OPTIONS="detect_odr_violation=0:allocator_may_return_null=1:detect_container_overflow=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
stamp=$(mktemp)
log=$fuzz_build/fuzz-$target.log
# The JSON readers get a dictionary of structure, keys and deep nesting (tests/fuzz/json.dict).
dict=()
case $target in
  safetensors|safetensors_index|tokenizer_json|tokenizer_config|qa|plugin|serve_request)
    dict=(-dict="$root/tests/fuzz/json.dict") ;;
esac
set +e
"$fuzz_build/tests/fuzz/fuzz_$target" "$corpus" "$seeds/$target" "${dict[@]}" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=4096 -max_len=1048576 -artifact_prefix="$findings/" -print_final_stats=1 >"$log" 2>&1
rc=$?
set -e
tail -n 25 "$log" >&2
execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
found=$(find "$findings" -type f -newer "$stamp" | wc -l)  # this run's findings only
rm -f "$stamp"
echo "fuzz $target: ${seconds} s, ${execs:-0} executions, $found new finding(s) in $findings (exit $rc)"
exit "$rc"
