// The COMB plug-in: encoder, cross blocks, fresh initialisation, plug-in files.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <xxhash.h>

#include <cmath>

#include "comb/error.hpp"
#include "comb/ops.hpp"
#include "comb/plugin.hpp"
#include "comb/safetensors.hpp"

namespace comb {

// ================================================================================================
// Config, fingerprints, DocumentKV
// ================================================================================================

nlohmann::json PluginConfig::to_json() const {
  return {{"cross_attention_layers", cross_layers},
          {"max_document_tokens", max_document_tokens},
          {"base_fingerprint", base_fingerprint}};
}

PluginConfig PluginConfig::from_json(const nlohmann::json& j, const std::string& where) {
  PluginConfig c;
  COMB_CHECK(j.contains("cross_attention_layers") && j["cross_attention_layers"].is_array(),
             "{}: plug-in config needs a 'cross_attention_layers' list", where);
  c.cross_layers = j["cross_attention_layers"].get<std::vector<int64_t>>();
  c.max_document_tokens = j.value("max_document_tokens", int64_t(0));
  c.base_fingerprint = j.value("base_fingerprint", "");
  return c;
}

namespace {
std::string hex128(XXH128_hash_t h) { return fmt::format("{:016x}{:016x}", h.high64, h.low64); }

void hash_tensor(XXH3_state_t* state, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  XXH3_128bits_update(state, c.data_ptr(), c.numel() * c.element_size());
}
}  // namespace

std::string base_fingerprint(const Decoder& base) {
  const auto& c = base.config();
  const auto& w = base.weights();
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  std::string dims = fmt::format("{} {} {} {} {} {} {} {} {}", c.architecture, c.n_vocab, c.n_embd, c.n_ff, c.n_layer,
                                 c.n_head, c.n_head_kv, c.head_dim, c.rope_theta);
  XXH3_128bits_update(state, dims.data(), dims.size());
  for (const at::Tensor& t : {w.tok_embd, w.output_norm, w.layers[0].attn_norm, w.layers[0].wqkv})
    hash_tensor(state, t.to(at::kBFloat16));
  std::string out = hex128(XXH3_128bits_digest(state));
  XXH3_freeState(state);
  return out;
}

// ================================================================================================
// Plugin
// ================================================================================================

namespace {
void check_cross_layers(const std::vector<int64_t>& layers, int64_t n_layer) {
  COMB_CHECK(!layers.empty(), "a plug-in needs at least one encoder layer and cross block");
  for (size_t k = 0; k < layers.size(); ++k) {
    COMB_CHECK(layers[k] >= 0 && layers[k] < n_layer,
               "cross block {} sits before decoder layer {}, but the base has {} layers", k, layers[k], n_layer);
    COMB_CHECK(k == 0 || layers[k] > layers[k - 1], "cross_attention_layers must increase, found {}",
               fmt::join(layers, ", "));
  }
}
}  // namespace

Plugin::Plugin(PluginConfig config, PluginWeights weights, const Decoder& base)
    : config_(std::move(config)), weights_(std::move(weights)), base_config_(base.config()) {
  check_cross_layers(config_.cross_layers, base_config_.n_layer);
  if (config_.max_document_tokens <= 0) config_.max_document_tokens = base_config_.n_ctx;
  // A plug-in that does not name its base (a merged checkpoint's) is bound to this one, so its
  // fingerprint, and with it every cache key of its documents, depends on the base.
  if (config_.base_fingerprint.empty()) config_.base_fingerprint = base_fingerprint(base);
  refresh_fingerprint();
}

void Plugin::refresh_fingerprint() {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  std::string c = config_.to_json().dump();
  XXH3_128bits_update(state, c.data(), c.size());
  for (const auto& [name, t] : named_tensors()) {
    XXH3_128bits_update(state, name.data(), name.size());
    hash_tensor(state, t);
  }
  fingerprint_ = hex128(XXH3_128bits_digest(state));
  XXH3_freeState(state);
}

int64_t Plugin::block_before(int64_t layer) const {
  for (int64_t k = 0; k < config_.n_encoder_layers(); ++k)
    if (config_.cross_layers[k] == layer) return k;
  return -1;
}

Plugin Plugin::fresh(const Decoder& base, const PluginInitOptions& o) {
  const auto& c = base.config();
  const auto& bw = base.weights();
  PluginConfig config;
  config.cross_layers = o.cross_layers;
  if (config.cross_layers.empty()) {
    COMB_CHECK(o.n_encoder_layers > 0 && o.n_encoder_layers < c.n_layer,
               "--encoder-layers must be in [1, {}] for this base, found {}", c.n_layer - 1, o.n_encoder_layers);
    for (int64_t k = 0; k < o.n_encoder_layers; ++k)
      config.cross_layers.push_back(o.first_layers ? k + 1 : (k + 1) * c.n_layer / o.n_encoder_layers - 1);
  }
  check_cross_layers(config.cross_layers, c.n_layer);
  config.max_document_tokens = c.n_ctx;
  config.base_fingerprint = base_fingerprint(base);
  auto gen = at::detail::createCPUGenerator(o.seed);
  auto opts = at::TensorOptions().dtype(base.dtype()).device(base.device());
  auto randn = [&](std::vector<int64_t> shape) {
    return (at::randn(shape, gen, at::kFloat) * o.init_std).to(opts.device(), opts.dtype().toScalarType());
  };
  auto ones = [&](int64_t n) { return at::ones({n}, opts); };
  PluginWeights w;
  if (o.first_layers && o.copy_decoder_layers) {
    // Encoder layer j = decoder layer j; block k reads it with decoder layer cross_layers[k]'s attention.
    at::Tensor probe = at::arange(1000, 1000 + 64, at::kLong).to(base.device());
    at::Tensor h = at::embedding(bw.tok_embd, probe).unsqueeze(0);
    at::Tensor cos = base.rope_cos().narrow(0, 0, 64), sin = base.rope_sin().narrow(0, 0, 64);
    for (size_t k = 0; k < config.cross_layers.size(); ++k) {
      const LayerWeights& src = bw.layers.at(k);
      w.encoder.push_back({src.attn_norm.clone(), src.wqkv.clone(), src.wo.clone(), src.ffn_norm.clone(),
                           src.w_gate_up.clone(), src.w_down.clone()});
      // The RMS of encoder states after this layer on a probe sequence, to scale V to the decoder's.
      h = llama_layer(h, src, c, cos, sin, /*causal=*/false);
      const double rms = h.to(at::kFloat).pow(2).mean().sqrt().item<double>();
      const LayerWeights& dst = bw.layers.at(config.cross_layers[k]);
      auto qkv = dst.wqkv.split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
      at::Tensor g = dst.attn_norm.unsqueeze(0);
      w.wk.push_back((qkv[1] * g).contiguous());
      w.wv.push_back((qkv[2] * g / rms).contiguous());
      w.cross.push_back({dst.attn_norm.clone(), qkv[0].clone(), ones(c.head_dim), ones(c.head_dim), dst.wo.clone(),
                         at::zeros({1}, opts), dst.ffn_norm.clone(), dst.w_gate_up.clone(), dst.w_down.clone(),
                         at::zeros({1}, opts)});
    }
    return Plugin(std::move(config), std::move(w), base);
  }
  for (int64_t layer : config.cross_layers) {
    const LayerWeights& src = bw.layers.at(layer);
    auto qkv = src.wqkv.split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
    if (o.copy_decoder_layers) {
      w.encoder.push_back({src.attn_norm.clone(), src.wqkv.clone(), src.wo.clone(), src.ffn_norm.clone(),
                           src.w_gate_up.clone(), src.w_down.clone()});
      w.wk.push_back(qkv[1].clone());
      w.wv.push_back(qkv[2].clone());
      w.cross.push_back({src.attn_norm.clone(), qkv[0].clone(), ones(c.head_dim), ones(c.head_dim), src.wo.clone(),
                         at::zeros({1}, opts), src.ffn_norm.clone(), src.w_gate_up.clone(), src.w_down.clone(),
                         at::zeros({1}, opts)});
    } else {
      w.encoder.push_back({ones(c.n_embd), randn({c.q_dim() + 2 * c.kv_dim(), c.n_embd}), randn({c.n_embd, c.q_dim()}),
                           ones(c.n_embd), randn({2 * c.n_ff, c.n_embd}), randn({c.n_embd, c.n_ff})});
      w.wk.push_back(randn({c.kv_dim(), c.n_embd}));
      w.wv.push_back(randn({c.kv_dim(), c.n_embd}));
      w.cross.push_back({ones(c.n_embd), randn({c.q_dim(), c.n_embd}), ones(c.head_dim), ones(c.head_dim),
                         randn({c.n_embd, c.q_dim()}), at::zeros({1}, opts), ones(c.n_embd),
                         randn({2 * c.n_ff, c.n_embd}), randn({c.n_embd, c.n_ff}), at::zeros({1}, opts)});
    }
  }
  return Plugin(std::move(config), std::move(w), base);
}

std::vector<std::pair<std::string, at::Tensor>> Plugin::named_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& c = base_config_;
  if (weights_.tok_embd.defined()) out.emplace_back("chunk_model.embed_tokens.weight", weights_.tok_embd);
  for (size_t j = 0; j < weights_.encoder.size(); ++j) {
    append_llama_layer_hf_named(out, fmt::format("chunk_model.layers.{}.", j), weights_.encoder[j], c);
    out.emplace_back(fmt::format("chunk_model.k_proj.{}.weight", j), weights_.wk[j]);
    out.emplace_back(fmt::format("chunk_model.v_proj.{}.weight", j), weights_.wv[j]);
  }
  for (size_t k = 0; k < weights_.cross.size(); ++k) {
    const auto& b = weights_.cross[k];
    std::string p = fmt::format("language_model.model.cross_layers.{}.", k);
    auto gu = b.w_gate_up.split_with_sizes({c.n_ff, c.n_ff}, 0);
    out.emplace_back(p + "input_layernorm.weight", b.attn_norm);
    out.emplace_back(p + "cross_attn.q_proj.weight", b.wq);
    out.emplace_back(p + "cross_attn.q_norm.weight", b.q_norm);
    out.emplace_back(p + "cross_attn.k_norm.weight", b.k_norm);
    out.emplace_back(p + "cross_attn.o_proj.weight", b.wo);
    out.emplace_back(p + "cross_attn_attn_gate", b.attn_gate);
    out.emplace_back(p + "post_attention_layernorm.weight", b.ffn_norm);
    out.emplace_back(p + "mlp.gate_proj.weight", gu[0]);
    out.emplace_back(p + "mlp.up_proj.weight", gu[1]);
    out.emplace_back(p + "mlp.down_proj.weight", b.w_down);
    out.emplace_back(p + "cross_attn_mlp_gate", b.mlp_gate);
  }
  return out;
}

Plugin Plugin::from_checkpoint(const TensorSource& source, const PluginConfig& config, const Decoder& base) {
  const auto& c = base.config();
  check_cross_layers(config.cross_layers, c.n_layer);
  WeightReader r(source, base.dtype(), base.device());
  PluginWeights w;
  w.tok_embd = r.get("chunk_model.embed_tokens.weight", {c.n_vocab, c.n_embd}, /*required=*/false);
  const int64_t d = c.n_embd;
  for (int64_t j = 0; j < config.n_encoder_layers(); ++j) {
    w.encoder.push_back(r.layer(fmt::format("chunk_model.layers.{}.", j), c));
    w.wk.push_back(r.get(fmt::format("chunk_model.k_proj.{}.weight", j), {c.kv_dim(), d}));
    w.wv.push_back(r.get(fmt::format("chunk_model.v_proj.{}.weight", j), {c.kv_dim(), d}));
    std::string p = fmt::format("language_model.model.cross_layers.{}.", j);
    CrossBlockWeights b;
    b.attn_norm = r.get(p + "input_layernorm.weight", {d});
    b.wq = r.get(p + "cross_attn.q_proj.weight", {c.q_dim(), d});
    b.q_norm = r.get(p + "cross_attn.q_norm.weight", {c.head_dim});
    b.k_norm = r.get(p + "cross_attn.k_norm.weight", {c.head_dim});
    b.wo = r.get(p + "cross_attn.o_proj.weight", {d, c.q_dim()});
    b.attn_gate = r.get(p + "cross_attn_attn_gate", {1});
    b.ffn_norm = r.get(p + "post_attention_layernorm.weight", {d});
    at::Tensor wg = r.get(p + "mlp.gate_proj.weight", {c.n_ff, d});
    at::Tensor wu = r.get(p + "mlp.up_proj.weight", {c.n_ff, d});
    b.w_down = r.get(p + "mlp.down_proj.weight", {d, c.n_ff});
    b.mlp_gate = r.get(p + "cross_attn_mlp_gate", {1});
    if (wg.defined() && wu.defined()) b.w_gate_up = at::cat({wg, wu}, 0);
    w.cross.push_back(std::move(b));
  }
  r.finish(fmt::format("COMB plug-in with {} encoder layers does not fit the base decoder (n_embd {}, n_ff {}, {} heads, "
                       "{} kv heads, head_dim {})",
                       config.n_encoder_layers(), c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim));
  return Plugin(config, std::move(w), base);
}

Plugin Plugin::load(const std::string& path, const Decoder& base) {
  SafetensorsFile file(path);
  auto it = file.metadata().find("comb.plugin");
  COMB_CHECK(it != file.metadata().end(), "'{}' is not a comb plug-in file (no 'comb.plugin' metadata)", path);
  nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
  COMB_CHECK(!j.is_discarded(), "'{}': 'comb.plugin' metadata is not valid JSON", path);
  PluginConfig config = PluginConfig::from_json(j, path);
  std::string base_fp = base_fingerprint(base);
  COMB_CHECK(config.base_fingerprint.empty() || config.base_fingerprint == base_fp,
             "'{}' was built for another base decoder (fingerprint {}); this model's is {}", path,
             config.base_fingerprint, base_fp);
  return from_checkpoint(file, config, base);
}

void Plugin::save(const std::string& path, c10::ScalarType dtype) const {
  auto tensors = named_tensors();
  if (dtype != c10::ScalarType::Undefined)
    for (auto& [name, t] : tensors) t = t.detach().to(dtype);
  save_safetensors(path, tensors,
                   {{"format", "pt"}, {"comb.plugin", config_.to_json().dump()},
                    {"comb.base_config", base_config_.to_hf_json().dump()}});
}

// ================================================================================================
// Forward
// ================================================================================================

DocumentKV Plugin::encode(const Decoder& base, const std::vector<int32_t>& tokens) const {
  const auto& c = base_config_;
  const int64_t n = static_cast<int64_t>(tokens.size());
  COMB_CHECK(n > 0, "a document is empty: the encoder needs at least one token");
  COMB_CHECK(n <= config_.max_document_tokens, "a document has {} tokens; the encoder takes at most {}", n,
             config_.max_document_tokens);
  for (int32_t id : tokens)
    COMB_CHECK(id >= 0 && id < c.n_vocab, "document token {} is outside the vocabulary [0, {})", id, c.n_vocab);
  at::Tensor ids = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong).to(base.device());
  at::Tensor h = at::embedding(weights_.tok_embd.defined() ? weights_.tok_embd : base.weights().tok_embd, ids)
                     .unsqueeze(0);  // [1, n, n_embd]
  at::Tensor cos = base.rope_cos().narrow(0, 0, n), sin = base.rope_sin().narrow(0, 0, n);
  DocumentKV out;
  out.n_tokens = n;
  for (int64_t j = 0; j < config_.n_encoder_layers(); ++j) {
    h = llama_layer(h, weights_.encoder[j], c, cos, sin, /*causal=*/false);
    // K_E after k_norm (stored so, never recomputed per decode step), V_E as is: [n_head_kv, n, head_dim]
    at::Tensor ke = at::linear(h, weights_.wk[j]).view({n, c.n_head_kv, c.head_dim});
    out.keys.push_back(rms_norm(ke, weights_.cross[j].k_norm, c.rms_eps).transpose(0, 1).contiguous());
    out.values.push_back(at::linear(h, weights_.wv[j]).view({n, c.n_head_kv, c.head_dim}).transpose(0, 1).contiguous());
  }
  return out;
}

at::Tensor Plugin::cross_block(int64_t k, const at::Tensor& x, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts) const {
  const auto& c = base_config_;
  const auto& b = weights_.cross[k];
  const int64_t batch = x.size(0), n = x.size(1);
  at::Tensor q = at::linear(rms_norm(x, b.attn_norm, c.rms_eps), b.wq).view({batch, n, c.n_head, c.head_dim});
  q = rms_norm(q, b.q_norm, c.rms_eps);
  at::Tensor attn = ops::cross_attention(q, keys, values, doc_counts, 1.0 / std::sqrt(double(c.head_dim)));
  at::Tensor h = x + at::tanh(b.attn_gate) * at::linear(attn.reshape({batch, n, c.q_dim()}), b.wo);
  return h + at::tanh(b.mlp_gate) * swiglu_mlp(rms_norm(h, b.ffn_norm, c.rms_eps), b.w_gate_up, b.w_down);
}

}  // namespace comb
