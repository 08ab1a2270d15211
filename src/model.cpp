// The decoder side: config, weight table, forward pass, sampling and generation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <filesystem>
#include <numeric>

#include "comb/cuda_backend.hpp"
#include "comb/detail/cpu_kernels.hpp"
#include "comb/detail/mapped_file.hpp"
#include "comb/error.hpp"
#include "comb/gguf.hpp"
#include "comb/log.hpp"
#include "comb/model.hpp"
#include "comb/plugin.hpp"
#include "comb/safetensors.hpp"
#include "comb/weights.hpp"

namespace fs = std::filesystem;

namespace comb {

// ================================================================================================
// ModelConfig
// ================================================================================================

void ModelConfig::validate(const std::string& where) const {
  COMB_CHECK(architecture == "llama", "{}: architecture '{}' is not supported (expected llama)", where, architecture);
  auto positive = [&](const char* name, int64_t v) {
    COMB_CHECK(v > 0, "{}: {} must be positive, found {}", where, name, v);
  };
  positive("n_vocab", n_vocab);
  positive("n_embd", n_embd);
  positive("n_ff", n_ff);
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("n_head_kv", n_head_kv);
  positive("head_dim", head_dim);
  positive("n_ctx", n_ctx);
  COMB_CHECK(n_head % n_head_kv == 0, "{}: {} query heads are not a multiple of {} key/value heads", where, n_head,
             n_head_kv);
  COMB_CHECK(head_dim % 2 == 0, "{}: head_dim {} must be even for RoPE", where, head_dim);
  COMB_CHECK(rms_eps > 0 && rope_theta > 0, "{}: rms_eps ({}) and rope_theta ({}) must be positive", where, rms_eps,
             rope_theta);
  COMB_CHECK(rope_scaling.type == "none" || rope_scaling.type == "llama3",
             "{}: RoPE scaling '{}' is not supported (supported: none, llama3)", where, rope_scaling.type);
}

ModelConfig ModelConfig::from_gguf(const GgufFile& g) {
  ModelConfig c;
  c.architecture = g.get_string("general.architecture");
  COMB_CHECK(c.architecture == "llama", "'{}': architecture '{}' is not supported (expected llama)", g.where(),
             c.architecture);
  const std::string a = c.architecture + ".";
  c.n_layer = g.get_int(a + "block_count");
  c.n_embd = g.get_int(a + "embedding_length");
  c.n_ff = g.get_int(a + "feed_forward_length");
  c.n_head = g.get_int(a + "attention.head_count");
  c.n_head_kv = g.has(a + "attention.head_count_kv") ? g.get_int(a + "attention.head_count_kv") : c.n_head;
  c.head_dim = g.has(a + "attention.key_length")   ? g.get_int(a + "attention.key_length")
               : g.has(a + "rope.dimension_count") ? g.get_int(a + "rope.dimension_count")
                                                   : (c.n_head > 0 ? c.n_embd / c.n_head : 0);
  c.n_ctx = g.get_int(a + "context_length");
  c.rms_eps = g.get_float(a + "attention.layer_norm_rms_epsilon");
  if (g.has(a + "rope.freq_base")) c.rope_theta = g.get_float(a + "rope.freq_base");
  if (g.has(a + "rope.scaling.type")) {
    std::string t = g.get_string(a + "rope.scaling.type");
    COMB_CHECK(t == "none", "'{}': RoPE scaling '{}' is not supported", g.where(), t);
  }
  if (g.has(a + "vocab_size")) c.n_vocab = g.get_int(a + "vocab_size");
  else if (g.has("tokenizer.ggml.tokens")) c.n_vocab = static_cast<int64_t>(g.get("tokenizer.ggml.tokens").size());
  else if (const TensorInfo* t = g.find("token_embd.weight")) c.n_vocab = t->shape[0];
  c.tie_embeddings = g.find("output.weight") == nullptr;
  // NOTE: GGUF stores llama3 scaling as the rope_freqs tensor; the decoder applies it from there.
  if (g.find("rope_freqs.weight")) c.rope_scaling.type = "llama3";
  c.validate(g.where());
  return c;
}

ModelConfig ModelConfig::from_hf_json(const nlohmann::json& j, const std::string& where) {
  auto req = [&](const char* key) -> const nlohmann::json& {
    COMB_CHECK(j.contains(key) && j[key].is_number(), "{}: config key '{}' is missing or not a number", where, key);
    return j[key];
  };
  ModelConfig c;
  std::string type = j.value("model_type", "");
  COMB_CHECK(type == "llama", "{}: model_type '{}' is not supported (expected llama)", where, type);
  COMB_CHECK(!j.value("attention_bias", false) && !j.value("mlp_bias", false),
             "{}: attention or MLP biases are not supported", where);
  c.n_vocab = req("vocab_size").get<int64_t>();
  c.n_embd = req("hidden_size").get<int64_t>();
  c.n_ff = req("intermediate_size").get<int64_t>();
  c.n_layer = req("num_hidden_layers").get<int64_t>();
  c.n_head = req("num_attention_heads").get<int64_t>();
  c.n_head_kv = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                    ? j["num_key_value_heads"].get<int64_t>()
                    : c.n_head;
  c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? j["head_dim"].get<int64_t>()
                                                                   : (c.n_head > 0 ? c.n_embd / c.n_head : 0);
  c.n_ctx = req("max_position_embeddings").get<int64_t>();
  c.rms_eps = j.value("rms_norm_eps", 1e-6);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  // RoPE: "rope_theta"/"rope_scaling" (older layout) or "rope_parameters" (newer).
  nlohmann::json rope = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? j["rope_parameters"]
                        : j.contains("rope_scaling") && j["rope_scaling"].is_object() ? j["rope_scaling"]
                                                                                        : nlohmann::json::object();
  c.rope_theta = rope.contains("rope_theta") ? rope["rope_theta"].get<double>() : j.value("rope_theta", 10000.0);
  std::string rope_type = rope.value("rope_type", rope.value("type", "default"));
  if (rope_type == "llama3") {
    c.rope_scaling.type = "llama3";
    c.rope_scaling.factor = rope.at("factor").get<double>();
    c.rope_scaling.low_freq_factor = rope.at("low_freq_factor").get<double>();
    c.rope_scaling.high_freq_factor = rope.at("high_freq_factor").get<double>();
    c.rope_scaling.original_max_position = rope.at("original_max_position_embeddings").get<int64_t>();
  } else {
    COMB_CHECK(rope_type == "default", "{}: RoPE type '{}' is not supported (supported: default, llama3)", where,
               rope_type);
  }
  c.validate(where);
  return c;
}

nlohmann::json ModelConfig::to_hf_json() const {
  nlohmann::json j = {{"model_type", "llama"},
                      {"architectures", {"LlamaForCausalLM"}},
                      {"vocab_size", n_vocab},
                      {"hidden_size", n_embd},
                      {"intermediate_size", n_ff},
                      {"num_hidden_layers", n_layer},
                      {"num_attention_heads", n_head},
                      {"num_key_value_heads", n_head_kv},
                      {"head_dim", head_dim},
                      {"max_position_embeddings", n_ctx},
                      {"rms_norm_eps", rms_eps},
                      {"rope_theta", rope_theta},
                      {"tie_word_embeddings", tie_embeddings},
                      {"hidden_act", "silu"}};
  if (rope_scaling.type == "llama3")
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope_scaling.factor},
                         {"low_freq_factor", rope_scaling.low_freq_factor},
                         {"high_freq_factor", rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", rope_scaling.original_max_position}};
  return j;
}

// ================================================================================================
// Weights: the name table
// ================================================================================================

namespace {

enum class Dim { vocab, embd, ff, q, kv, half_head };
enum class Slot { tok_embd, output_norm, output, rope_freqs, attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down };

struct WeightSpec {
  const char* gguf;  // "{}" stands for the layer index
  const char* hf;
  Slot slot;
  std::vector<Dim> shape;
  bool per_layer;
  bool required;
};

// NOTE: one table for both layouts. GGUF's attn_q/attn_k rows are un-permuted on load (below).
const std::vector<WeightSpec>& llama_table() {
  static const std::vector<WeightSpec> table = {
      {"token_embd.weight", "model.embed_tokens.weight", Slot::tok_embd, {Dim::vocab, Dim::embd}, false, true},
      {"output_norm.weight", "model.norm.weight", Slot::output_norm, {Dim::embd}, false, true},
      {"output.weight", "lm_head.weight", Slot::output, {Dim::vocab, Dim::embd}, false, false},
      {"rope_freqs.weight", "", Slot::rope_freqs, {Dim::half_head}, false, false},
      {"blk.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight", Slot::attn_norm, {Dim::embd}, true, true},
      {"blk.{}.attn_q.weight", "model.layers.{}.self_attn.q_proj.weight", Slot::wq, {Dim::q, Dim::embd}, true, true},
      {"blk.{}.attn_k.weight", "model.layers.{}.self_attn.k_proj.weight", Slot::wk, {Dim::kv, Dim::embd}, true, true},
      {"blk.{}.attn_v.weight", "model.layers.{}.self_attn.v_proj.weight", Slot::wv, {Dim::kv, Dim::embd}, true, true},
      {"blk.{}.attn_output.weight", "model.layers.{}.self_attn.o_proj.weight", Slot::wo, {Dim::embd, Dim::q}, true, true},
      {"blk.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight", Slot::ffn_norm, {Dim::embd}, true,
       true},
      {"blk.{}.ffn_gate.weight", "model.layers.{}.mlp.gate_proj.weight", Slot::w_gate, {Dim::ff, Dim::embd}, true, true},
      {"blk.{}.ffn_up.weight", "model.layers.{}.mlp.up_proj.weight", Slot::w_up, {Dim::ff, Dim::embd}, true, true},
      {"blk.{}.ffn_down.weight", "model.layers.{}.mlp.down_proj.weight", Slot::w_down, {Dim::embd, Dim::ff}, true, true},
  };
  return table;
}

int64_t dim_size(Dim d, const ModelConfig& c) {
  switch (d) {
    case Dim::vocab: return c.n_vocab;
    case Dim::embd: return c.n_embd;
    case Dim::ff: return c.n_ff;
    case Dim::q: return c.q_dim();
    case Dim::kv: return c.kv_dim();
    case Dim::half_head: return c.head_dim / 2;
  }
  return 0;
}

std::string name_for(const char* pattern, int64_t layer) {
  std::string s = pattern;
  size_t at = s.find("{}");
  if (at != std::string::npos) s.replace(at, 2, std::to_string(layer));
  return s;
}

// GGUF converters interleave the two rotary halves of each head; restore rotate-half order.
at::Tensor unpermute_heads(const at::Tensor& w, int64_t n_heads) {
  int64_t rows = w.size(0), cols = w.size(1);
  return w.reshape({n_heads, rows / n_heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
}

}  // namespace

LlamaWeights load_llama_weights(const TensorSource& source, const ModelConfig& config, c10::ScalarType dtype,
                                c10::Device device, const std::string& hf_prefix, bool keep_quantized) {
  COMB_CHECK(!keep_quantized || (device.is_cpu() && dtype == at::kFloat),
             "weights kept quantized run on the CPU in float32 only (asked: {} {})", device.str(), c10::toString(dtype));
  struct Found {
    const WeightSpec* spec;
    int64_t layer;
    std::string name;
    bool gguf_layout;
  };
  std::vector<Found> found;
  std::vector<std::string> problems;
  for (const auto& spec : llama_table()) {
    for (int64_t layer = 0; layer < (spec.per_layer ? config.n_layer : 1); ++layer) {
      std::string gguf = name_for(spec.gguf, layer), hf = spec.hf[0] ? hf_prefix + name_for(spec.hf, layer) : "";
      const TensorInfo* info = source.find(gguf);
      bool gguf_layout = info != nullptr;
      if (!info && !hf.empty()) info = source.find(hf);
      if (!info) {
        if (spec.required) problems.push_back(fmt::format("missing '{}'", hf.empty() ? gguf : hf));
        continue;
      }
      std::vector<int64_t> want;
      for (Dim d : spec.shape) want.push_back(dim_size(d, config));
      if (info->shape != want) {
        problems.push_back(fmt::format("'{}' has shape [{}], expected [{}]", info->name, fmt::join(info->shape, ", "),
                                       fmt::join(want, ", ")));
        continue;
      }
      found.push_back({&spec, layer, info->name, gguf_layout});
    }
  }
  COMB_CHECK(problems.empty(), "'{}': {} weight problem(s) for a {}-layer llama (n_embd {}, n_ff {}, {} heads, {} kv "
             "heads, vocab {}):\n  {}",
             source.where(), problems.size(), config.n_layer, config.n_embd, config.n_ff, config.n_head,
             config.n_head_kv, config.n_vocab, fmt::join(problems, "\n  "));

  LlamaWeights w;
  w.layers.resize(config.n_layer);
  std::vector<at::Tensor> wq(config.n_layer), wk(config.n_layer), wv(config.n_layer), wg(config.n_layer),
      wu(config.n_layer);
  // Kept quantized: a layer whose seven matrices are all stored in groups, q|k|v of one kind and
  // gate|up of one kind; the embedding and the head each on their own.
  auto grouped_type = [&](const std::string& name) {
    const std::string& t = source.find(name)->dtype;
    return t == "Q4_0" ? 40 : t == "Q4_1" ? 41 : t == "Q8_0" ? 8 : 0;
  };
  auto is_matrix = [](Slot s) {
    return s == Slot::wq || s == Slot::wk || s == Slot::wv || s == Slot::wo || s == Slot::w_gate || s == Slot::w_up ||
           s == Slot::w_down;
  };
  std::vector<std::map<Slot, int>> kinds(config.n_layer);
  std::map<Slot, int> head_kinds;
  if (keep_quantized)
    for (const auto& f : found) {
      if (is_matrix(f.spec->slot)) kinds[f.layer][f.spec->slot] = grouped_type(f.name);
      if (f.spec->slot == Slot::tok_embd || f.spec->slot == Slot::output) head_kinds[f.spec->slot] = grouped_type(f.name);
    }
  std::vector<bool> layer_quantized(config.n_layer, false);
  // ATen's int4 layout takes rows in multiples of 16, and every matrix is whole groups of 32 wide.
  const bool shapes_fit = (config.q_dim() + 2 * config.kv_dim()) % 16 == 0 && config.n_embd % 32 == 0 &&
                          config.q_dim() % 32 == 0 && config.n_ff % 32 == 0 && (2 * config.n_ff) % 16 == 0;
  for (int64_t i = 0; keep_quantized && shapes_fit && i < config.n_layer; ++i) {
    auto& k = kinds[i];
    bool all = k.size() == 7;
    for (const auto& [slot, kind] : k) all = all && kind != 0;
    layer_quantized[i] = all && k[Slot::wq] == k[Slot::wk] && k[Slot::wk] == k[Slot::wv] && k[Slot::w_gate] == k[Slot::w_up];
  }
  std::vector<std::map<Slot, GroupedWeights>> grouped(config.n_layer);
  // Kept quantized: each layer is packed as soon as its seven matrices are read (layer by layer, so
  // the unpacked integers of one layer at most are held), and the fingerprint of the float load is
  // hashed from exact dequantizations, the embedding in chunks of rows.
  if (keep_quantized)
    std::stable_sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.layer < b.layer; });
  // The checkpoint's own values of layer 0's q|k|v and of the embedding, where the groups hold them
  // (as stored, not quantized on load), for the fingerprint.
  at::Tensor wqkv0_exact;
  std::optional<GroupedWeights> tok_grouped;
  // A tensor as the float load reads it: converted to `dt`, q and k rows in rotate-half order.
  auto read_dense = [&](const Found& f, c10::ScalarType dt) {
    at::Tensor t = source.load(f.name, dt);
    if (f.gguf_layout && f.spec->slot == Slot::wq) t = unpermute_heads(t, config.n_head);
    if (f.gguf_layout && f.spec->slot == Slot::wk) t = unpermute_heads(t, config.n_head_kv);
    return t;
  };
  auto pack_layer = [&](int64_t i) {
    auto& g = grouped[i];
    GroupedWeights qkv = GroupedWeights::cat({g[Slot::wq], g[Slot::wk], g[Slot::wv]});
    if (i == 0 && qkv.as_stored) wqkv0_exact = qkv.dequantize();
    auto q = std::make_shared<QuantizedLayer>();
    q->wqkv = QuantizedMatrix::from(qkv);
    q->wo = QuantizedMatrix::from(g[Slot::wo]);
    q->w_gate_up = QuantizedMatrix::from(GroupedWeights::cat({g[Slot::w_gate], g[Slot::w_up]}));
    q->w_down = QuantizedMatrix::from(g[Slot::w_down]);
    w.layers[i].quantized = std::move(q);
    g.clear();
  };
  for (const auto& f : found) {
    const bool head = f.spec->slot == Slot::tok_embd || f.spec->slot == Slot::output;
    if ((is_matrix(f.spec->slot) && layer_quantized[f.layer]) || (head && head_kinds[f.spec->slot] != 0)) {
      try {
        GroupedWeights g = *source.load_grouped(f.name);
        if (f.gguf_layout && (f.spec->slot == Slot::wq || f.spec->slot == Slot::wk)) {
          at::Tensor order = unpermute_heads(at::arange(g.rows(), at::kLong).unsqueeze(1),
                                             f.spec->slot == Slot::wq ? config.n_head : config.n_head_kv)
                                 .squeeze(1);
          g = g.select_rows(order);
        }
        if (f.spec->slot == Slot::tok_embd) {
          w.tok_embd_q = std::make_shared<const QuantizedMatrix>(QuantizedMatrix::from(g));
          if (g.as_stored) tok_grouped = std::move(g);
        } else if (f.spec->slot == Slot::output) w.output_q = std::make_shared<const QuantizedMatrix>(QuantizedMatrix::from(g));
        else if ((grouped[f.layer][f.spec->slot] = std::move(g), grouped[f.layer].size() == 7)) pack_layer(f.layer);
      } catch (const Error& e) {
        problems.push_back(e.what());
      }
      continue;
    }
    at::Tensor t;
    try {
      t = read_dense(f, f.spec->slot == Slot::rope_freqs ? at::kFloat : dtype);
    } catch (const Error& e) {
      problems.push_back(e.what());
      continue;
    }
    t = t.to(device);
    auto& l = w.layers[f.layer];
    switch (f.spec->slot) {
      case Slot::tok_embd: w.tok_embd = t; break;
      case Slot::output_norm: w.output_norm = t; break;
      case Slot::output: w.output = t; break;
      case Slot::rope_freqs: w.rope_freqs = t; break;
      case Slot::attn_norm: l.attn_norm = t; break;
      case Slot::wq: wq[f.layer] = t; break;
      case Slot::wk: wk[f.layer] = t; break;
      case Slot::wv: wv[f.layer] = t; break;
      case Slot::wo: l.wo = t; break;
      case Slot::ffn_norm: l.ffn_norm = t; break;
      case Slot::w_gate: wg[f.layer] = t; break;
      case Slot::w_up: wu[f.layer] = t; break;
      case Slot::w_down: l.w_down = t; break;
    }
  }
  COMB_CHECK(problems.empty(), "'{}': cannot read {} weight(s):\n  {}", source.where(), problems.size(),
             fmt::join(problems, "\n  "));
  if (w.quantized()) {
    // The fingerprint of these weights loaded as floats: the same model, so its plug-ins apply.
    BaseFingerprint fp(config);
    // Weights quantized on load (--quantize int8|int4) are not the checkpoint's: the fingerprint
    // reads the checkpoint's floats instead.
    auto float_of = [&](Slot slot) {
      for (const auto& f : found)
        if (f.spec->slot == slot && f.layer == 0) return read_dense(f, at::kFloat);
      COMB_FAIL("'{}': no tensor for the fingerprint", source.where());
    };
    if (tok_grouped) {
      for (int64_t r = 0; r < tok_grouped->rows(); r += 4096) {
        const int64_t n = std::min<int64_t>(4096, tok_grouped->rows() - r);
        fp.add(tok_grouped->select_rows(at::arange(r, r + n, at::kLong)).dequantize());
      }
      tok_grouped.reset();
    } else {
      fp.add(w.tok_embd.defined() ? w.tok_embd : float_of(Slot::tok_embd));
    }
    fp.add(w.output_norm);
    fp.add(w.layers[0].attn_norm);
    if (wqkv0_exact.defined())
      fp.add(wqkv0_exact);
    else if (layer_quantized[0])
      fp.add(at::cat({float_of(Slot::wq), float_of(Slot::wk), float_of(Slot::wv)}, 0));
    else
      fp.add(at::cat({wq[0], wk[0], wv[0]}, 0));
    w.fingerprint = fp.finish();
  }
  for (int64_t i = 0; i < config.n_layer; ++i) {
    if (layer_quantized[i]) continue;  // packed as it was read
    w.layers[i].wqkv = at::cat({wq[i], wk[i], wv[i]}, 0);
    w.layers[i].w_gate_up = at::cat({wg[i], wu[i]}, 0);
  }
  if (!w.output.defined() && !w.output_q) {  // no head of its own: the embedding, kept quantized or not
    COMB_CHECK(config.tie_embeddings, "'{}': no output head ('lm_head.weight' / 'output.weight') and the config does "
               "not tie embeddings", source.where());
    if (w.tok_embd_q)
      w.output_q = w.tok_embd_q;
    else
      w.output = w.tok_embd;
  }
  return w;
}

at::Tensor WeightReader::get(const std::string& name, const std::vector<int64_t>& shape, bool required) {
  const TensorInfo* info = source_.find(name);
  if (!info) {
    if (required) problems_.push_back(fmt::format("missing '{}'", name));
    return {};
  }
  if (info->shape != shape) {
    problems_.push_back(
        fmt::format("'{}' has shape [{}], expected [{}]", name, fmt::join(info->shape, ", "), fmt::join(shape, ", ")));
    return {};
  }
  try {
    return source_.load(name, dtype_).to(device_);
  } catch (const Error& e) {
    problems_.push_back(e.what());
    return {};
  }
}

LayerWeights WeightReader::layer(const std::string& p, const ModelConfig& c) {
  LayerWeights l;
  const int64_t d = c.n_embd;
  l.attn_norm = get(p + "input_layernorm.weight", {d});
  at::Tensor wq = get(p + "self_attn.q_proj.weight", {c.q_dim(), d});
  at::Tensor wk = get(p + "self_attn.k_proj.weight", {c.kv_dim(), d});
  at::Tensor wv = get(p + "self_attn.v_proj.weight", {c.kv_dim(), d});
  l.wo = get(p + "self_attn.o_proj.weight", {d, c.q_dim()});
  l.ffn_norm = get(p + "post_attention_layernorm.weight", {d});
  at::Tensor wg = get(p + "mlp.gate_proj.weight", {c.n_ff, d});
  at::Tensor wu = get(p + "mlp.up_proj.weight", {c.n_ff, d});
  l.w_down = get(p + "mlp.down_proj.weight", {d, c.n_ff});
  if (wq.defined() && wk.defined() && wv.defined()) l.wqkv = at::cat({wq, wk, wv}, 0);
  if (wg.defined() && wu.defined()) l.w_gate_up = at::cat({wg, wu}, 0);
  return l;
}

void WeightReader::finish(const std::string& what) const {
  COMB_CHECK(problems_.empty(), "'{}': {} ({} problem(s)):\n  {}", source_.where(), what, problems_.size(),
             fmt::join(problems_, "\n  "));
}

namespace {
const QuantizedMatrix& quantized_matrix(const QuantizedLayer& q, Proj p) {
  switch (p) {
    case Proj::qkv: return q.wqkv;
    case Proj::o: return q.wo;
    case Proj::gate_up: return q.w_gate_up;
    default: return q.w_down;
  }
}
const at::Tensor& layer_matrix(const LayerWeights& l, Proj p) {
  switch (p) {
    case Proj::qkv: return l.wqkv;
    case Proj::o: return l.wo;
    case Proj::gate_up: return l.w_gate_up;
    default: return l.w_down;
  }
}
}  // namespace

at::Tensor project(const LayerWeights& l, Proj p, const at::Tensor& x) {
  if (l.quantized) return quantized_matrix(*l.quantized, p).apply(x);
  return at::linear(x, layer_matrix(l, p));
}

at::Tensor dense_matrix(const LayerWeights& l, Proj p) {
  return l.quantized ? quantized_matrix(*l.quantized, p).dequantize() : layer_matrix(l, p);
}

int64_t LlamaWeights::bytes() const {
  int64_t n = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) n += t.numel() * t.element_size();
  };
  add(tok_embd), add(output_norm), add(rope_freqs);
  if (output.defined() && !(tok_embd.defined() && output.is_same(tok_embd))) add(output);
  if (tok_embd_q) n += tok_embd_q->bytes();
  if (output_q && output_q != tok_embd_q) n += output_q->bytes();
  for (const auto& l : layers) {
    for (const auto* t : {&l.attn_norm, &l.wqkv, &l.wo, &l.ffn_norm, &l.w_gate_up, &l.w_down}) add(*t);
    if (l.quantized) n += l.quantized->wqkv.bytes() + l.quantized->wo.bytes() + l.quantized->w_gate_up.bytes() +
                         l.quantized->w_down.bytes();
  }
  return n;
}

void append_llama_layer_hf_named(std::vector<std::pair<std::string, at::Tensor>>& out, const std::string& p,
                                 const LayerWeights& l, const ModelConfig& c) {
  auto qkv = dense_matrix(l, Proj::qkv).split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
  auto gu = dense_matrix(l, Proj::gate_up).split_with_sizes({c.n_ff, c.n_ff}, 0);
  out.emplace_back(p + "input_layernorm.weight", l.attn_norm);
  out.emplace_back(p + "self_attn.q_proj.weight", qkv[0]);
  out.emplace_back(p + "self_attn.k_proj.weight", qkv[1]);
  out.emplace_back(p + "self_attn.v_proj.weight", qkv[2]);
  out.emplace_back(p + "self_attn.o_proj.weight", dense_matrix(l, Proj::o));
  out.emplace_back(p + "post_attention_layernorm.weight", l.ffn_norm);
  out.emplace_back(p + "mlp.gate_proj.weight", gu[0]);
  out.emplace_back(p + "mlp.up_proj.weight", gu[1]);
  out.emplace_back(p + "mlp.down_proj.weight", dense_matrix(l, Proj::down));
}

std::vector<std::pair<std::string, at::Tensor>> llama_weights_hf_named(const LlamaWeights& w, const ModelConfig& c) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("model.embed_tokens.weight", w.tok_embd_q ? w.tok_embd_q->dequantize() : w.tok_embd);
  for (int64_t i = 0; i < c.n_layer; ++i) append_llama_layer_hf_named(out, fmt::format("model.layers.{}.", i), w.layers[i], c);
  out.emplace_back("model.norm.weight", w.output_norm);
  if (!c.tie_embeddings) out.emplace_back("lm_head.weight", w.output_q ? w.output_q->dequantize() : w.output);
  return out;
}

// ================================================================================================
// KV cache and RoPE
// ================================================================================================

KVCache::KVCache(const ModelConfig& c, int64_t batch, int64_t capacity, c10::ScalarType dtype, c10::Device device)
    : batch_(batch), capacity_(capacity) {
  COMB_CHECK(batch > 0 && capacity > 0, "KV cache needs a positive batch and capacity, found {} and {}", batch,
             capacity);
  auto options = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    k_.push_back(at::empty({batch, c.n_head_kv, capacity, c.head_dim}, options));
    v_.push_back(at::empty({batch, c.n_head_kv, capacity, c.head_dim}, options));
  }
}

std::pair<at::Tensor, at::Tensor> KVCache::append(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  int64_t n = k.size(2);
  COMB_CHECK(length_ + n <= capacity_, "KV cache full: {} positions held, {} more asked, capacity {}", length_, n,
             capacity_);
  write(layer, length_, k, v);
  return {k_[layer].narrow(2, 0, length_ + n), v_[layer].narrow(2, 0, length_ + n)};
}

void KVCache::advance(int64_t n) {
  COMB_CHECK(length_ + n <= capacity_, "KV cache: cannot advance {} past capacity {}", length_ + n, capacity_);
  length_ += n;
}

void KVCache::set_length(int64_t n) {
  COMB_CHECK(n >= 0 && n <= capacity_, "KV cache: length {} outside [0, {}]", n, capacity_);
  length_ = n;
}

void KVCache::write(int64_t layer, int64_t pos, const at::Tensor& k, const at::Tensor& v) {
  const int64_t n = k.size(2);
  COMB_CHECK(pos >= 0 && pos + n <= capacity_, "KV cache: writing [{}, {}) past capacity {}", pos, pos + n, capacity_);
  k_[layer].narrow(2, pos, n).copy_(k);
  v_[layer].narrow(2, pos, n).copy_(v);
}

void KVCache::truncate(int64_t n) {
  COMB_CHECK(n >= 0 && n <= length_, "KV cache: cannot truncate to {} (length {})", n, length_);
  length_ = n;
}

at::Tensor rope_inv_freq(const ModelConfig& c, const at::Tensor& rope_freqs) {
  // inv_freq[i] = theta^(-2i / head_dim), computed as Hugging Face does (fp32 powers of int64 steps).
  at::Tensor exponent = at::arange(0, c.head_dim, 2, at::kLong).to(at::kFloat) / static_cast<float>(c.head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(c.rope_theta, exponent);
  if (rope_freqs.defined()) return inv_freq / rope_freqs.to(at::kCPU, at::kFloat);
  if (c.rope_scaling.type == "llama3") {
    const auto& s = c.rope_scaling;
    double low_wavelen = s.original_max_position / s.low_freq_factor;
    double high_wavelen = s.original_max_position / s.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq);
    at::Tensor smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq = at::where(medium, smoothed, scaled);
  }
  return inv_freq;
}

std::pair<at::Tensor, at::Tensor> rope_tables(const ModelConfig& c, const at::Tensor& rope_freqs, int64_t n_pos,
                                              c10::ScalarType dtype, c10::Device device) {
  at::Tensor inv_freq = rope_inv_freq(c, rope_freqs);                          // [head_dim / 2]
  at::Tensor freqs = at::outer(at::arange(n_pos, at::kFloat), inv_freq);       // [n_pos, head_dim / 2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);                                // [n_pos, head_dim]
  return {emb.cos().to(device, dtype), emb.sin().to(device, dtype)};
}

// ================================================================================================
// Decoder
// ================================================================================================

Decoder::Decoder(ModelConfig config, LlamaWeights weights, c10::ScalarType dtype, c10::Device device)
    : config_(std::move(config)), weights_(std::move(weights)), dtype_(dtype), device_(device) {
  std::tie(rope_cos_, rope_sin_) = rope_tables(config_, weights_.rope_freqs, config_.n_ctx, dtype_, device_);
  if (device_.is_cpu() && dtype_ == at::kFloat) prepack_onednn();
}

}  // namespace comb

// LibTorch exports this (its ahead-of-time compiler uses it) but ships no header for it; weak, so
// that a LibTorch without it simply leaves prefill on the BLAS path.
namespace at::native {
__attribute__((weak)) void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
}

namespace comb {

// NOTE: oneDNN's fp32 GEMM beats the BLAS library's on the prefill shapes (by 15-30% on the
// development machine), but wants its own tensors. Each weight is moved into a plain-layout oneDNN
// tensor and the dense weight becomes a view of that memory: one copy of the weights, two kernels.
void Decoder::prepack_onednn() {
  if (!at::hasMKLDNN() || !at::native::data_ptr_from_mkldnn || weights_.quantized()) return;
  std::vector<std::array<at::Tensor, 4>> packed(config_.n_layer);
  std::vector<std::array<at::Tensor, 4>> views(config_.n_layer);
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    auto& l = weights_.layers[i];
    std::array<at::Tensor*, 4> dense{&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down};
    for (int k = 0; k < 4; ++k) {
      at::Tensor w = dense[k]->contiguous();
      at::Tensor m = w.to_mkldnn();
      void* data = at::native::data_ptr_from_mkldnn(m);
      if (!data) return;
      at::Tensor view = at::from_blob(data, w.sizes(), [m](void*) {}, w.options());
      if (!view.equal(w)) return;  // not the plain layout we expect: keep the BLAS path
      packed[i][k] = m;
      views[i][k] = view;
    }
  }
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    auto& l = weights_.layers[i];
    l.wqkv = views[i][0], l.wo = views[i][1], l.w_gate_up = views[i][2], l.w_down = views[i][3];
  }
  onednn_ = std::move(packed);
}

KVCache Decoder::make_cache(int64_t batch, int64_t capacity) const {
  return KVCache(config_, batch, capacity, dtype_, device_);
}

void Decoder::place(int64_t layer, KVCache& cache, int64_t pos, const at::Tensor& k, const at::Tensor& v) const {
  const auto& c = config_;
  COMB_CHECK(layer >= 0 && layer < cache.n_layers(), "place: layer {} outside [0, {})", layer, cache.n_layers());
  COMB_CHECK(k.dim() == 4 && k.size(0) == cache.batch() && k.size(1) == c.n_head_kv && k.size(3) == c.head_dim &&
                 v.sizes() == k.sizes(),
             "place: expected k, v [{}, {}, n, {}], found k [{}] and v [{}]", cache.batch(), c.n_head_kv, c.head_dim,
             fmt::join(k.sizes(), ", "), fmt::join(v.sizes(), ", "));
  const int64_t n = k.size(2);
  COMB_CHECK(pos >= 0 && pos + n <= cache.capacity(), "place: positions [{}, {}) outside the cache's capacity {}", pos,
             pos + n, cache.capacity());
  COMB_CHECK(pos + n <= rope_cos_.size(0), "place: positions [{}, {}) past the model's context of {} tokens", pos,
             pos + n, rope_cos_.size(0));
  const at::Tensor& k_cache = cache.keys(layer);
  const at::Tensor& v_cache = cache.values(layer);
  COMB_CHECK(k_cache.size(1) == c.n_head_kv && k_cache.size(3) == c.head_dim,
             "place: the cache holds [{}] per layer, this decoder needs {} KV heads of size {}",
             fmt::join(k_cache.sizes(), ", "), c.n_head_kv, c.head_dim);
  if (pos == 0) return cache.write(layer, 0, k, v);
  // The fused kernel reads k, v while it writes the cache: only for inputs in other storage than
  // the cache's (rows of the cache itself go through the generic path, which works on copies).
  const auto apart = [](const at::Tensor& a, const at::Tensor& b) { return !a.is_alias_of(b); };
  const bool in_place = cpu_kernels() && k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() &&
                        k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                        k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                        k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1 &&
                        apart(k, k_cache) && apart(v, v_cache);
  if (!in_place) {
    // apply_rope returns a new tensor; v is copied first if it shares storage with the cache.
    return cache.write(layer, pos, apply_rope(k, rope_cos_.narrow(0, pos, 1), rope_sin_.narrow(0, pos, 1)),
                       apart(v, v_cache) ? v : v.clone());
  }
  // NOTE: straight into the cache, one pass per head: the ATen rotation makes five temporaries of
  // each document's keys per layer before the copy.
  const int64_t hd = c.head_dim, cap = cache.capacity();
  const float* cos = rope_cos_.data_ptr<float>() + pos * hd;
  const float* sin = rope_sin_.data_ptr<float>() + pos * hd;
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  float* k_dst = k_cache.data_ptr<float>();
  float* v_dst = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < k.size(0); ++b) {
    for (int64_t h = 0; h < c.n_head_kv; ++h) {
      const int64_t at = ((b * c.n_head_kv + h) * cap + pos) * hd;
      detail::cpu::rotate_rows(k_src + b * k.stride(0) + h * k.stride(1), k.stride(2), cos, sin, hd, n, k_dst + at, hd);
      const float* vr = v_src + b * v.stride(0) + h * v.stride(1);
      for (int64_t i = 0; i < n; ++i) std::copy(vr + i * v.stride(2), vr + i * v.stride(2) + hd, v_dst + at + i * hd);
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  // Half precision: normalise in fp32, scale in the compute dtype (as the reference does).
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * xf.to(x.scalar_type());
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

std::array<at::Tensor, 3> split_qkv(const at::Tensor& qkv, const ModelConfig& c) {
  const int64_t batch = qkv.size(0), n = qkv.size(1);
  auto heads = [&](int64_t offset, int64_t n_heads) {
    return qkv.narrow(-1, offset, n_heads * c.head_dim).view({batch, n, n_heads, c.head_dim}).transpose(1, 2);
  };
  return {heads(0, c.n_head), heads(c.q_dim(), c.n_head_kv), heads(c.q_dim() + c.kv_dim(), c.n_head_kv)};
}

at::Tensor swiglu_mlp(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down) {
  auto parts = at::linear(x, w_gate_up).chunk(2, -1);
  return at::linear(at::silu(parts[0]) * parts[1], w_down);
}

at::Tensor swiglu_mlp(const at::Tensor& x, const LayerWeights& l) {
  if (!l.quantized) return swiglu_mlp(x, l.w_gate_up, l.w_down);
  auto parts = project(l, Proj::gate_up, x).chunk(2, -1);
  return project(l, Proj::down, at::silu(parts[0]) * parts[1]);
}

at::Tensor joint_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                           const JointKV& joint) {
  const int64_t batch = q.size(0), n_head = q.size(1), n = q.size(2), head_dim = q.size(3);
  const int64_t n_kv = keys.size(1), m = joint.keys.size(2), n_self = keys.size(2);
  COMB_CHECK(n_self == start + n, "joint attention: {} context keys for {} cached and {} new positions", n_self, start, n);
  COMB_CHECK(joint.keys.dim() == 4 && joint.keys.size(0) == batch && joint.keys.size(1) == n_kv &&
                 joint.keys.size(3) == head_dim && joint.values.sizes() == joint.keys.sizes(),
             "joint attention: keys [{}] and values [{}] should be [{}, {}, m, {}]", fmt::join(joint.keys.sizes(), ", "),
             fmt::join(joint.values.sizes(), ", "), batch, n_kv, head_dim);
  const auto dt = q.scalar_type();
  const auto opts = q.options();
  // One float mask: the joined keys' bias (or -inf where not valid), then the causal mask of the
  // context.
  const auto fopts = opts.dtype(at::kFloat);
  at::Tensor joined = joint.bias.defined()
                          ? joint.bias.to(at::kFloat).view({1, n_head, 1, 1}).expand({batch, n_head, n, m})
                          : at::zeros({batch, 1, n, m}, fopts);
  if (joint.valid.defined())
    joined = joined.masked_fill(joint.valid.logical_not().view({batch, 1, 1, m}), -INFINITY);
  if (joint.anchor > start)  // positions before the anchor (the instruction prefix) read no document
    joined = joined.masked_fill((at::arange(start, start + n, opts.dtype(at::kLong)) < joint.anchor).view({1, 1, n, 1}),
                                -INFINITY);
  at::Tensor seen = visible_keys(at::arange(start, start + n, opts.dtype(at::kLong)), n_self);  // [n, n_self]
  at::Tensor own = at::zeros({n, n_self}, fopts).masked_fill(seen.logical_not(), -INFINITY);
  // The query heads that share a KV head are folded into rows of that head, so that the joined
  // and cached K/V are read as they lie (not repeated per group): q [batch, n_kv, groups * n, d].
  const int64_t groups = n_head / n_kv;
  // Row g * n + i of KV head h is query head h * groups + g at position i.
  joined = joined.size(1) == n_head ? joined.reshape({batch, n_kv, groups * n, m})  // a bias per query head
                                    : joined.repeat({1, 1, groups, 1});
  at::Tensor mask = at::cat({joined,
                             own.repeat({groups, 1}).view({1, 1, groups * n, n_self})
                                 .expand({batch, joined.size(1), groups * n, n_self})},
                            -1);
  at::Tensor k = at::cat({joint.keys.to(dt), keys}, 2), v = at::cat({joint.values.to(dt), values}, 2);
  // Written out (not a fused kernel): a mask that needs its gradient (the bias) is not taken by all.
  at::Tensor scores = at::matmul(q.reshape({batch, n_kv, groups * n, head_dim}), k.transpose(-1, -2)).to(at::kFloat) *
                          (1.0 / std::sqrt(double(head_dim))) +
                      mask;
  return at::matmul(at::softmax(scores, -1).to(dt), v).view({batch, n_head, n, head_dim});
}

at::Tensor llama_layer(const at::Tensor& x, const LayerWeights& l, const ModelConfig& c, const at::Tensor& cos,
                       const at::Tensor& sin, bool causal, const at::Tensor& mask, const JointKV* joint) {
  const int64_t batch = x.size(0), n = x.size(1);
  auto [q, k, v] = split_qkv(project(l, Proj::qkv, rms_norm(x, l.attn_norm, c.rms_eps)), c);
  COMB_CHECK(!joint || (causal && !mask.defined()), "a layer reads joined keys only when causal and unmasked");
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  at::Tensor attn = joint ? joint_attention(q, k, v, 0, *joint)
                          : at::scaled_dot_product_attention(q, k, v,
                                                             mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                                             0.0, causal, std::nullopt, /*enable_gqa=*/true);
  at::Tensor h = x + project(l, Proj::o, attn.transpose(1, 2).reshape({batch, n, c.q_dim()}));
  return h + swiglu_mlp(rms_norm(h, l.ffn_norm, c.rms_eps), l);
}

at::Tensor visible_keys(const at::Tensor& positions, int64_t n_keys) {
  return at::arange(n_keys, positions.options().dtype(at::kLong)).unsqueeze(0) <= positions.unsqueeze(1);
}

namespace {
// Attention of n new queries q [batch, n_head, n, head_dim] that follow `start` cached positions:
// query j sees keys [0, start + j] of keys, values [batch, n_head_kv, start + n, head_dim] (grouped).
at::Tensor attend_after_cache(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start) {
  const int64_t n = q.size(2), groups = q.size(1) / keys.size(1);
  COMB_CHECK(keys.size(2) == start + n, "attention after a cache: {} keys for {} cached and {} new positions",
             keys.size(2), start, n);
  if (!q.device().is_cpu() || start == 0) {
    std::optional<at::Tensor> mask;
    if (start > 0) mask = visible_keys(at::arange(start, start + n, at::TensorOptions().device(q.device())), start + n);
    return at::scaled_dot_product_attention(q, keys, values, mask, 0.0, start == 0 && n > 1, std::nullopt, true);
  }
  // NOTE: one masked call would score every query against every key (the CPU kernel skips no
  // masked block): 61.6 against 36.8 ms a layer for 1,227 rows after 60 (docs/benchmarks.md).
  // Instead: the cached keys without a mask, the chunk's own keys causally, and the two partial
  // results merged by their log-sum-exp, which is exact. The cached part needs no mask, so the
  // query heads that share a KV head are folded into rows of that head ([batch, n_head_kv,
  // groups * n, head_dim]) and the cached K/V are read as they lie; only the chunk's own K/V are
  // repeated per group for the causal call.
  const int64_t batch = q.size(0), n_head = q.size(1), head_dim = q.size(3), n_kv = keys.size(1);
  auto [old_out, old_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q.reshape({batch, n_kv, groups * n, head_dim}), keys.narrow(2, 0, start), values.narrow(2, 0, start));
  old_out = old_out.reshape({batch, n_head, n, head_dim});
  old_lse = old_lse.reshape({batch, n_head, n});
  at::Tensor k = keys.narrow(2, start, n), v = values.narrow(2, start, n);
  if (groups > 1) {
    k = k.repeat_interleave(groups, 1);
    v = v.repeat_interleave(groups, 1);
  }
  auto [new_out, new_lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
  at::Tensor lse = at::logaddexp(old_lse, new_lse);
  return (old_out * (old_lse - lse).exp().unsqueeze(-1) + new_out * (new_lse - lse).exp().unsqueeze(-1))
      .to(q.scalar_type());
}

// Rows q [1, n_head, m, head_dim] at `pos` (int64 [m], on q's device): row j sees keys [0, pos[j]]
// of keys, values [1, n_head_kv, n_keys, head_dim] (grouped).
at::Tensor attend_at_positions(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& pos) {
  constexpr int64_t kRowsPerCall = 64;
  const int64_t m = q.size(2), n_keys = keys.size(2);
  if (!q.device().is_cpu() || m <= kRowsPerCall)
    return at::scaled_dot_product_attention(q, keys, values, visible_keys(pos, n_keys), 0.0, false, std::nullopt, true);
  // NOTE: the CPU kernel scores every key of a masked call, so rows scattered over a long cache
  // (CacheBlend's chosen tokens, EPIC's document heads) would each score all n_keys. In groups of
  // rows, a call scores only the keys up to its group's last position: about half the work when
  // the rows spread evenly.
  const at::Tensor p = pos.contiguous();
  const int64_t* at_p = p.data_ptr<int64_t>();
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < m; r += kRowsPerCall) {
    const int64_t rows = std::min(kRowsPerCall, m - r);
    const int64_t seen = std::min(n_keys, *std::max_element(at_p + r, at_p + r + rows) + 1);
    parts.push_back(at::scaled_dot_product_attention(q.narrow(2, r, rows), keys.narrow(2, 0, seen),
                                                     values.narrow(2, 0, seen), visible_keys(p.narrow(0, r, rows), seen),
                                                     0.0, false, std::nullopt, true));
  }
  return at::cat(parts, 2);
}
}  // namespace

at::Tensor Decoder::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  return comb::rms_norm(x, weight, config_.rms_eps);
}

at::Tensor Decoder::attention(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint) const {
  const auto& c = config_;
  const int64_t batch = x.size(0), n = x.size(1), start = cache.length();
  auto [q, k, v] = split_qkv(project(weights_.layers[i], Proj::qkv, x), c);
  at::Tensor cos = rope_cos_.narrow(0, start, n), sin = rope_sin_.narrow(0, start, n);
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  auto [keys, values] = cache.append(i, k, v);  // [batch, n_head_kv, start + n, head_dim]
  at::Tensor out;
  if (joint) {
    out = joint_attention(q, keys, values, start, *joint);
  } else if (n == 1) {
    out = at::scaled_dot_product_attention(q, keys, values, {}, 0.0, false, std::nullopt, /*enable_gqa=*/true);
  } else {  // query j sees keys [0, start + j]
    out = attend_after_cache(q, keys, values, start);
  }
  out = out.transpose(1, 2).reshape({batch, n, c.q_dim()});
  return project(weights_.layers[i], Proj::o, out);
}

at::Tensor Decoder::feed_forward(int64_t i, const at::Tensor& x) const {
  return swiglu_mlp(x, weights_.layers[i]);
}

at::Tensor Decoder::keys_at(int64_t i, const at::Tensor& x, const at::Tensor& positions) const {
  const auto& c = config_;
  at::Tensor k = split_qkv(project(weights_.layers[i], Proj::qkv, rms_norm(x, weights_.layers[i].attn_norm)), c)[1];
  at::Tensor pos = positions.to(device_, at::kLong);
  return apply_rope(k, rope_cos_.index_select(0, pos), rope_sin_.index_select(0, pos));
}

at::Tensor Decoder::layer_at(int64_t i, const at::Tensor& x, const at::Tensor& positions, KVCache& cache,
                             int64_t n_keys) const {
  const auto& c = config_;
  const auto& w = weights_.layers[i];
  const int64_t m = x.size(1);
  COMB_CHECK(x.size(0) == 1 && positions.numel() == m, "layer_at takes one sequence: x [1, {}], {} positions", m,
             positions.numel());
  COMB_CHECK(n_keys <= cache.capacity(), "layer_at: {} keys past the cache capacity {}", n_keys, cache.capacity());
  at::Tensor pos = positions.to(device_, at::kLong);
  auto [q, k, v] = split_qkv(project(w, Proj::qkv, rms_norm(x, w.attn_norm)), c);
  at::Tensor cos = rope_cos_.index_select(0, pos), sin = rope_sin_.index_select(0, pos);
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  cache.keys(i).index_copy_(2, pos, k.to(cache.keys(i).scalar_type()));
  cache.values(i).index_copy_(2, pos, v.to(cache.values(i).scalar_type()));
  at::Tensor keys = cache.keys(i).narrow(2, 0, n_keys), values = cache.values(i).narrow(2, 0, n_keys);
  // Rows that are the last m of the n_keys positions, in order (CacheBlend's pass below its check
  // layer, EPIC when it recomputes a whole tail), are a prefill after `start` cached positions.
  const int64_t start = n_keys - m;
  const at::Tensor cpu_positions = positions.cpu().to(at::kLong);
  at::Tensor attn = start >= 0 && at::equal(cpu_positions, at::arange(start, n_keys, at::kLong))
                        ? attend_after_cache(q, keys, values, start)
                        : attend_at_positions(q, keys, values, pos);
  at::Tensor h = x + project(w, Proj::o, attn.transpose(1, 2).reshape({1, m, c.q_dim()}));
  return h + feed_forward(i, rms_norm(h, w.ffn_norm));
}

at::Tensor Decoder::embed(const at::Tensor& tokens) const {
  RECORD_FUNCTION("comb::embed", std::vector<c10::IValue>());
  if (weights_.tok_embd_q) return weights_.tok_embd_q->gather_rows(tokens.to(device_, at::kLong));
  return at::embedding(weights_.tok_embd, tokens.to(device_, at::kLong));
}

// ---- The fused fp32 CPU path ------------------------------------------------------------------

namespace {
// Steps of up to this many rows (decode, small batches) use fused kernels throughout; longer ones
// are GEMM-bound and keep the BLAS and SDPA kernels.
constexpr int64_t kFusedMaxRows = 4;
}

at::Tensor Decoder::rms_norm_cpu(const at::Tensor& x, const at::Tensor& w) const {
  RECORD_FUNCTION("comb::rms_norm", std::vector<c10::IValue>());
  at::Tensor in = x.contiguous(), out = at::empty_like(in);
  const int64_t dim = in.size(-1), rows = in.numel() / dim;
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    detail::cpu::rms_norm_rows(in.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), dim,
                               static_cast<float>(config_.rms_eps), b, e);
  });
  return out;
}

at::Tensor Decoder::linear_cpu(const at::Tensor& x, const at::Tensor& w) const {
  RECORD_FUNCTION("comb::gemv_f32", std::vector<c10::IValue>());
  const int64_t k = x.size(-1), rows = x.numel() / k, n_out = w.size(0);
  COMB_CHECK(rows <= kFusedMaxRows, "linear_cpu is for at most {} rows, found {}", kFusedMaxRows, rows);
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape.back() = n_out;
  at::Tensor out = at::empty(shape, in.options());
  at::parallel_for(0, n_out, 256, [&](int64_t b, int64_t e) {
    detail::cpu::gemv_rows(in.data_ptr<float>(), rows, w.data_ptr<float>(), k, out.data_ptr<float>(), n_out, b, e);
  });
  return out;
}

at::Tensor Decoder::layer_cpu(int64_t i, const at::Tensor& x, KVCache& cache) const {
  const auto& c = config_;
  const auto& w = weights_.layers[i];
  const int64_t batch = x.size(0), n = x.size(1), rows = batch * n, start = cache.length();
  COMB_CHECK(start + n <= cache.capacity(), "KV cache full: {} positions held, {} more asked, capacity {}", start, n,
             cache.capacity());
  // Few rows (decode): fused kernels throughout. Many rows (prefill): oneDNN GEMMs (packed at load) and SDPA (after
  // cached rows: attend_after_cache), fused RoPE.
  const bool few = rows <= kFusedMaxRows;
  auto norm = [&](const at::Tensor& t, const at::Tensor& weight) {
    return few ? rms_norm_cpu(t, weight) : at::rms_norm(t, {c.n_embd}, weight, c.rms_eps);
  };
  auto linear = [&](const at::Tensor& t, const at::Tensor& weight, int slot) {
    if (w.quantized) return project(w, static_cast<Proj>(slot), t);
    if (few) return linear_cpu(t, weight);
    if (onednn_.empty()) return at::linear(t, weight);
    at::Tensor flat = t.reshape({rows, t.size(-1)}).contiguous();
    return at::mkldnn_linear(flat.to_mkldnn(), onednn_[i][slot]).to_dense().view({batch, n, weight.size(0)});
  };
  at::Tensor qkv = linear(norm(x, w.attn_norm), w.wqkv, 0).contiguous();  // [batch, n, q_dim + 2 kv_dim]
  at::Tensor q = at::empty({batch, n, c.n_head, c.head_dim}, x.options());
  detail::cpu::AttentionShape shape{n, start, c.n_head, c.n_head_kv, c.head_dim, cache.capacity()};
  float* k_cache = cache.keys(i).data_ptr<float>();
  float* v_cache = cache.values(i).data_ptr<float>();
  RECORD_FUNCTION("comb::rope_and_store_kv", std::vector<c10::IValue>());
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    detail::cpu::rope_and_store(qkv.data_ptr<float>(), rope_cos_.data_ptr<float>(), rope_sin_.data_ptr<float>(), shape,
                                q.data_ptr<float>(), k_cache, v_cache, b, e);
  });
  at::Tensor attn;
  if (few) {
    RECORD_FUNCTION("comb::attention", std::vector<c10::IValue>());
    attn = at::empty({batch, n, c.q_dim()}, x.options());
    at::parallel_for(0, batch * c.n_head, 1, [&](int64_t b, int64_t e) {
      std::vector<float> scratch(start + n);
      detail::cpu::attention_rows(q.data_ptr<float>(), k_cache, v_cache, shape, attn.data_ptr<float>(),
                                  scratch.data(), b, e);
    });
  } else {
    at::Tensor keys = cache.keys(i).narrow(2, 0, start + n), values = cache.values(i).narrow(2, 0, start + n);
    attn = attend_after_cache(q.transpose(1, 2), keys, values, start)
               .transpose(1, 2)
               .reshape({batch, n, c.q_dim()});
  }
  at::Tensor h = x + linear(attn, w.wo, 1);
  at::Tensor gate_up = linear(norm(h, w.ffn_norm), w.w_gate_up, 2);  // [batch, n, 2 n_ff]
  at::Tensor act;
  if (few) {
    RECORD_FUNCTION("comb::silu_mul", std::vector<c10::IValue>());
    act = at::empty({batch, n, c.n_ff}, x.options());
    detail::cpu::silu_mul_rows(gate_up.data_ptr<float>(), act.data_ptr<float>(), c.n_ff, 0, rows);
  } else {
    auto parts = gate_up.chunk(2, -1);
    act = at::silu(parts[0]).mul_(parts[1]);
  }
  return h.add_(linear(act, w.w_down, 3));
}

// ---- Generic path -----------------------------------------------------------------------------

at::Tensor Decoder::layer(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint) const {
  if (cpu_kernels() && !joint) return layer_cpu(i, x, cache);
  at::Tensor h = x + attention(i, rms_norm(x, weights_.layers[i].attn_norm), cache, joint);
  return h + feed_forward(i, rms_norm(h, weights_.layers[i].ffn_norm));
}

at::Tensor Decoder::logits(const at::Tensor& x, LogitsMode mode) const {
  at::Tensor h = mode == LogitsMode::last ? x.narrow(1, x.size(1) - 1, 1) : x;
  if (weights_.output_q) return weights_.output_q->apply(rms_norm(h, weights_.output_norm));  // float32
  if (cpu_kernels() && h.size(0) * h.size(1) <= kFusedMaxRows)
    return linear_cpu(rms_norm_cpu(h, weights_.output_norm), weights_.output);
  return at::linear(rms_norm(h, weights_.output_norm), weights_.output).to(at::kFloat);
}

at::Tensor Decoder::forward(const at::Tensor& tokens, KVCache& cache, LogitsMode mode,
                            const LayerHook& before_layer, const JointHook& joint) const {
  COMB_CHECK(tokens.dim() == 2 && tokens.size(1) > 0, "decoder input should be [batch, n>0] token ids, found shape [{}]",
             fmt::join(tokens.sizes(), ", "));
  COMB_CHECK(tokens.size(0) == cache.batch(), "decoder input batch {} does not match the KV cache batch {}",
             tokens.size(0), cache.batch());
  const int64_t n = tokens.size(1);
  COMB_CHECK(cache.length() + n <= config_.n_ctx, "{} positions exceed the model's context of {} tokens",
             cache.length() + n, config_.n_ctx);
  at::Tensor x = embed(tokens);
  for (int64_t i = 0; i < config_.n_layer; ++i)
    x = layer(i, before_layer ? before_layer(i, x) : x, cache, joint ? joint(i) : nullptr);
  cache.advance(n);
  return logits(x, mode);
}

// ================================================================================================
// Sampling
// ================================================================================================

Sampler::Sampler(SamplingOptions options) : options_(options), rng_(options.seed) {
  COMB_CHECK(options.temperature >= 0, "temperature must be >= 0, found {}", options.temperature);
  COMB_CHECK(options.top_k >= 0, "top-k must be >= 0, found {}", options.top_k);
  COMB_CHECK(options.top_p > 0 && options.top_p <= 1, "top-p must be in (0, 1], found {}", options.top_p);
}

int32_t Sampler::sample(const at::Tensor& logits) {
  at::Tensor l = logits.to(at::kCPU, at::kFloat).contiguous();
  if (options_.temperature == 0) return static_cast<int32_t>(l.argmax().item<int64_t>());
  at::Tensor sorted, order;
  std::tie(sorted, order) = (l / options_.temperature).sort(/*dim=*/-1, /*descending=*/true);
  int64_t keep = sorted.size(0);
  if (options_.top_k > 0) keep = std::min(keep, options_.top_k);
  at::Tensor probs = at::softmax(sorted.narrow(0, 0, keep), 0);
  const float* p = probs.data_ptr<float>();
  if (options_.top_p < 1) {  // smallest prefix whose mass reaches top_p
    double mass = 0;
    int64_t i = 0;
    while (i < keep && mass < options_.top_p) mass += p[i++];
    keep = std::max<int64_t>(i, 1);
  }
  double total = std::accumulate(p, p + keep, 0.0);
  double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  int64_t pick = 0;
  for (double acc = p[0]; acc < u && pick + 1 < keep; acc += p[++pick]) {
  }
  return static_cast<int32_t>(order[pick].item<int64_t>());
}

// ================================================================================================
// Model
// ================================================================================================

c10::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  COMB_FAIL("unknown dtype '{}' (expected float32, bfloat16 or float16)", name);
}

namespace {
c10::Device parse_device(const std::string& name) {
  try {
    return c10::Device(name);
  } catch (const c10::Error&) {
    COMB_FAIL("unknown device '{}' (expected cpu, cuda or cuda:N)", name);
  }
}
}  // namespace

Model Model::load(const std::string& path, const Options& options) {
  c10::Device device = parse_device(options.device);
  c10::ScalarType dtype = parse_dtype(options.dtype);
  COMB_CHECK(!(device.is_cpu() && dtype == at::kHalf), "float16 is supported on CUDA only; use float32 or bfloat16 on CPU");
  if (device.is_cuda())
    COMB_CHECK(cuda_available(), "device '{}' asked for, but this machine (or this LibTorch) has no CUDA device ({})",
               options.device, load_cuda_backend().detail);
  if (options.threads > 0) at::set_num_threads(options.threads);
  // No autograd while loading, but ordinary tensors (not inference tensors), so that training can
  // run the frozen decoder under autograd.
  c10::AutoGradMode no_grad(false);
  Model m;
  std::unique_ptr<TensorSource> source = open_tensor_source(path);
  ModelConfig config;
  std::string hf_prefix;
  std::optional<PluginConfig> combined;  // a COMB checkpoint's plug-in
  if (auto* gguf = dynamic_cast<GgufFile*>(source.get())) {
    config = ModelConfig::from_gguf(*gguf);
    m.tokenizer_ = std::make_shared<Tokenizer>(Tokenizer::from_gguf(*gguf));
  } else {
    fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
    std::string config_path = (dir / "config.json").string();
    nlohmann::json j = nlohmann::json::parse(detail::read_text_file(config_path), nullptr, false);
    COMB_CHECK(!j.is_discarded(), "'{}': not valid JSON", config_path);
    if (j.value("model_type", "") == "combllama") {
      // The reference layout: the decoder under language_model.*, text_config its config, and
      // num_hidden_layers counting decoder layers plus cross blocks.
      COMB_CHECK(j.contains("text_config") && j.contains("cross_attention_layers"),
                 "'{}': a combllama config needs text_config and cross_attention_layers", config_path);
      nlohmann::json text = j["text_config"];
      combined = PluginConfig::from_json(j, config_path);
      if (j.contains("comb")) combined->max_document_tokens = j["comb"].value("max_document_tokens", int64_t(0));
      int64_t total = j.value("num_hidden_layers", text.value("num_hidden_layers", int64_t(0)));
      text["num_hidden_layers"] = total - combined->n_blocks();
      text["model_type"] = "llama";
      config = ModelConfig::from_hf_json(text, config_path + " (text_config)");
      hf_prefix = "language_model.";
    } else {
      config = ModelConfig::from_hf_json(j, config_path);
    }
    m.tokenizer_ = std::make_shared<Tokenizer>(Tokenizer::from_hf_file((dir / "tokenizer.json").string()));
  }
  COMB_CHECK(m.tokenizer_->n_vocab() <= config.n_vocab, "'{}': the tokenizer has {} tokens but the model only {}", path,
             m.tokenizer_->n_vocab(), config.n_vocab);
  COMB_CHECK(options.quantize == "none" || options.quantize == "gguf" || options.quantize == "int8" ||
                 options.quantize == "int4",
             "--quantize: expected none, gguf (GGUF Q4_0/Q4_1/Q8_0 kept as stored), int8 or int4 (quantized on load), "
             "found '{}'", options.quantize);
  const bool keep_quantized = options.quantize != "none";
  if (keep_quantized) {
    COMB_CHECK(options.quantize != "gguf" || dynamic_cast<GgufFile*>(source.get()),
               "--quantize gguf keeps a GGUF file's quantized tensors; '{}' is not a GGUF file (--quantize int8 or int4 "
               "quantizes float weights on load)", path);
    COMB_CHECK(device.is_cpu() && dtype == at::kFloat, "--quantize {} runs on the CPU with --dtype float32 (asked: "
               "{} {})", options.quantize, options.device, options.dtype);
    if (options.quantize != "gguf")  // every matrix, in groups of 32: int8 (embedding and head too) or int4 layers
      source = quantizing_source(std::move(source), options.quantize == "int8" ? GroupedWeights::Kind::q8
                                                                                : GroupedWeights::Kind::q4);
  }
  LlamaWeights weights = load_llama_weights(*source, config, dtype, device, hf_prefix, keep_quantized);
  if (weights.quantized()) weights.quantization = options.quantize;
  m.decoder_ = std::make_shared<Decoder>(std::move(config), std::move(weights), dtype, device);
  m.decoder_->set_cpu_kernels(options.cpu_kernels);
  if (combined) m.plugin_ = std::make_shared<Plugin>(Plugin::from_checkpoint(*source, *combined, *m.decoder_));
  if (!options.plugin.empty()) {
    COMB_CHECK(!combined, "'{}' already carries a plug-in; --plugin cannot add another", path);
    m.plugin_ = std::make_shared<Plugin>(Plugin::load(options.plugin, *m.decoder_));
  }
  if (!m.tokenizer_->chat_template().empty()) {
    m.chat_template_ = std::make_shared<ChatTemplate>(ChatTemplate::from_source(m.tokenizer_->chat_template()));
  }
  return m;
}

void Model::set_plugin(std::shared_ptr<const Plugin> plugin) {
  if (plugin) {
    std::string fp = base_fingerprint(*decoder_);
    COMB_CHECK(plugin->config().base_fingerprint.empty() || plugin->config().base_fingerprint == fp,
               "the plug-in was built for another base decoder (fingerprint {}); this model's is {}",
               plugin->config().base_fingerprint, fp);
  }
  plugin_ = std::move(plugin);
}

std::shared_ptr<const DocumentKV> Model::document(const std::vector<int32_t>& tokens, PICacheStore* store,
                                                  const std::string& tenant, bool* from_cache) const {
  COMB_CHECK(plugin_, "documents need a plug-in: load one with Options::plugin (--plugin FILE)");
  c10::InferenceMode guard;
  if (from_cache) *from_cache = false;
  if (!store) return std::make_shared<const DocumentKV>(plugin_->encode(*decoder_, tokens));
  CacheKey key = PICacheStore::key(tokens, plugin_->fingerprint() + decoder_->weights().cache_tag(), tenant);
  if (auto hit = store->get(key)) {
    if (from_cache) *from_cache = true;
    return hit;
  }
  return store->put(key, plugin_->encode(*decoder_, tokens));
}

at::Tensor Model::forward(const at::Tensor& tokens, KVCache& cache, const LinkedDocuments* documents,
                          LogitsMode mode) const {
  if (!documents || documents->empty()) return decoder_->forward(tokens, cache, mode);
  COMB_CHECK(plugin_, "documents need a plug-in: load one with Options::plugin (--plugin FILE)");
  COMB_CHECK(static_cast<int64_t>(documents->doc_counts.size()) == tokens.size(0),
             "linked documents are for a batch of {}, the tokens a batch of {}", documents->doc_counts.size(),
             tokens.size(0));
  COMB_CHECK(static_cast<int64_t>(documents->keys.size()) == plugin_->config().n_blocks(),
             "linked documents have {} blocks, the plug-in {}", documents->keys.size(),
             plugin_->config().n_blocks());
  if (plugin_->config().joint_attention) {  // the blocks join their layers' attention
    auto& joined = *documents->joined;
    std::vector<JointKV> joint;
    {
      std::lock_guard<std::mutex> lock(joined.mutex);
      if (joined.plugin != plugin_->fingerprint() || joined.anchor != documents->anchor) {
        joined.blocks = plugin_->joint_kv(plugin_->weights(), documents->keys, documents->values, documents->doc_counts,
                                          documents->anchor);
        joined.plugin = plugin_->fingerprint();
        joined.anchor = documents->anchor;
      }
      joint = joined.blocks;  // tensors are shared, not copied
    }
    return decoder_->forward(tokens, cache, mode, nullptr, [&](int64_t layer) -> const JointKV* {
      int64_t k = plugin_->block_before(layer);
      return k < 0 ? nullptr : &joint[k];
    });
  }
  COMB_CHECK(documents->anchor == 0, "documents anchored after a prefix need a plug-in with documents_after_prefix");
  const int64_t start = cache.length();  // the prompt position of the first new token
  return decoder_->forward(tokens, cache, mode, [&](int64_t layer, const at::Tensor& x) {
    int64_t k = plugin_->block_before(layer);
    return k < 0 ? x
                 : plugin_->cross_block(k, x, documents->keys[k], documents->values[k], documents->doc_counts, start);
  });
}

void Model::save(const std::string& dir) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  COMB_CHECK(fs::is_directory(dir), "cannot create directory '{}': {}", dir, ec.message());
  const auto& c = config();
  nlohmann::json text = c.to_hf_json();
  auto tensors = llama_weights_hf_named(decoder_->weights(), c);
  nlohmann::json j = text;
  if (plugin_) {
    for (auto& [name, t] : tensors) name = "language_model." + name;
    auto extra = plugin_->named_tensors();
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    int64_t n_blocks = plugin_->config().n_blocks();
    text["num_hidden_layers"] = c.n_layer + n_blocks;
    j = {{"model_type", "combllama"},
         {"architectures", {"CombLlamaForConditionalGeneration"}},
         {"text_config", text},
         {"cross_attention_layers", plugin_->config().cross_layers},
         {"num_hidden_layers", c.n_layer + n_blocks},
         {"tie_word_embeddings", c.tie_embeddings},
         {"comb", {{"max_document_tokens", plugin_->config().max_document_tokens}}}};
    // A layout other than the reference's names its keys beside cross_attention_layers.
    const nlohmann::json layout = plugin_->config().to_json();
    for (const auto& [key, value] : layout.items())
      if (key != "cross_attention_layers" && key != "max_document_tokens" && key != "base_fingerprint") j[key] = value;
  }
  save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  detail::write_file_atomic(dir + "/config.json", j.dump(2));
  tokenizer_->save_hf(dir);
}

const ChatTemplate& Model::chat_template() const {
  COMB_CHECK(chat_template_, "this model ships no chat template (none in its GGUF metadata, tokenizer_config.json "
             "or chat_template.jinja); send the prompt raw instead (comb generate --raw)");
  return *chat_template_;
}

std::vector<int32_t> Model::chat_prompt(const std::string& user_message) const {
  std::string text = chat_template().apply({{"user", user_message}}, true);
  std::vector<int32_t> ids;
  auto bos = tokenizer_->bos_id();
  if (tokenizer_->add_bos() && bos && text.rfind(tokenizer_->token_bytes(*bos), 0) != 0) ids.push_back(*bos);
  auto body = tokenizer_->encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

GenerationResult Model::generate(const std::vector<int32_t>& prompt, const GenerateOptions& options,
                                 const LinkedDocuments* documents) const {
  const auto& c = config();
  COMB_CHECK(!prompt.empty(), "the prompt is empty");
  COMB_CHECK(static_cast<int64_t>(prompt.size()) < c.n_ctx,
             "the prompt has {} tokens but the model's context holds {} (one more is needed to answer)", prompt.size(),
             c.n_ctx);
  COMB_CHECK(options.max_tokens >= 0, "max tokens must be >= 0, found {}", options.max_tokens);
  for (int32_t id : prompt)
    COMB_CHECK(id >= 0 && id < c.n_vocab, "prompt token {} is outside the vocabulary [0, {})", id, c.n_vocab);
  c10::InferenceMode guard;
  auto started = std::chrono::steady_clock::now();
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  KVCache cache = decoder_->make_cache(1, std::min<int64_t>(c.n_ctx, n_prompt + options.max_tokens));
  at::Tensor input = at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()), at::kLong).unsqueeze(0);
  at::Tensor logits = forward(input, cache, documents)[0][-1];
  return decode(cache, logits, options, documents, started, n_prompt);
}

GenerationResult Model::decode(KVCache& cache, at::Tensor logits, const GenerateOptions& options,
                               const LinkedDocuments* documents, std::chrono::steady_clock::time_point started,
                               int64_t n_prompt) const {
  using clock = std::chrono::steady_clock;
  const auto& c = config();
  c10::InferenceMode guard;
  std::vector<int32_t> stops = options.stop_tokens;
  if (auto eos = tokenizer_->eos_id()) stops.push_back(*eos);
  if (chat_template_)
    if (auto eot = tokenizer_->find_token(chat_template_->end_of_turn())) stops.push_back(*eot);
  GenerationResult r;
  r.n_prompt = n_prompt;
  Sampler sampler(options.sampling);
  StreamDecoder stream(*tokenizer_);
  auto t0 = clock::now();
  r.stop_reason = "max_tokens";
  const int64_t limit = std::min(c.n_ctx, cache.capacity());
  for (int64_t step = 0; step < options.max_tokens; ++step) {
    int32_t token = sampler.sample(logits);
    if (step == 0) {
      auto now = clock::now();
      r.ttft_ms = std::chrono::duration<double, std::milli>(now - started).count();
      r.prefill_ms = std::chrono::duration<double, std::milli>(now - started).count();
      t0 = now;
    }
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      r.stop_reason = "stop_token";
      break;
    }
    r.tokens.push_back(token);
    r.logprobs.push_back(at::log_softmax(logits, 0)[token].item<float>());
    std::string piece = stream.push(token);
    r.text += piece;
    if (options.on_token && !options.on_token(token, piece)) {
      r.stop_reason = "callback";
      break;
    }
    if (step + 1 == options.max_tokens) break;
    if (cache.length() >= limit) {
      r.stop_reason = "context_full";
      break;
    }
    logits = forward(at::full({1, 1}, static_cast<int64_t>(token), at::kLong), cache, documents)[0][-1];
  }
  std::string rest = stream.flush();
  r.text += rest;
  if (!rest.empty() && options.on_token) options.on_token(-1, rest);
  if (!r.tokens.empty()) r.decode_ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  return r;
}

}  // namespace comb
