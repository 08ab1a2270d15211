#pragma once
// Shared test helpers: where the oracle outputs and the model are, a cached model, small writers.
#include <ATen/ATen.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comb/comb.hpp"
#include "comb/detail/mapped_file.hpp"

namespace comb::test {

// Directory the oracles wrote into ($COMB_ORACLE_DIR), and the default model ($COMB_MODEL).
inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}
inline std::string oracle_dir() { return env_or("COMB_ORACLE_DIR", "build/oracle"); }
inline std::string model_path() { return env_or("COMB_MODEL", ""); }
// The repository's test data (tests/data, $COMB_TEST_DATA).
inline std::string test_data_dir() { return env_or("COMB_TEST_DATA", "tests/data"); }

// The default model in fp32 on CPU, loaded once for all tests.
// Loaded outside inference mode whichever test asks first, so that training tests can use it.
inline const Model& default_model() {
  static const Model model = [] {
    c10::InferenceMode off(false);
    return Model::load(model_path());
  }();
  return model;
}

inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error("cannot read " + path + " (did the oracle fixture run?)");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::vector<int32_t> to_ids(const at::Tensor& t) {
  at::Tensor l = t.to(at::kLong).contiguous();
  return std::vector<int32_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
}

inline at::Tensor ids_tensor(const std::vector<int32_t>& ids) {
  return at::tensor(std::vector<int64_t>(ids.begin(), ids.end()), at::kLong).unsqueeze(0);
}

// The owner of documents over a store the test keeps (not owned), or over none.
inline Documents documents_in(const Model& model, PICacheStore* store) {
  return Documents(model, std::shared_ptr<PICacheStore>(store, [](PICacheStore*) {}));
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) { return detail::read_text_file(path); }

// A plug-in with random weights and open gates, so that documents change the output.
inline std::shared_ptr<Plugin> random_plugin(const Decoder& base, int64_t n_layers = 2, uint64_t seed = 1) {
  PluginInitOptions init;
  init.n_encoder_layers = n_layers;
  init.copy_decoder_layers = false;
  init.seed = seed;
  init.init_std = 0.1;
  auto plugin = std::make_shared<Plugin>(Plugin::fresh(base, init));
  for (auto& block : plugin->mutable_weights().cross) {
    block.attn_gate.fill_(0.7);
    block.mlp_gate.fill_(-0.4);
  }
  plugin->refresh_fingerprint();
  return plugin;
}

// A fresh, empty directory under the system's temporary directory.
std::string temp_dir(const std::string& name);
// Removes a directory tree, quietly (defined beside temp_dir, outside the precompiled header).
void remove_dir(const std::string& dir);

// Builds GGUF files byte by byte, for format tests.
class GgufWriter {
 public:
  void kv_u32(const std::string& key, uint32_t v) { kv_header(key, 4); put(v); }
  void kv_f32(const std::string& key, float v) { kv_header(key, 6); put(v); }
  void kv_str(const std::string& key, const std::string& v) { kv_header(key, 8); str(v); }
  void kv_strs(const std::string& key, const std::vector<std::string>& v) {
    kv_header(key, 9);
    put(uint32_t(8));
    put(uint64_t(v.size()));
    for (const auto& s : v) str(s);
  }
  // dims in GGUF order (fastest first); `data` the raw bytes of `type`.
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, const std::string& data) {
    tensors_.push_back({name, std::move(dims), type, data});
  }
  std::string bytes(uint32_t version = 3) const;

 private:
  struct T {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    std::string data;
  };
  template <typename V>
  void put(V v) { kv_.append(reinterpret_cast<const char*>(&v), sizeof(V)); }
  void str(const std::string& s) { put(uint64_t(s.size())); kv_ += s; }
  void kv_header(const std::string& key, uint32_t type) { str(key); put(type); ++n_kv_; }
  std::string kv_;
  uint64_t n_kv_ = 0;
  std::vector<T> tensors_;
};

}  // namespace comb::test
