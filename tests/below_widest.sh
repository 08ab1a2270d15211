#!/usr/bin/env bash
# Runs a command with this CPU's widest vector path turned off in every CPU library the numbers go
# through, so that the suite sees what a machine without it computes (tests/CMakeLists.txt runs
# the numeric suites once more under it):
#   - a CPU with AVX-512: AVX2 (comb's kernels, oneDNN, ATen's kernels, MKL);
#   - a CPU without it: the portable paths (comb's scalar loops, oneDNN's SSE4.1, ATen's
#     unvectorised default kernels, MKL's SSE4.2).
# The caps are the libraries' own switches: COMB_CPU_ISA (docs/building.md), ONEDNN_MAX_CPU_ISA,
# ATEN_CPU_CAPABILITY and MKL_ENABLE_INSTRUCTIONS.
set -euo pipefail
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  export COMB_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
else
  export COMB_CPU_ISA=scalar ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2
fi
echo "below the widest path: COMB_CPU_ISA=$COMB_CPU_ISA ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA" \
  "ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS"
exec "$@"
