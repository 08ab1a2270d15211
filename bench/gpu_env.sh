# Sourced by bench/gpu_pack.sh and bench/gpu_train_pack.sh (here, to pack) and by what they pack
# (there, on a GPU machine that has python3 with torch but neither this project's build nor its
# Debian libraries).

# gpu_pack_binaries DIR BUILD BINARY...: the binaries into DIR/bin, comb's libraries and the Debian
# ones they link into DIR/lib (less the C and C++ runtimes every Linux machine has, and CUDA's and
# torch's, which come from the GPU machine's python3), the LibTorch version built against into
# DIR/torch-version.txt. PY: a python with torch (default .venv/bin/python beside BUILD's parent).
gpu_pack_binaries() {
  local dir=$1 build=$2
  shift 2
  local py=${PY:-$build/../.venv/bin/python}
  rm -rf "$dir/bin" "$dir/lib"
  mkdir -p "$dir/bin" "$dir/lib"
  cp "$@" "$dir/bin/"
  cp -P "$build"/libcomb*.so* "$dir/lib/"
  local runtime='libc|libm|libdl|librt|libpthread|libutil|libstdc\+\+|libgcc_s|ld-linux[^/]*'
  local cuda='libcuda|libcudart|libcublas|libcublasLt|libcufft|libcurand|libcusparse|libcusolver|libcudnn|libcupti|libnccl'
  cuda+='|libnvJitLink|libnvrtc'
  local b
  for b in "$@" "$build"/libcomb*.so; do ldd "$b"; done |
    awk '$3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' | sort -u |
    { grep -v -E "/($runtime|$cuda)\.so" || true; } |
    while read -r lib; do cp -L "$lib" "$dir/lib/"; done
  "$py" -c 'import torch; print(torch.__version__)' > "$dir/torch-version.txt"
}

# gpu_env PACK: there, before running PACK/bin's binaries. Refuses another LibTorch than the one
# built against (its libraries' names carry no version: another one fails only when a symbol is
# looked up); puts on LD_LIBRARY_PATH comb's libraries, of the carried system ones only those the
# machine lacks, torch's and the pip CUDA libraries; checks that every binary finds its libraries.
# Returns 1 (and says why) otherwise. The links are made in PACK/.libs (made again at each call).
gpu_env() {
  local pack=$1 torch_version torch_lib cuda_libs cuda_path="" folder lib name known missing
  torch_version=$(python3 -c 'import torch; print(torch.__version__)') || { echo "python3 has no torch"; return 1; }
  [ "$torch_version" = "$(cat "$pack/torch-version.txt")" ] ||
    { echo "built against torch $(cat "$pack/torch-version.txt"), python3 has $torch_version"; return 1; }
  torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  # CUDA's libraries from pip (nvidia is a namespace package: its folders are in __path__).
  cuda_libs=$(python3 -c 'import nvidia; print(":".join(p for p in nvidia.__path__))' 2>/dev/null || true)
  for folder in ${cuda_libs//:/ }; do
    for lib in "$folder"/*/lib; do [ -d "$lib" ] && cuda_path+="$lib:"; done
  done
  local links=$pack/.libs
  rm -rf "$links" && mkdir -p "$links" || { echo "cannot make $links"; return 1; }
  known=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
  for lib in "$pack"/lib/*; do
    name=$(basename "$lib")
    case "$name" in
      libcomb*) ln -s "$lib" "$links/$name" ;;
      *) [[ "$known" == *"/$name"$'\n'* || "$known" == *"/$name" ]] || ln -s "$lib" "$links/$name" ;;
    esac
  done
  echo "carried libraries used: $(ls "$links" | tr '\n' ' ')"
  export LD_LIBRARY_PATH=$links:$torch_lib:$cuda_path${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH%:}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  # libcomb_cuda.so is opened at run time (beside libcomb): its libraries are checked too.
  missing=$(ldd "$pack"/bin/* "$links/libcomb_cuda.so" | grep "not found" | sort -u)
  [ -z "$missing" ] || { echo "libraries not found: $missing"; return 1; }
}

# gpu_plugin COMB MODEL_DIR [SECONDS]: a fresh joint plug-in of MODEL_DIR at
# MODEL_DIR.plugin.safetensors unless there (blocks before layers 0 .. L-2 and an encoder of the first
# L-2 layers, the shipped plug-in's layout; untrained: the GPU runs measure speed with it), made on the
# GPU in bfloat16, within SECONDS when given (the file is written whole or not at all).
gpu_plugin() {
  local comb=$1 m=$2 seconds=${3:-} layers last
  [ -s "$m.plugin.safetensors" ] && return 0
  layers=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$m/config.json") ||
    return 1
  last=$((layers - 2))
  ${seconds:+timeout "$seconds"} "$comb" plugin init --model "$m" --device cuda --dtype bfloat16 \
    --out "$m.plugin.safetensors" --init joint \
    --documents-after-prefix 1 --encoder-layers "$last" --cross-layers "$(seq -s, 0 "$last")" >&2
}
