#pragma once
// Shared test helpers: where the oracle outputs and the model are, a cached model, small writers.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bounds.hpp"
#include "comb/comb.hpp"
#include "comb/detail/mapped_file.hpp"

namespace comb::test {

// ---- Bounds for comparing two float32 paths (bounds.hpp says why each holds) ------------------

inline double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }
// The largest |value| of t: a bound's scale.
inline double magnitude(const at::Tensor& t) { return t.abs().max().item<double>(); }

// The longest float32 sum in a layer of `c` whose attention rows sum over up to `n_keys` keys:
// the MLP's down projection (n_ff products), an input projection (n_embd) or the attention's
// output projection (q_dim), or the attention's sum over the keys.
inline int64_t longest_sum(const ModelConfig& c, int64_t n_keys) {
  return std::max({c.n_embd, c.n_ff, c.q_dim(), n_keys});
}

// Two paths through `layers` layers of `c` (attention rows over up to n_keys keys), compared on
// values of magnitude `scale`: bounds.hpp's layers_bound.
inline double path_bound(const ModelConfig& c, int64_t layers, int64_t n_keys, double scale) {
  return layers_bound(layers, longest_sum(c, n_keys), scale);
}

// Two paths to a model's logits `want`: every layer of the decoder, the plug-in's encoder layers
// when it has a plug-in that encodes (they make the documents' K/V the decoder reads), and the
// output head, counted as one layer more.
inline double logits_bound(const Model& m, int64_t n_keys, const at::Tensor& want) {
  const auto& c = m.config();
  int64_t layers = c.n_layer + 1;
  if (m.plugin()) layers += m.plugin()->config().n_encoder_layers();
  return path_bound(c, layers, n_keys, magnitude(want));
}

// The logits a greedy answer `tokens` (max_tokens at most) of `method` was chosen from, on
// PicEngine's path with nothing cached (a fresh engine: its documents computed, as a first
// generate() computes them): after the prompt, then after each token; one row more (the step that
// chose a stop token) when the answer stopped before max_tokens. [steps, n_vocab] float32.
inline at::Tensor answer_logits(const Model& m, Method method, const PicOptions& options, const PicRequest& r,
                                const std::vector<int32_t>& tokens, int64_t max_tokens) {
  c10::InferenceMode guard;
  const int64_t n = static_cast<int64_t>(tokens.size()), steps = std::min(n + 1, max_tokens);
  PicEngine pic(m, method, options);
  PicPrefill p = pic.prefill(r, max_tokens);
  std::vector<at::Tensor> rows{p.logits};
  for (int64_t t = 0; t + 1 < steps; ++t)
    rows.push_back(m.forward(at::full({1, 1}, static_cast<int64_t>(tokens[static_cast<size_t>(t)]), at::kLong), p.cache,
                             p.documents.empty() ? nullptr : &p.documents)[0][-1]);
  return at::stack(rows).to(at::kFloat);
}

// Whether greedy tokens `got` are `want`, the same answer computed on another float32 path from
// the logits want_logits() gives (answer_logits; asked for only where the tokens differ): equal; or
// equal up to a step t where got's token is within 2 * bound of the largest of those logits at t
// (bound: logits_bound over the prompt and answer), a tie that two paths, each logit within `bound`
// of the other's, may break either way. The contexts differ after it, so nothing after it is
// compared. A step where got stopped and want did not is not a tie (got's stop token is not known).
// `why` says what was found.
inline bool same_greedy(const Model& m, int64_t n_prompt, const std::vector<int32_t>& got,
                        const std::vector<int32_t>& want, const std::function<at::Tensor()>& want_logits,
                        std::string& why) {
  const size_t n = std::min(got.size(), want.size());
  size_t t = 0;
  while (t < n && got[t] == want[t]) ++t;
  if (t == got.size() && t == want.size()) {
    why = "equal";
    return true;
  }
  if (t == got.size()) {
    why = "the served answer stopped at token " + std::to_string(t) + ", the other did not";
    return false;
  }
  const at::Tensor logits = want_logits();
  if (t >= static_cast<size_t>(logits.size(0))) {
    why = "token " + std::to_string(t) + " served past the other answer's max_tokens";
    return false;
  }
  const at::Tensor row = logits[static_cast<int64_t>(t)];
  const double gap = (row.max() - row[got[t]]).item<double>();
  const double bound = logits_bound(m, n_prompt + static_cast<int64_t>(logits.size(0)), row);
  why = "token " + std::to_string(t) + " served " + std::to_string(got[t]) + ", the other path's " +
        (t < want.size() ? std::to_string(want[t]) : std::string("a stop token")) + ": a gap of " +
        std::to_string(gap) + " in its logits against a tie bound of " + std::to_string(2 * bound);
  return gap <= 2 * bound;
}

// The largest sum of |q_i| |k_i| over a row of q and a row of k (rows: the last dimension, any
// shapes, as many tensors of keys as given), times `scale`: what a score's rounding is relative to.
inline double score_terms(const at::Tensor& q, const std::vector<at::Tensor>& keys, double scale) {
  const int64_t d = q.size(-1);
  const at::Tensor qa = q.detach().to(at::kFloat).abs().reshape({-1, d}).to(at::kDouble);
  double worst = 0;
  for (const at::Tensor& k : keys) {
    if (k.numel() == 0) continue;
    const at::Tensor ka = k.detach().to(at::kFloat).abs().reshape({-1, d}).to(at::kDouble);
    worst = std::max(worst, at::matmul(qa, ka.t()).max().item<double>());
  }
  return worst * scale;
}

// Two float32 computations of one attention, softmax(q k^T scale + bias) v over up to n_keys keys
// of head_dim d, values at most v_max in magnitude (a row of p sums to 1): per path, each score is
// within gamma(d) of `terms` (score_terms), which moves every probability by a factor within
// e^(2 gamma(d) terms), hence the output by about 2 gamma(d) terms v_max; the exponentials (at most
// 4 u each, comb's polynomial and SLEEF's alike), the sum of up to n_keys of them, the division and
// a flash kernel's rescaling of its running sums (3 gamma(n_keys) with the sum's) and the weighted
// sum of the values (gamma(n_keys)) add (4 u + 4 gamma(n_keys)) v_max. Two paths: twice that.
inline double attention_bound(int64_t d, int64_t n_keys, double terms, double v_max) {
  const double per_path = 2 * gamma32(d) * terms + 4 * kUnitRoundoff + 4 * gamma32(n_keys);
  return 2 * per_path * std::max(v_max, 1.0);
}
inline double attention_bound(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                              const std::vector<at::Tensor>& values, double scale) {
  int64_t n_keys = 0;
  double v_max = 0;
  for (const at::Tensor& k : keys) n_keys += k.numel() / std::max<int64_t>(k.size(-1), 1);
  for (const at::Tensor& v : values)
    if (v.numel()) v_max = std::max(v_max, magnitude(v.detach().to(at::kFloat)));
  return attention_bound(q.size(-1), n_keys, score_terms(q, keys, scale), v_max);
}

// Gradients of two float32 computations of one attention (or of its composition with a product
// by fixed weights): the backward pass is three sums in a row (dP = dO V^T over d, the softmax's
// row sum of dP p over the keys, dQ = dS K, dK = dS^T Q, dV = P^T dO over the keys or queries), each
// rounded by at most gamma(k) of the gradient's magnitude (k the longest of them), after the
// forward's scores and probabilities: four layers of bounds.hpp's first-order model.
inline double gradient_bound(int64_t longest, const at::Tensor& want) {
  return layers_bound(4, longest, magnitude(want));
}

// RoPE applied once at position p against twice, at a and then b with a + b = p (or the same
// rotation by two kernels): the angles p * f (f <= 1) are rounded in float32, each within u p, so
// the composed angle is off by at most 2 u p (a rotation by d moves a pair of values by at most |d|
// times its length, <= sqrt(2) scale); cos and sin are within 1 ulp (2u) of their angle's, and each
// rotation rounds its two products and their sum: 15 u of the pair's length over the two ways.
inline double rope_bound(int64_t max_position, double scale) {
  return (2.0 * max_position + 15.0) * kUnitRoundoff * std::sqrt(2.0) * std::max(scale, 1.0);
}

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

// A fresh plug-in's options: joint blocks before every decoder layer of `model`, each reading its
// layer (reading from step 0); a test sets the layout flags it needs on top.
inline PluginInitOptions joint_at_every_layer(const Model& model) {
  PluginInitOptions init;
  init.reads = init.joint_attention = true;
  for (int64_t l = 0; l < model.config().n_layer; ++l) init.cross_layers.push_back(l);
  return init;
}

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

// comb's logits of one model against transformers' on the same weights, from
// tests/oracle/bf16_reference.py's file `ref`: its ids fed as the oracle fed them (a prompt in one
// forward and more rows after it in one, every row's logits kept; pieces of a few rows, each
// one's last row's logits kept, which a GPU runs as a graph bucket; then a token a step through
// the cache), to the model at `model_dir` loaded with `options`. Over every kept row's logits: the
// root mean square and the largest distance to transformers' float32 logits, of comb's and of
// transformers' bfloat16 ones, and comb's to transformers' bfloat16 ones.
struct AgainstTransformers {
  int64_t positions = 0;              // rows of logits compared
  double rms = 0, max = 0;            // comb's, to transformers' float32
  double rms_hf = 0, max_hf = 0;      // transformers' bfloat16, to its float32
  double rms_to_hf = 0, max_to_hf = 0;  // comb's, to transformers' bfloat16
};
inline AgainstTransformers against_transformers(const std::string& model_dir, const std::string& ref,
                                                const Options& options) {
  c10::InferenceMode guard;
  SafetensorsFile file(ref);
  const at::Tensor ids = file.load("ids", at::kLong).unsqueeze(0);
  const at::Tensor split = file.load("split", at::kLong);
  const at::Tensor want = file.load("logits_float32", at::kFloat), hf = file.load("logits_bfloat16", at::kFloat);
  if (split.numel() != 5)
    throw Error(fmt::format("{}: expected a split of 5 counts (prompt, more, pieces, piece length, steps), found {}",
                            ref, split.numel()));
  const int64_t prompt = split[0].item<int64_t>(), more = split[1].item<int64_t>(), pieces = split[2].item<int64_t>(),
                piece = split[3].item<int64_t>(), steps = split[4].item<int64_t>();
  const int64_t n = ids.size(1), rows = prompt + more + pieces + steps;
  if (prompt + more + pieces * piece + steps != n || want.size(0) != rows || !want.sizes().equals(hf.sizes()))
    throw Error(fmt::format("{}: expected {} ids and {} rows of logits (split {}, {}, {} x {}, {}), found {} ids and "
                            "logits {}, {}", ref, prompt + more + pieces * piece + steps, rows, prompt, more, pieces,
                            piece, steps, n, c10::str(want.sizes()), c10::str(hf.sizes())));
  Model m = Model::load(model_dir, options);
  const Decoder& d = m.decoder();
  if (d.config().n_vocab != want.size(1))
    throw Error(fmt::format("{} was made from another model: logits of {} tokens, {} has {}", ref, want.size(1),
                            model_dir, d.config().n_vocab));
  KVCache cache = d.make_cache(1, n);
  std::vector<at::Tensor> kept;
  kept.push_back(d.forward(ids.narrow(1, 0, prompt), cache, LogitsMode::all)[0]);
  kept.push_back(d.forward(ids.narrow(1, prompt, more), cache, LogitsMode::all)[0]);
  int64_t pos = prompt + more;
  for (int64_t p = 0; p < pieces; ++p, pos += piece)
    kept.push_back(d.forward(ids.narrow(1, pos, piece), cache, LogitsMode::last)[0].narrow(0, -1, 1));
  for (; pos < n; ++pos) kept.push_back(d.forward(ids.narrow(1, pos, 1), cache)[0]);
  const at::Tensor got = at::cat(kept).to(at::kCPU, at::kFloat);
  auto rms = [](const at::Tensor& t) { return t.pow(2).mean().sqrt().item<double>(); };
  AgainstTransformers a;
  a.positions = rows;
  a.rms = rms(got - want), a.max = max_diff(got, want);
  a.rms_hf = rms(hf - want), a.max_hf = max_diff(hf, want);
  a.rms_to_hf = rms(got - hf), a.max_to_hf = max_diff(got, hf);
  return a;
}
// The figures of comb's bf16 and float32 against transformers, for a check's message.
inline std::string describe(const AgainstTransformers& bf16, const AgainstTransformers& f32) {
  return fmt::format(
      "over {} rows of logits, root mean square and largest distance to transformers' float32: comb bf16 {:.3g}, "
      "{:.3g}; transformers bf16 {:.3g}, {:.3g}; comb float32 {:.3g}, {:.3g}; comb bf16 to transformers bf16 {:.3g}, "
      "{:.3g}",
      bf16.positions, bf16.rms, bf16.max, bf16.rms_hf, bf16.max_hf, f32.rms, f32.max, bf16.rms_to_hf, bf16.max_to_hf);
}

}  // namespace comb::test
