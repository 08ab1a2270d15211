#!/usr/bin/env bash
# Seed corpora for the fuzz targets, from real files: the default model's GGUF (its metadata and
# small tensors, rewritten small), the tests' tiny Llama (safetensors shards, index, tokenizer),
# the QA fixtures, a plug-in and a cache store entry made by comb itself.
#   tests/fuzz/make_seeds.sh OUT_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: make_seeds.sh OUT_DIR}
build=${COMB_BUILD_DIR:-$root/build}
py=${COMB_PYTHON:-${COMB_VENV:-$root/.venv}/bin/python}
comb=$build/comb
model=$(grep -o 'COMB_DEFAULT_MODEL:FILEPATH=.*' "$build/CMakeCache.txt" | cut -d= -f2-)
[ -f "$model" ] || { echo "make_seeds.sh: no default model in $build/CMakeCache.txt (COMB_DEFAULT_MODEL)" >&2; exit 1; }
tiny=$build/oracle/tiny-llama
[ -d "$tiny" ] || ctest --test-dir "$build" -R '^oracle\.' >/dev/null  # the tests' oracles write it
mkdir -p "$out"/{gguf,safetensors,safetensors_index,tokenizer_json,tokenizer_config,chat_template,qa,plugin,store_entry,serve_request}

# GGUF: the model's own metadata (tokenizer arrays cut to 512 tokens) with its norm tensors and one
# row block of each stored type, written by the gguf package; and the template and config alone.
"$py" - "$model" "$out" <<'PY'
import sys, numpy as np, gguf
src, out = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
def field_value(f):
    t = f.types[0]
    if t == gguf.GGUFValueType.STRING: return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
    if t == gguf.GGUFValueType.ARRAY:
        vals = [f.parts[i] for i in f.data]
        if f.types[1] == gguf.GGUFValueType.STRING: return [bytes(v).decode("utf-8", "replace") for v in vals]
        return [v.tolist()[0] for v in vals]
    return f.parts[f.data[0]].tolist()[0]
chat = None
for small, keep in (("small.gguf", 512), ("metadata.gguf", 0)):
    w = gguf.GGUFWriter(f"{out}/gguf/{small}", "llama")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture": continue
        v = field_value(f)
        if name == "tokenizer.chat_template": chat = v
        if isinstance(v, list) and name.startswith("tokenizer.ggml."):
            if keep == 0: continue
            v = v[:keep]
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_array(name, v)
        elif t == gguf.GGUFValueType.STRING: w.add_string(name, v)
        elif t == gguf.GGUFValueType.FLOAT32: w.add_float32(name, v)
        elif t == gguf.GGUFValueType.BOOL: w.add_bool(name, v)
        elif t in (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32): w.add_uint32(name, v)
        else: w.add_uint32(name, int(v))
    if keep:
        for t in r.tensors:
            if t.name in ("output_norm.weight", "blk.0.attn_norm.weight"):
                w.add_tensor(t.name, np.array(t.data))
        w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
        for qt in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
            data = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), qt)
            w.add_tensor(f"q.{qt.name}", data, raw_dtype=qt)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
if chat:
    open(f"{out}/chat_template/smollm2.jinja", "w").write(chat)
PY

# safetensors: the tiny Llama's smallest shard and one of several dtypes; its index.
smallest=$(ls -S "$tiny"/*.safetensors | tail -1)
cp "$smallest" "$out/safetensors/tiny-shard.safetensors"
"$py" - "$out" <<'PY'
import sys, json, struct, numpy as np
out = sys.argv[1]
def write(path, tensors, meta=None):
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        b = arr.tobytes(); header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b); off += len(b)
    if meta: header["__metadata__"] = meta
    h = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
write(f"{out}/safetensors/dtypes.safetensors", {"f32": ("F32", np.ones((2, 3), np.float32)), "f16": ("F16", np.ones(4, np.float16)),
      "bf16": ("BF16", np.ones(4, np.uint16)), "i64": ("I64", np.arange(3)), "u8": ("U8", np.arange(5, dtype=np.uint8))}, {"format": "pt"})
json.dump({"metadata": {"total_size": 32}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}},
          open(f"{out}/safetensors_index/index.json", "w"))
PY
cp "$tiny/model.safetensors.index.json" "$out/safetensors_index/tiny-llama.index.json"

# tokenizer.json: a small byte-level BPE, and the tiny Llama's pre-tokenizer and added tokens with a
# cut vocabulary; tokenizer_config.json and chat templates from the model written out by comb.
"$py" - "$tiny/tokenizer.json" "$out" <<'PY'
import sys, json
src, out = sys.argv[1], sys.argv[2]
j = json.load(open(src))
vocab = dict(list(j["model"]["vocab"].items())[:300])
j["model"]["vocab"] = vocab
j["model"]["merges"] = [m for m in j["model"]["merges"][:2000] if all(p in vocab for p in (m.split(" ") if isinstance(m, str) else m))][:100]
j["added_tokens"] = [dict(t, id=300 + i) for i, t in enumerate(j["added_tokens"][:8])]
json.dump(j, open(f"{out}/tokenizer_json/llama3-cut.json", "w"))
PY
cat > "$out/tokenizer_json/small.json" <<'JSON'
{"version":"1.0","added_tokens":[{"id":6,"content":"<|im_start|>","special":true}],"normalizer":null,
"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Digits","individual_digits":true},
{"type":"Split","pattern":{"String":" "},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}]},
"model":{"type":"BPE","vocab":{"H":0,"e":1,"l":2,"o":3,"He":4,"ll":5},"merges":[["H","e"],"l l"]}}
JSON
saved=$(mktemp -d)
trap 'rm -rf "$saved"' EXIT
"$comb" plugin init --model "$tiny" --encoder-layers 2 --out "$out/plugin/tiny.comb.safetensors" >/dev/null
"$py" - "$model" "$saved" <<'PY'
import sys, json, gguf
r = gguf.GGUFReader(sys.argv[1])
f = r.fields["tokenizer.chat_template"]
json.dump({"add_bos_token": False, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
           "chat_template": bytes(f.parts[f.data[0]]).decode()}, open(sys.argv[2] + "/tokenizer_config.json", "w"))
PY
cp "$saved/tokenizer_config.json" "$out/tokenizer_config/smollm2.json"
echo '{"bos_token": null, "add_bos_token": true}' > "$out/tokenizer_config/plain.json"

# QA items: the tests' fixtures (public sources' layout, converted by comb make-data in the suite).
cp "$root"/tests/data/*.jsonl "$out/qa/"
cp "$root"/tests/data/truncated.jsonl.gz "$out/qa/"
[ -f "$build/nq-mini.jsonl.gz" ] && cp "$build/nq-mini.jsonl.gz" "$out/qa/"

# Cache store entries: the tiny Llama with its plug-in through --cache-dir, in every stored dtype
# (float32; int8 and int8-int4 with keys scaled per channel, and per row on the 3-token document,
# shorter than head_dim / 2; int4, whose rotated keys are scaled per channel on both, the scales
# coded, and centred on a document of head_dim tokens or more).
echo "Paris is the capital of France." > "$saved/doc.txt"
echo "Paris." > "$saved/short.txt"
for i in $(seq 12); do printf "Paris is the capital of France. "; done > "$saved/long.txt"
for dtype in auto int8 int8-int4 int4; do
  for doc in doc short long; do
    [ "$dtype" = auto ] && [ "$doc" = short ] && continue
    [ "$dtype" != int4 ] && [ "$doc" = long ] && continue
    "$comb" generate --model "$tiny" --plugin "$out/plugin/tiny.comb.safetensors" --document "$saved/$doc.txt" \
      --raw --prompt "Capital?" --max-tokens 1 --cache-dtype "$dtype" --cache-dir "$saved/cache-$dtype-$doc" >/dev/null
    for f in "$saved/cache-$dtype-$doc"/*.kv; do
      [ -f "$f" ] && cp "$f" "$out/store_entry/$dtype-$doc-$(basename "$f")" || echo "make_seeds: no $dtype store entry written" >&2
    done
  done
done
# Request bodies of comb serve: chat, completion (text and token ids), documents inline and by id, logprobs,
# /tokenize and /detokenize, uploads.
cat > "$out/serve_request/chat.json" <<'JSON'
{"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": -3, "stop": ["\n", "END"], "stream": true, "stream_options": {"include_usage": true}, "n": 1}
JSON
cat > "$out/serve_request/documents.json" <<'JSON'
{"model": "m", "messages": [{"role": "user", "content": "Who?"}], "documents": [{"title": "A", "text": "Anna planted it."}, {"id": "doc-00000000000000ff"}], "method": "comb", "cache_salt": "tenant-1", "max_completion_tokens": 8}
JSON
cat > "$out/serve_request/completion.json" <<'JSON'
{"model": "m", "prompt": "The capital of France is", "max_tokens": 4, "stop": "\n", "logprobs": null, "echo": false}
JSON
cat > "$out/serve_request/ids.json" <<'JSON'
{"model": "m", "prompt": [1, 2, 3, 49151], "documents": [{"text": "x"}], "method": "naive"}
JSON
cat > "$out/serve_request/logprobs.json" <<'JSON'
{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 5, "max_tokens": 2}
JSON
cat > "$out/serve_request/tokenize.json" <<'JSON'
{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false, "return_token_strs": true}
JSON
cat > "$out/serve_request/detokenize.json" <<'JSON'
{"tokens": [1, 2, 3, 49151]}
JSON
cat > "$out/serve_request/upload.json" <<'JSON'
{"title": "Orchard", "text": "The oldest tree was planted by Anna Lind.", "cache_salt": "t", "method": "epic"}
JSON

find "$out" -type f | sed "s|$out/||" | sort | awk -F/ '{n[$1]++} END {for (t in n) printf "seeds %s: %d\n", t, n[t]}' | sort
