#pragma once
// The fuzz harnesses: one function per reader of outside input, each taking the bytes of one input
// (a whole file). A reader may refuse an input only with comb::Error; any other exception, a crash,
// a leak or a sanitizer report is a finding. Built twice: into the libFuzzer targets (fuzz_main.cpp,
// scripts/fuzz.sh) and into comb_fuzz_replay, which runs the kept inputs in the test suite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comb/comb.hpp"
#include "serve_api.hpp"  // src/cli: the server's request parser

namespace comb::fuzz {

// A folder of this process's own under $TMPDIR (or /tmp), made on first use and removed when
// the process exits (kept when COMB_KEEP_TEST_DIRS is set, to look into after a failure).
struct Scratch {
  std::string dir;
  pid_t owner = ::getpid();  // a forked child that exits leaves it to its parent
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/comb-fuzz-XXXXXX";
    char* made = ::mkdtemp(pattern.data());
    if (!made) std::abort();
    dir = made;
  }
  ~Scratch() {
    if (std::getenv("COMB_KEEP_TEST_DIRS") || ::getpid() != owner) return;
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
};

inline const std::string& scratch() {
  static const Scratch made;
  return made.dir;
}

inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), size);
  return path;
}

inline std::string make_dir(const std::string& name) {
  const std::string dir = scratch() + "/" + name;
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

// Runs one step; comb::Error (a refused input) ends it quietly, anything else goes on up.
template <class F>
void refusable(F&& step) {
  try {
    step();
  } catch (const comb::Error&) {
  }
}

// Elements of a shape, or -1 when that overflows or a dimension is negative.
inline int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > (int64_t(1) << 40) / d)) return -1;
    n *= d;
  }
  return n;
}

// Reads every tensor of a source small enough to read quickly, as floats and grouped.
inline void read_tensors(const TensorSource& source) {
  for (const std::string& name : source.names()) {
    const TensorInfo* info = source.find(name);
    if (!info) std::abort();  // names() and find() disagree
    const int64_t n = elements(info->shape);
    if (n < 0 || n > (int64_t(1) << 18)) continue;
    refusable([&] { source.load(name, at::kFloat); });
    refusable([&] { source.load_grouped(name); });
  }
}

inline void exercise(const Tokenizer& tok) {
  for (const char* text : {"Hello, world! 123 <|im_start|>user\n\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80", ""}) {
    std::vector<int32_t> ids = tok.encode(text);
    tok.decode(ids);
  }
  std::vector<int32_t> all;
  for (int32_t i = 0; i < std::min<int64_t>(tok.n_vocab(), 64); ++i) all.push_back(i);
  tok.decode(all);
  tok.decode(all, /*skip_special=*/true);
}

inline int gguf(const uint8_t* data, size_t size) {
  const std::string path = write_file("input.gguf", data, size);
  refusable([&] {
    GgufFile file(path);
    read_tensors(file);
    refusable([&] { ModelConfig::from_gguf(file); });
    refusable([&] { exercise(Tokenizer::from_gguf(file)); });
  });
  return 0;
}

inline int safetensors(const uint8_t* data, size_t size) {
  const std::string path = write_file("input.safetensors", data, size);
  refusable([&] { read_tensors(SafetensorsFile(path)); });
  return 0;
}

// The index of a sharded checkpoint, beside two small real shards.
inline int safetensors_index(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    std::string d = make_dir("sharded");
    save_safetensors(d + "/model-00001-of-00002.safetensors", {{"a", at::arange(6, at::kFloat).view({2, 3})}});
    save_safetensors(d + "/model-00002-of-00002.safetensors", {{"b", at::ones({4}, at::kBFloat16)}});
    return d;
  }();
  std::ofstream(dir + "/model.safetensors.index.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), size);
  refusable([&] { read_tensors(ShardedSafetensors(dir + "/model.safetensors.index.json")); });
  return 0;
}

// A small byte-level BPE tokenizer.json (the tokenizer_config.json target reads it as is).
inline const char* small_tokenizer_json() {
  return R"({"version":"1.0","added_tokens":[{"id":6,"content":"<|im_start|>","special":true},
{"id":7,"content":"<|im_end|>","special":true}],"normalizer":null,
"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"use_regex":true},
"model":{"type":"BPE","vocab":{"H":0,"e":1,"l":2,"o":3,"He":4,"ll":5},"merges":["H e","l l"]}})";
}

inline int tokenizer_json(const uint8_t* data, size_t size) {
  const std::string dir = make_dir("tokenizer");
  const std::string path = dir + "/tokenizer.json";
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), size);
  refusable([&] { exercise(Tokenizer::from_hf_file(path)); });
  return 0;
}

inline int tokenizer_config(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    std::string d = make_dir("tokenizer-config");
    std::ofstream(d + "/tokenizer.json") << small_tokenizer_json();
    return d;
  }();
  std::ofstream(dir + "/tokenizer_config.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), size);
  refusable([&] {
    Tokenizer tok = Tokenizer::from_hf_file(dir + "/tokenizer.json");
    exercise(tok);
    if (!tok.chat_template().empty()) refusable([&] { ChatTemplate::from_source(tok.chat_template()); });
  });
  return 0;
}

inline int chat_template(const uint8_t* data, size_t size) {
  refusable([&] {
    ChatTemplate t = ChatTemplate::from_source(std::string(reinterpret_cast<const char*>(data), size));
    t.apply({{"user", "Hi"}});
    t.apply({{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}}, false);
  });
  return 0;
}

inline int qa(const uint8_t* data, size_t size) {
  const bool gz = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  const std::string path = write_file(gz ? "items.jsonl.gz" : "items.jsonl", data, size);
  refusable([&] { read_qa_items(path, 100); });
  return 0;
}

// A plug-in file for the base model named by $COMB_FUZZ_BASE (the tests' tiny Llama).
inline int plugin(const uint8_t* data, size_t size) {
  static const std::unique_ptr<Model> base = [] {
    const char* dir = std::getenv("COMB_FUZZ_BASE");
    if (!dir || !*dir) {
      std::fprintf(stderr, "the plugin target needs COMB_FUZZ_BASE: a model directory (the tests' tiny Llama)\n");
      std::exit(2);
    }
    return std::make_unique<Model>(Model::load(dir));
  }();
  const std::string path = write_file("plugin.safetensors", data, size);
  refusable([&] {
    Plugin p = Plugin::load(path, base->decoder());
    std::vector<int32_t> doc = {1, 2, 3, 4, 5};
    p.encode(base->decoder(), doc);
  });
  return 0;
}

// A disk entry of the cache store, under the key its header names and with its checksum made
// right (a mutated payload would otherwise never pass the checksum to reach the code after it).
inline int store_entry(const uint8_t* data, size_t size) {
  const std::string dir = make_dir("store");
  std::string bytes(reinterpret_cast<const char*>(data), size);
  CacheKey key = PICacheStore::key({1, 2, 3}, "fuzz");
  constexpr size_t kHeader = 72, kChecksum = 48, kKeyHigh = 56, kKeyLow = 64;  // store.cpp's DiskHeader
  if (bytes.size() >= kHeader) {
    std::memcpy(&key.high, bytes.data() + kKeyHigh, 8);
    std::memcpy(&key.low, bytes.data() + kKeyLow, 8);
    const uint64_t sum = XXH3_64bits(bytes.data() + kHeader, bytes.size() - kHeader);
    std::memcpy(bytes.data() + kChecksum, &sum, 8);
  }
  std::ofstream(dir + "/" + key.hex() + ".kv", std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  StoreOptions options;
  options.disk_bytes = int64_t(1) << 30;
  options.disk_dir = dir;
  refusable([&] {
    PICacheStore store(options);
    std::shared_ptr<const DocumentKV> kv = store.get(key);
    if (!kv) return;
    store.put(PICacheStore::key({4}, "fuzz"), *kv);
    (void)kv->int8_codes();  // int4 keys rotated back, as every reader reads them
  });
  // One entry at a time: the next input must not find this one.
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ::unlink((dir + "/" + e->d_name).c_str());
    ::closedir(d);
  }
  return 0;
}

// A request body of `comb serve` (chat, completion, document upload): refused only with ApiError.
inline int serve_request(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  serve::Limits limits;
  for (bool chat : {true, false}) {
    try {
      serve::CompletionRequest r = serve::parse_completion_request(body, chat, limits);
      if (static_cast<int64_t>(r.documents.size()) > limits.max_documents || r.stop.size() > size_t(limits.max_stop))
        std::abort();  // the limits it checks
      for (const auto& d : r.documents)
        if (static_cast<int64_t>(d.text.size()) > limits.max_document_bytes) std::abort();
      if (r.top_logprobs < 0 || r.top_logprobs > serve::kMaxTopLogprobs) std::abort();
    } catch (const serve::ApiError& e) {
      if (e.status < 400 || e.status >= 500) std::abort();
      serve::error_body(e);
    }
  }
  try {
    serve::parse_document_upload(body, limits);
  } catch (const serve::ApiError& e) {
    serve::error_body(e);
  }
  try {
    serve::TokenizeRequest t = serve::parse_tokenize_request(body, limits);
    if (static_cast<int64_t>(t.prompt.size()) > limits.max_prompt_bytes ||
        static_cast<int64_t>(t.messages.size()) > limits.max_messages)
      std::abort();
  } catch (const serve::ApiError& e) {
    if (e.status != 400) std::abort();
  }
  try {
    serve::DetokenizeRequest d = serve::parse_detokenize_request(body, limits);
    for (int64_t id : d.tokens)
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) std::abort();
  } catch (const serve::ApiError& e) {
    if (e.status != 400) std::abort();
  }
  return 0;
}

using Harness = int (*)(const uint8_t*, size_t);
inline const std::map<std::string, Harness>& harnesses() {
  static const std::map<std::string, Harness> all = {
      {"gguf", gguf},         {"safetensors", safetensors},   {"safetensors_index", safetensors_index},
      {"tokenizer_json", tokenizer_json}, {"tokenizer_config", tokenizer_config}, {"chat_template", chat_template},
      {"qa", qa},             {"plugin", plugin},             {"store_entry", store_entry},
      {"serve_request", serve_request}};
  return all;
}

}  // namespace comb::fuzz
