// The COMB plug-in: encoder, cross blocks, fresh initialisation, plug-in files.
// Compiled into libcomb (src/plugin.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include "comb/detail/cpu_kernels.hpp"
#include "comb/detail/decode_step.hpp"
#include "comb/detail/json.hpp"
#include "comb/error.hpp"
#include "comb/ops.hpp"
#include "comb/detail/hash.hpp"
#include "comb/plugin.hpp"
#include "comb/safetensors.hpp"

namespace comb {

// ================================================================================================
// Config, fingerprints, DocumentKV
// ================================================================================================

COMB_INLINE nlohmann::json PluginConfig::to_json() const {
  nlohmann::json j = {{"cross_attention_layers", cross_layers},
                      {"max_document_tokens", max_document_tokens},
                      {"base_fingerprint", base_fingerprint}};
  // The layout's keys only where they differ from the reference layout, so its files stay as they were.
  if (encoder_layers > 0) j["encoder_layers"] = encoder_layers;
  if (!read_depths.empty()) j["read_depths"] = read_depths;
  if (encoder_from_base) j["encoder_from_base"] = true;
  if (encoder_causal) j["encoder_causal"] = true;
  if (!encoder_prefix.empty()) j["encoder_prefix"] = encoder_prefix;
  if (kv_norm) j["kv_norm"] = true;
  if (!qk_norm) j["qk_norm"] = false;
  if (relative_positions) j["relative_positions"] = true;
  if (attention_sinks) j["attention_sinks"] = true;
  if (!cross_mlp) j["cross_mlp"] = false;
  if (joint_attention) j["joint_attention"] = true;
  if (documents_after_prefix) j["documents_after_prefix"] = true;
  if (consecutive_documents) j["consecutive_documents"] = true;
  if (document_span > 0) j["document_span"] = document_span;
  if (document_near > 0) j["document_near"] = document_near;
  if (!cache_dtype.empty()) j["cache_dtype"] = cache_dtype;
  return j;
}

// ---- DocumentReads ---------------------------------------------------------------------------

namespace detail::plugin {  // this file's own helpers
COMB_INLINE void check_linked_blocks(const Plugin& plugin, size_t keys, size_t values) {
  COMB_CHECK(static_cast<int64_t>(keys) == plugin.config().n_blocks() && keys == values,
             "linked documents have {} blocks of keys and {} of values, the plug-in {}", keys, values,
             plugin.config().n_blocks());
}
}  // namespace detail::plugin

COMB_INLINE DocumentReads::DocumentReads(const Plugin& plugin, const PluginWeights& w, Mode mode, bool paged)
    : plugin_(&plugin), weights_(&w), mode_(mode) {
  if (mode == Mode::residual) return;
  COMB_CHECK(plugin.config().joint_attention, "joined documents are read by joint-attention plug-ins only");
  if (!paged) return;  // only a paged step (segments()) reads the biases as float32
  for (int64_t k = 0; k < plugin.config().n_blocks(); ++k) {
    const at::Tensor& b = w.cross.at(k).doc_bias;
    bias_.push_back(b.defined() ? b.to(at::kFloat).contiguous() : at::Tensor());
  }
}

COMB_INLINE DocumentReads DocumentReads::residual(const Plugin& plugin, const PluginWeights& w,
                                                  std::vector<std::vector<at::Tensor>> keys,
                                                  std::vector<std::vector<at::Tensor>> values,
                                                  std::vector<int64_t> doc_counts) {
  COMB_CHECK(!plugin.config().joint_attention,
             "this plug-in's blocks join their layers' attention: read its documents with DocumentReads::joined");
  detail::plugin::check_linked_blocks(plugin, keys.size(), values.size());
  DocumentReads r(plugin, w, Mode::residual, false);
  r.keys_ = std::move(keys);
  r.values_ = std::move(values);
  r.doc_counts_ = std::move(doc_counts);
  return r;
}

COMB_INLINE DocumentReads DocumentReads::residual(const Plugin& plugin, const LinkedDocuments& linked) {
  COMB_CHECK(!plugin.config().joint_attention,
             "this plug-in's blocks join their layers' attention: read its documents with DocumentReads::joined");
  detail::plugin::check_linked_blocks(plugin, linked.keys.size(), linked.values.size());
  DocumentReads r(plugin, plugin.weights(), Mode::residual, false);
  r.linked_ = &linked;
  return r;
}

COMB_INLINE DocumentReads DocumentReads::joined(const Plugin& plugin, std::vector<JointKV> joint, bool paged) {
  COMB_CHECK(static_cast<int64_t>(joint.size()) == plugin.config().n_blocks(), "{} joined blocks, the plug-in has {}",
             joint.size(), plugin.config().n_blocks());
  DocumentReads r(plugin, plugin.weights(), Mode::joined, paged);
  r.joint_ = std::move(joint);
  return r;
}

COMB_INLINE DocumentReads DocumentReads::segmented(const Plugin& plugin, std::vector<std::vector<at::Tensor>> keys,
                                                   std::vector<std::vector<at::Tensor>> values) {
  detail::plugin::check_linked_blocks(plugin, keys.size(), values.size());
  DocumentReads r(plugin, plugin.weights(), Mode::segmented, true);
  r.keys_ = std::move(keys);
  r.values_ = std::move(values);
  return r;
}

COMB_INLINE at::Tensor DocumentReads::before(int64_t layer, const at::Tensor& x, int64_t start) const {
  if (mode_ != Mode::residual) return x;
  const int64_t k = plugin_->block_before(layer);
  if (k < 0) return x;
  if (linked_) return plugin_->cross_block(*weights_, k, x, linked_->keys[k], linked_->values[k], linked_->doc_counts, start);
  return plugin_->cross_block(*weights_, k, x, keys_[k], values_[k], doc_counts_, start);
}

COMB_INLINE const JointKV* DocumentReads::joint(int64_t layer) const {
  if (mode_ != Mode::joined) return nullptr;
  const int64_t k = plugin_->block_before(layer);
  return k < 0 ? nullptr : &joint_[k];
}

COMB_INLINE JointSegments DocumentReads::segments(int64_t layer) const {
  JointSegments s;
  const int64_t k = mode_ == Mode::residual ? -1 : plugin_->block_before(layer);
  if (k < 0) return s;
  auto add = [&](const at::Tensor& keys, const at::Tensor& values, int64_t n) {
    COMB_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat && keys.is_contiguous() &&
                   values.is_contiguous() && keys.device().is_cpu(),
               "a paged step reads documents as contiguous float32 CPU tensors, found {} on {}",
               c10::toString(keys.scalar_type()), keys.device().str());
    s.keys.push_back(keys.data_ptr<float>());
    s.values.push_back(values.data_ptr<float>());
    s.lengths.push_back(n);
  };
  if (mode_ == Mode::joined) {
    const JointKV& j = joint_[k];
    COMB_CHECK(j.keys.size(0) == 1, "a paged step reads one request's joined documents, found a batch of {}",
               j.keys.size(0));
    add(j.keys, j.values, j.keys.size(2));
  } else {
    for (size_t d = 0; d < keys_[k].size(); ++d) add(keys_[k][d], values_[k][d], keys_[k][d].size(1));
  }
  COMB_CHECK(!bias_.empty(), "a paged step reads joined documents built for it: DocumentReads::joined(..., paged = true)");
  if (bias_[k].defined()) s.bias = bias_[k].data_ptr<float>();
  return s;
}

namespace detail::plugin {  // this file's own helpers
// What PluginConfig::cache_dtype may be set from: "float32" (kept as "", the dtype as computed),
// "bfloat16", "float16", "int8", "int8-int4", "int4".
COMB_INLINE bool is_cache_dtype_name(const std::string& name) {
  return name == "float32" || name == "bfloat16" || name == "float16" || name == "int8" || name == "int8-int4" ||
         name == "int4";
}
}  // namespace detail::plugin

COMB_INLINE PluginConfig PluginConfig::from_json(const nlohmann::json& j, const std::string& where) {
  PluginConfig c;
  COMB_CHECK(j.is_object(), "{}: plug-in config should be a JSON object", where);
  COMB_CHECK(j.contains("cross_attention_layers") && j["cross_attention_layers"].is_array(),
             "{}: plug-in config needs a 'cross_attention_layers' list", where);
  auto ints = [&](const char* key) {
    const auto& v = j[key];
    COMB_CHECK(v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_number_integer(); }),
               "{}: plug-in config '{}' should be a list of integers", where, key);
    return v.get<std::vector<int64_t>>();
  };
  auto integer = [&](const char* key, int64_t fallback) {
    if (!j.contains(key)) return fallback;
    COMB_CHECK(j[key].is_number_integer(), "{}: plug-in config '{}' should be an integer", where, key);
    return j[key].get<int64_t>();
  };
  auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key)) return fallback;
    COMB_CHECK(j[key].is_boolean(), "{}: plug-in config '{}' should be true or false", where, key);
    return j[key].get<bool>();
  };
  c.cross_layers = ints("cross_attention_layers");
  c.max_document_tokens = integer("max_document_tokens", 0);
  COMB_CHECK(!j.contains("base_fingerprint") || j["base_fingerprint"].is_string(),
             "{}: plug-in config 'base_fingerprint' should be a string", where);
  c.base_fingerprint = j.value("base_fingerprint", "");
  c.encoder_layers = integer("encoder_layers", 0);
  if (j.contains("read_depths")) c.read_depths = ints("read_depths");
  c.encoder_from_base = flag("encoder_from_base", false);
  c.encoder_causal = flag("encoder_causal", false);
  if (j.contains("encoder_prefix")) c.encoder_prefix = ints("encoder_prefix");
  c.kv_norm = flag("kv_norm", false);
  c.qk_norm = flag("qk_norm", true);
  c.relative_positions = flag("relative_positions", false);
  c.attention_sinks = flag("attention_sinks", false);
  c.cross_mlp = flag("cross_mlp", true);
  c.joint_attention = flag("joint_attention", false);
  c.documents_after_prefix = flag("documents_after_prefix", false);
  c.consecutive_documents = flag("consecutive_documents", false);
  c.document_span = integer("document_span", 0);  // their bounds: detail::plugin::check_layout
  c.document_near = integer("document_near", 0);
  if (j.contains("cache_dtype")) {
    const auto& v = j["cache_dtype"];
    COMB_CHECK(v.is_string() && detail::plugin::is_cache_dtype_name(v.get<std::string>()),
               "{}: plug-in config 'cache_dtype' should be float32, bfloat16, float16, int8, int8-int4 or int4, found {}", where,
               v.dump());
    c.cache_dtype = v == "float32" ? "" : v.get<std::string>();
  }
  return c;
}

namespace detail::plugin {  // this file's own helpers
// A decoder layer's weights as new float tensors (dequantized when kept quantized): a plug-in's
// starting point is its own copy.
COMB_INLINE LayerWeights dense_copy(const LayerWeights& l) {
  return {l.attn_norm.clone(), dense_matrix(l, Proj::qkv).clone(), dense_matrix(l, Proj::o).clone(), l.ffn_norm.clone(),
          dense_matrix(l, Proj::gate_up).clone(), dense_matrix(l, Proj::down).clone(), nullptr};
}
}  // namespace detail::plugin

// ================================================================================================
// Plugin
// ================================================================================================

namespace detail::plugin {  // this file's own helpers
COMB_INLINE void check_layout(const PluginConfig& p, const ModelConfig& c) {
  const auto& layers = p.cross_layers;
  COMB_CHECK(!layers.empty(), "a plug-in needs at least one cross block");
  for (size_t k = 0; k < layers.size(); ++k) {
    COMB_CHECK(layers[k] >= 0 && layers[k] < c.n_layer,
               "cross block {} sits before decoder layer {}, but the base has {} layers", k, layers[k], c.n_layer);
    COMB_CHECK(k == 0 || layers[k] > layers[k - 1], "cross_attention_layers must increase, found {}",
               fmt::join(layers, ", "));
  }
  COMB_CHECK(p.encoder_layers >= 0, "encoder_layers must be 0 (one per block) or more, found {}", p.encoder_layers);
  COMB_CHECK(p.read_depths.empty() || p.read_depths.size() == layers.size(),
             "read_depths names {} depths for {} cross blocks", p.read_depths.size(), layers.size());
  for (int64_t k = 0; k < p.n_blocks(); ++k)
    COMB_CHECK(p.read_depth(k) >= 0 && p.read_depth(k) <= p.n_encoder_layers(),
               "cross block {} reads the states after {} encoder layers, but the encoder has {}", k, p.read_depth(k),
               p.n_encoder_layers());
  for (int64_t id : p.encoder_prefix)
    COMB_CHECK(id >= 0 && id < c.n_vocab, "encoder_prefix token {} is outside the vocabulary [0, {})", id, c.n_vocab);
  COMB_CHECK(!p.joint_attention || (!p.qk_norm && !p.cross_mlp && !p.attention_sinks && p.relative_positions),
             "joint cross blocks have no QK-norm, MLP or sinks of their own and read documents at relative positions "
             "(joint_attention with qk_norm {}, cross_mlp {}, attention_sinks {}, relative_positions {})",
             p.qk_norm, p.cross_mlp, p.attention_sinks, p.relative_positions);
  COMB_CHECK(!p.documents_after_prefix || p.joint_attention,
             "documents_after_prefix is a layout of joint cross blocks (joint_attention), not of residual ones");
  COMB_CHECK(!p.consecutive_documents || p.joint_attention,
             "consecutive_documents is a layout of joint cross blocks (joint_attention), not of residual ones");
  COMB_CHECK(p.document_span >= 0, "a plug-in's document_span is 0 (off) or a number of tokens, found {}",
             p.document_span);
  COMB_CHECK(p.document_span == 0 || p.consecutive_documents,
             "document_span ({} tokens) shrinks the distances of consecutive documents; this plug-in's documents are not "
             "consecutive", p.document_span);
  COMB_CHECK(p.document_near >= 0, "a plug-in's document_near is 0 or a number of tokens, found {}", p.document_near);
  COMB_CHECK(p.document_near == 0 || p.document_near < p.document_span,
             "a plug-in's document_near ({} tokens) keeps the distances below its document_span, so it is smaller than "
             "the span ({}{})", p.document_near, p.document_span, p.document_span == 0 ? ": none set" : "");
  COMB_CHECK(!p.encoder_from_base || p.n_encoder_layers() <= c.n_layer,
             "an encoder of the base's layers can have at most its {} layers, found {}", c.n_layer,
             p.n_encoder_layers());
}
}  // namespace detail::plugin

COMB_INLINE Plugin::Plugin(PluginConfig config, PluginWeights weights, const Decoder& base)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      base_config_(base.config()),
      rope_cos_(base.rope_cos()),
      rope_sin_(base.rope_sin()) {
  detail::plugin::check_layout(config_, base_config_);
  if (config_.max_document_tokens <= 0) config_.max_document_tokens = base_config_.n_ctx;
  // A plug-in that does not name its base (a merged checkpoint's) is bound to this one, so its
  // fingerprint, and with it every cache key of its documents, depends on the base.
  if (config_.base_fingerprint.empty()) config_.base_fingerprint = base_fingerprint(base);
  if (config_.encoder_from_base) {
    // The base's layers, shared (not copied, not saved): the file names the base by fingerprint.
    weights_.encoder.assign(base.weights().layers.begin(), base.weights().layers.begin() + config_.n_encoder_layers());
  }
  refresh_fingerprint();
}

COMB_INLINE Plugin Plugin::with_blocks(const std::vector<int64_t>& keep, const Decoder& base) const {
  const PluginConfig& p = config_;
  COMB_CHECK(!keep.empty(), "with_blocks: no block to keep (the plug-in has {})", p.n_blocks());
  for (size_t i = 0; i < keep.size(); ++i)
    COMB_CHECK(keep[i] >= 0 && keep[i] < p.n_blocks() && (i == 0 || keep[i] > keep[i - 1]),
               "with_blocks: block indices increasing in [0, {}), found {} at place {}{}", p.n_blocks(), keep[i], i,
               i > 0 && keep[i] == keep[i - 1] ? " (repeated)" : "");
  PluginConfig c = p;
  PluginWeights w;
  w.tok_embd = weights_.tok_embd;
  c.cross_layers.clear();
  c.read_depths.clear();
  int64_t deepest = 0;
  for (int64_t k : keep) {
    c.cross_layers.push_back(p.cross_layers[k]);
    c.read_depths.push_back(p.read_depth(k));
    deepest = std::max(deepest, p.read_depth(k));
    if (p.kv_norm) w.kv_norm.push_back(weights_.kv_norm[k]);
    w.wk.push_back(weights_.wk[k]);
    w.wv.push_back(weights_.wv[k]);
    w.cross.push_back(weights_.cross[k]);
  }
  // The encoder's layers up to the deepest depth read (at least one: 0 would mean one a block).
  c.encoder_layers = std::max<int64_t>(deepest, 1);
  if (!p.encoder_from_base) {  // its own layers, the first encoder_layers of them
    COMB_CHECK(static_cast<int64_t>(weights_.encoder.size()) >= c.encoder_layers,
               "with_blocks: the encoder has {} layers, the kept blocks read depth {}", weights_.encoder.size(),
               c.encoder_layers);
    w.encoder.assign(weights_.encoder.begin(), weights_.encoder.begin() + c.encoder_layers);
  }
  return Plugin(std::move(c), std::move(w), base);
}

COMB_INLINE void Plugin::set_document_span(int64_t tokens, int64_t near) {
  PluginConfig next = config_;  // checked as a whole before anything changes
  next.document_span = tokens;
  next.document_near = near;
  detail::plugin::check_layout(next, base_config_);
  config_ = std::move(next);
  refresh_fingerprint();
}

COMB_INLINE void Plugin::set_cache_dtype(const std::string& dtype) {
  COMB_CHECK(dtype.empty() || detail::plugin::is_cache_dtype_name(dtype),
             "a plug-in's cache dtype is float32, bfloat16, float16, int8, int8-int4 or int4, found '{}'", dtype);
  config_.cache_dtype = dtype == "float32" ? "" : dtype;
  refresh_fingerprint();
}

COMB_INLINE void Plugin::refresh_fingerprint() {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  std::string c = config_.to_json().dump();
  XXH3_128bits_update(state, c.data(), c.size());
  for (const auto& [name, t] : named_tensors()) {
    XXH3_128bits_update(state, name.data(), name.size());
    detail::hash::hash_tensor(state, t);
  }
  fingerprint_ = detail::hash::hex128(XXH3_128bits_digest(state));
  XXH3_freeState(state);
}

COMB_INLINE int64_t Plugin::block_before(int64_t layer) const {
  for (int64_t k = 0; k < config_.n_blocks(); ++k)
    if (config_.cross_layers[k] == layer) return k;
  return -1;
}

namespace detail::plugin {  // this file's own helpers
// Per head, the median log-sum-exp of decoder layer `layer`'s causal attention scores over the
// probes' positions after the first 8: how much a head attends to its own context there.
COMB_INLINE std::vector<at::Tensor> self_attention_lse(const Decoder& base, const std::vector<int64_t>& layers,
                                           const std::vector<std::vector<int32_t>>& probes) {
  const auto& c = base.config();
  const auto& bw = base.weights();
  c10::InferenceMode guard;
  std::vector<std::vector<at::Tensor>> per_layer(layers.size());
  for (const auto& probe : probes) {
    const int64_t n = static_cast<int64_t>(probe.size());
    COMB_CHECK(n > 8 && n <= c.n_ctx, "a probe prompt has {} tokens; it needs 9 to {}", n, c.n_ctx);
    at::Tensor ids = at::tensor(std::vector<int64_t>(probe.begin(), probe.end()), at::kLong).to(base.device());
    at::Tensor x = base.embed(ids).unsqueeze(0);
    at::Tensor cos = base.rope_cos().narrow(0, 0, n), sin = base.rope_sin().narrow(0, 0, n);
    at::Tensor causal = at::ones({n, n}, at::TensorOptions().dtype(at::kBool).device(base.device())).tril();
    for (int64_t i = 0; i <= layers.back(); ++i) {
      const LayerWeights& l = bw.layers[i];
      auto at_layer = std::find(layers.begin(), layers.end(), i);
      if (at_layer != layers.end()) {
        auto [q, k, v] = split_qkv(project(l, Proj::qkv, rms_norm(x, l.attn_norm, c.rms_eps)), c);
        q = apply_rope(q, cos, sin).to(at::kFloat);
        k = apply_rope(k, cos, sin).to(at::kFloat).repeat_interleave(c.n_head / c.n_head_kv, 1);
        at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(double(c.head_dim));
        at::Tensor lse = at::logsumexp(scores.masked_fill(causal.logical_not(), -INFINITY), -1);  // [1, H, n]
        per_layer[at_layer - layers.begin()].push_back(lse[0].narrow(1, 8, n - 8));
      }
      x = llama_layer(x, l, c, cos, sin, /*causal=*/true);
    }
  }
  std::vector<at::Tensor> out;
  for (auto& parts : per_layer) out.push_back(std::get<0>(at::cat(parts, 1).median(1)));  // [H]
  return out;
}
}  // namespace detail::plugin

COMB_INLINE Plugin Plugin::fresh(const Decoder& base, const PluginInitOptions& o) {
  const auto& c = base.config();
  const auto& bw = base.weights();
  PluginConfig config;
  if (o.reads) {
    COMB_CHECK(!o.cross_layers.empty(), "a plug-in that reads from the start needs its cross layers (--cross-layers)");
    COMB_CHECK(o.joint_attention || !o.probes.empty(), "a plug-in that reads from the start needs probe prompts for its sinks");
    COMB_CHECK(o.open_gate > 0 && o.open_gate < 1, "the open gate must be in (0, 1), found {}", o.open_gate);
    config.cross_layers = o.cross_layers;
    config.read_depths = o.cross_layers;
    config.encoder_layers = std::max<int64_t>(1, o.cross_layers.back());
    config.encoder_from_base = config.encoder_causal = config.kv_norm = true;
    config.attention_sinks = !o.joint_attention;
    config.joint_attention = o.joint_attention;
    config.documents_after_prefix = o.joint_attention && o.documents_after_prefix;
    config.consecutive_documents = o.joint_attention && o.consecutive_documents;
    config.qk_norm = config.cross_mlp = false;
    config.relative_positions = o.relative_positions;
    config.encoder_prefix = o.encoder_prefix;
    config.max_document_tokens = c.n_ctx - static_cast<int64_t>(o.encoder_prefix.size());
    config.base_fingerprint = base_fingerprint(base);
    detail::plugin::check_layout(config, c);
    std::vector<at::Tensor> lse;
    if (!o.joint_attention) lse = detail::plugin::self_attention_lse(base, config.cross_layers, o.probes);
    auto opts = at::TensorOptions().dtype(base.dtype()).device(base.device());
    PluginWeights w;
    for (size_t k = 0; k < config.cross_layers.size(); ++k) {
      const LayerWeights& l = bw.layers.at(config.cross_layers[k]);
      auto qkv = dense_matrix(l, Proj::qkv).split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
      w.kv_norm.push_back(l.attn_norm.clone());
      w.wk.push_back(qkv[1].clone());
      w.wv.push_back(qkv[2].clone());
      CrossBlockWeights b;
      if (o.joint_attention) {  // the layer's own attention does the rest
        b.doc_bias = at::zeros({c.n_head}, opts);
        w.cross.push_back(std::move(b));
        continue;
      }
      b.attn_norm = l.attn_norm.clone();
      b.wq = qkv[0].clone();
      b.wo = dense_matrix(l, Proj::o).clone();
      b.attn_gate = at::full({1}, std::atanh(o.open_gate), opts);
      b.sinks = lse[k].to(opts.device(), opts.dtype().toScalarType());
      w.cross.push_back(std::move(b));
    }
    return Plugin(std::move(config), std::move(w), base);
  }
  config.cross_layers = o.cross_layers;
  if (config.cross_layers.empty()) {
    COMB_CHECK(o.n_encoder_layers > 0 && o.n_encoder_layers < c.n_layer,
               "--encoder-layers must be in [1, {}] for this base, found {}", c.n_layer - 1, o.n_encoder_layers);
    for (int64_t k = 0; k < o.n_encoder_layers; ++k)
      config.cross_layers.push_back(o.first_layers ? k + 1 : (k + 1) * c.n_layer / o.n_encoder_layers - 1);
  }
  detail::plugin::check_layout(config, c);
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
    at::Tensor h = base.embed(probe).unsqueeze(0);
    at::Tensor cos = base.rope_cos().narrow(0, 0, 64), sin = base.rope_sin().narrow(0, 0, 64);
    for (size_t k = 0; k < config.cross_layers.size(); ++k) {
      const LayerWeights& src = bw.layers.at(k);
      w.encoder.push_back(detail::plugin::dense_copy(src));
      // The RMS of encoder states after this layer on a probe sequence, to scale V to the decoder's.
      h = llama_layer(h, src, c, cos, sin, /*causal=*/false);
      const double rms = h.to(at::kFloat).pow(2).mean().sqrt().item<double>();
      const LayerWeights& dst = bw.layers.at(config.cross_layers[k]);
      auto qkv = dense_matrix(dst, Proj::qkv).split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
      at::Tensor g = dst.attn_norm.unsqueeze(0);
      w.wk.push_back((qkv[1] * g).contiguous());
      w.wv.push_back((qkv[2] * g / rms).contiguous());
      w.cross.push_back({dst.attn_norm.clone(), qkv[0].clone(), ones(c.head_dim), ones(c.head_dim), dense_matrix(dst, Proj::o).clone(),
                         at::zeros({1}, opts), dst.ffn_norm.clone(), dense_matrix(dst, Proj::gate_up).clone(),
                         dense_matrix(dst, Proj::down).clone(),
                         at::zeros({1}, opts), /*sinks=*/at::Tensor(), /*doc_bias=*/at::Tensor()});
    }
    return Plugin(std::move(config), std::move(w), base);
  }
  for (int64_t layer : config.cross_layers) {
    const LayerWeights& src = bw.layers.at(layer);
    auto qkv = dense_matrix(src, Proj::qkv).split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
    if (o.copy_decoder_layers) {
      w.encoder.push_back(detail::plugin::dense_copy(src));
      w.wk.push_back(qkv[1].clone());
      w.wv.push_back(qkv[2].clone());
      w.cross.push_back({src.attn_norm.clone(), qkv[0].clone(), ones(c.head_dim), ones(c.head_dim), dense_matrix(src, Proj::o).clone(),
                         at::zeros({1}, opts), src.ffn_norm.clone(), dense_matrix(src, Proj::gate_up).clone(),
                         dense_matrix(src, Proj::down).clone(),
                         at::zeros({1}, opts), /*sinks=*/at::Tensor(), /*doc_bias=*/at::Tensor()});
    } else {
      w.encoder.push_back({ones(c.n_embd), randn({c.q_dim() + 2 * c.kv_dim(), c.n_embd}), randn({c.n_embd, c.q_dim()}),
                           ones(c.n_embd), randn({2 * c.n_ff, c.n_embd}), randn({c.n_embd, c.n_ff}), nullptr});
      w.wk.push_back(randn({c.kv_dim(), c.n_embd}));
      w.wv.push_back(randn({c.kv_dim(), c.n_embd}));
      w.cross.push_back({ones(c.n_embd), randn({c.q_dim(), c.n_embd}), ones(c.head_dim), ones(c.head_dim),
                         randn({c.n_embd, c.q_dim()}), at::zeros({1}, opts), ones(c.n_embd),
                         randn({2 * c.n_ff, c.n_embd}), randn({c.n_embd, c.n_ff}), at::zeros({1}, opts),
                         /*sinks=*/at::Tensor(), /*doc_bias=*/at::Tensor()});
    }
  }
  return Plugin(std::move(config), std::move(w), base);
}

COMB_INLINE std::vector<std::pair<std::string, at::Tensor>> Plugin::named_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& c = base_config_;
  const auto& p = config_;
  if (weights_.tok_embd.defined()) out.emplace_back("chunk_model.embed_tokens.weight", weights_.tok_embd);
  if (!p.encoder_from_base)
    for (size_t j = 0; j < weights_.encoder.size(); ++j)
      append_llama_layer_hf_named(out, fmt::format("chunk_model.layers.{}.", j), weights_.encoder[j], c);
  for (int64_t k = 0; k < p.n_blocks(); ++k) {
    if (p.kv_norm) out.emplace_back(fmt::format("chunk_model.kv_norm.{}.weight", k), weights_.kv_norm[k]);
    out.emplace_back(fmt::format("chunk_model.k_proj.{}.weight", k), weights_.wk[k]);
    out.emplace_back(fmt::format("chunk_model.v_proj.{}.weight", k), weights_.wv[k]);
  }
  for (size_t k = 0; k < weights_.cross.size(); ++k) {
    const auto& b = weights_.cross[k];
    std::string pre = fmt::format("language_model.model.cross_layers.{}.", k);
    if (p.joint_attention) {
      out.emplace_back(pre + "cross_attn.doc_bias", b.doc_bias);
      continue;
    }
    out.emplace_back(pre + "input_layernorm.weight", b.attn_norm);
    out.emplace_back(pre + "cross_attn.q_proj.weight", b.wq);
    if (p.qk_norm) {
      out.emplace_back(pre + "cross_attn.q_norm.weight", b.q_norm);
      out.emplace_back(pre + "cross_attn.k_norm.weight", b.k_norm);
    }
    out.emplace_back(pre + "cross_attn.o_proj.weight", b.wo);
    out.emplace_back(pre + "cross_attn_attn_gate", b.attn_gate);
    if (p.attention_sinks) out.emplace_back(pre + "cross_attn.sinks", b.sinks);
    if (p.cross_mlp) {
      auto gu = b.w_gate_up.split_with_sizes({c.n_ff, c.n_ff}, 0);
      out.emplace_back(pre + "post_attention_layernorm.weight", b.ffn_norm);
      out.emplace_back(pre + "mlp.gate_proj.weight", gu[0]);
      out.emplace_back(pre + "mlp.up_proj.weight", gu[1]);
      out.emplace_back(pre + "mlp.down_proj.weight", b.w_down);
      out.emplace_back(pre + "cross_attn_mlp_gate", b.mlp_gate);
    }
  }
  return out;
}

COMB_INLINE Plugin Plugin::from_checkpoint(const TensorSource& source, const PluginConfig& config, const Decoder& base) {
  const auto& c = base.config();
  detail::plugin::check_layout(config, c);
  WeightReader r(source, base.dtype(), base.device());
  PluginWeights w;
  w.tok_embd = r.get("chunk_model.embed_tokens.weight", {c.n_vocab, c.n_embd}, /*required=*/false);
  const int64_t d = c.n_embd;
  if (!config.encoder_from_base)
    for (int64_t j = 0; j < config.n_encoder_layers(); ++j)
      w.encoder.push_back(r.layer(fmt::format("chunk_model.layers.{}.", j), c));
  for (int64_t k = 0; k < config.n_blocks(); ++k) {
    if (config.kv_norm) w.kv_norm.push_back(r.get(fmt::format("chunk_model.kv_norm.{}.weight", k), {d}));
    w.wk.push_back(r.get(fmt::format("chunk_model.k_proj.{}.weight", k), {c.kv_dim(), d}));
    w.wv.push_back(r.get(fmt::format("chunk_model.v_proj.{}.weight", k), {c.kv_dim(), d}));
    std::string p = fmt::format("language_model.model.cross_layers.{}.", k);
    CrossBlockWeights b;
    if (config.joint_attention) {
      b.doc_bias = r.get(p + "cross_attn.doc_bias", {c.n_head});
      w.cross.push_back(std::move(b));
      continue;
    }
    b.attn_norm = r.get(p + "input_layernorm.weight", {d});
    b.wq = r.get(p + "cross_attn.q_proj.weight", {c.q_dim(), d});
    if (config.qk_norm) {
      b.q_norm = r.get(p + "cross_attn.q_norm.weight", {c.head_dim});
      b.k_norm = r.get(p + "cross_attn.k_norm.weight", {c.head_dim});
    }
    b.wo = r.get(p + "cross_attn.o_proj.weight", {d, c.q_dim()});
    b.attn_gate = r.get(p + "cross_attn_attn_gate", {1});
    if (config.attention_sinks) b.sinks = r.get(p + "cross_attn.sinks", {c.n_head});
    if (config.cross_mlp) {
      b.ffn_norm = r.get(p + "post_attention_layernorm.weight", {d});
      at::Tensor wg = r.get(p + "mlp.gate_proj.weight", {c.n_ff, d});
      at::Tensor wu = r.get(p + "mlp.up_proj.weight", {c.n_ff, d});
      b.w_down = r.get(p + "mlp.down_proj.weight", {d, c.n_ff});
      b.mlp_gate = r.get(p + "cross_attn_mlp_gate", {1});
      if (wg.defined() && wu.defined()) b.w_gate_up = at::cat({wg, wu}, 0);
    }
    w.cross.push_back(std::move(b));
  }
  r.finish(fmt::format("COMB plug-in with {} cross blocks does not fit the base decoder (n_embd {}, n_ff {}, {} heads, "
                       "{} kv heads, head_dim {})",
                       config.n_blocks(), c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim));
  return Plugin(config, std::move(w), base);
}

COMB_INLINE Plugin Plugin::load(const std::string& path, const Decoder& base) {
  SafetensorsFile file(path);
  auto it = file.metadata().find("comb.plugin");
  COMB_CHECK(it != file.metadata().end(), "'{}' is not a comb plug-in file (no 'comb.plugin' metadata)", path);
  nlohmann::json j = detail::parse_json(it->second, fmt::format("'{}': 'comb.plugin' metadata", path));
  PluginConfig config = PluginConfig::from_json(j, path);
  std::string base_fp = base_fingerprint(base);
  COMB_CHECK(config.base_fingerprint.empty() || config.base_fingerprint == base_fp,
             "'{}' was built for another base decoder (fingerprint {}); this model's is {}", path,
             config.base_fingerprint, base_fp);
  return from_checkpoint(file, config, base);
}

COMB_INLINE void Plugin::save(const std::string& path, c10::ScalarType dtype) const {
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

COMB_INLINE bool Plugin::encoder_is_base() const {
  return config_.encoder_from_base && config_.encoder_causal && !weights_.tok_embd.defined();
}

COMB_INLINE KVCache Plugin::encoder_prefix_states(const Decoder& base, int64_t layers) const {
  COMB_CHECK(encoder_is_base(), "encoder_prefix_states: the encoder is not the base's own causal layers");
  if (layers < 0) layers = config_.n_encoder_layers();
  COMB_CHECK(layers >= config_.n_encoder_layers() && layers <= base.config().n_layer,
             "encoder_prefix_states: {} layers, expected {} (the encoder's) to {} (the base's)", layers,
             config_.n_encoder_layers(), base.config().n_layer);
  const int64_t pre = static_cast<int64_t>(config_.encoder_prefix.size());
  KVCache cache = base.make_cache(1, std::max<int64_t>(pre, 1));
  if (pre == 0) return cache;
  at::Tensor h = base.embed(at::tensor(config_.encoder_prefix, at::kLong).unsqueeze(0));
  for (int64_t j = 0; j < layers; ++j) h = base.layer(j, h, cache);
  cache.advance(pre);
  return cache;
}

COMB_INLINE void Plugin::check_document(const std::vector<int32_t>& tokens) const {
  const int64_t n = static_cast<int64_t>(tokens.size());
  COMB_CHECK(n > 0, "a document is empty: the encoder needs at least one token");
  COMB_CHECK(n <= config_.max_document_tokens, "a document has {} tokens; the encoder takes at most {}", n,
             config_.max_document_tokens);
  for (int32_t id : tokens)
    COMB_CHECK(id >= 0 && id < base_config_.n_vocab, "document token {} is outside the vocabulary [0, {})", id,
               base_config_.n_vocab);
}

COMB_INLINE DocumentKV Plugin::encode(const Decoder& base, const std::vector<int32_t>& tokens,
                                      const KVCache* prefix_states) const {
  check_document(tokens);
  if (encoder_is_base()) {
    std::optional<KVCache> own;
    if (!prefix_states) prefix_states = &own.emplace(encoder_prefix_states(base));
    return std::move(encode_padded(base, {&tokens}, *prefix_states)[0]);
  }
  at::Tensor ids = detail::upload(at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong), base.device());
  auto [keys, values] = encode_batch(base, weights_, ids.unsqueeze(0), {});
  return std::move(split_documents(keys, values, {static_cast<int64_t>(tokens.size())})[0]);
}

COMB_INLINE std::vector<DocumentKV> Plugin::encode_many(const Decoder& base,
                                                        const std::vector<std::vector<int32_t>>& documents,
                                                        const KVCache* prefix_states) const {
  RECORD_FUNCTION("comb::encode_many", std::vector<c10::IValue>());
  if (!encoder_is_base()) {  // one at a time (encode() checks each)
    std::vector<DocumentKV> out(documents.size());
    for (size_t i = 0; i < documents.size(); ++i) out[i] = encode(base, documents[i]);
    return out;
  }
  std::optional<KVCache> own;
  if (!prefix_states) prefix_states = &own.emplace(encoder_prefix_states(base));
  // On a CUDA half base each batch packed, one FlashAttention launch a layer (COMB_CUDA_VARLEN=0: the
  // padded batch).
  static const bool varlen_asked = detail::env_on("COMB_CUDA_VARLEN");
  // With comb's CUDA ops loaded (built for Ampere and Hopper; not with COMB_CUDA_KERNELS=0), as
  // the fused layers that the packed rows go through are.
  const bool packed = varlen_asked && base.device().is_cuda() &&
                      (base.dtype() == at::kBFloat16 || base.dtype() == at::kHalf) && !at::GradMode::is_enabled() &&
                      detail::cuda_layer_ops() != nullptr;
  return in_encoding_batches(base, documents, [&](const std::vector<const std::vector<int32_t>*>& batch) {
    return packed ? encode_packed(base, batch, *prefix_states, /*varlen=*/true)
                  : encode_padded(base, batch, *prefix_states);
  });
}

COMB_INLINE std::vector<DocumentKV> Plugin::in_encoding_batches(
    const Decoder& base, const std::vector<std::vector<int32_t>>& documents,
    const std::function<std::vector<DocumentKV>(const std::vector<const std::vector<int32_t>*>&)>& encode) const {
  for (const auto& d : documents) check_document(d);
  std::vector<DocumentKV> out(documents.size());
  for (const auto& indices : encoding_batches(documents, base.device().is_cuda())) {
    std::vector<const std::vector<int32_t>*> batch;
    for (size_t i : indices) batch.push_back(&documents[i]);
    auto encoded = encode(batch);
    for (size_t i = 0; i < indices.size(); ++i) out[indices[i]] = std::move(encoded[i]);
  }
  return out;
}

COMB_INLINE std::vector<std::vector<size_t>> Plugin::encoding_batches(const std::vector<std::vector<int32_t>>& documents,
                                                                     bool gpu) {
  // Shortest first; a batch grows while its padded tokens stay within 5/4 of its real ones and
  // 4096 in all (the shortest documents pack densely, a long one goes alone).
  std::vector<size_t> order(documents.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  // By length, then by tokens: the same documents make the same batches in any order given, so a
  // document's cache does not depend on the order of the request that encoded it.
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return documents[a].size() != documents[b].size() ? documents[a].size() < documents[b].size()
                                                       : documents[a] < documents[b];
  });
  std::vector<std::vector<size_t>> batches;
  size_t at = 0;
  while (at < order.size()) {
    size_t end = at + 1;
    int64_t real = static_cast<int64_t>(documents[order[at]].size());
    while (end < order.size()) {
      const int64_t len = static_cast<int64_t>(documents[order[end]].size());  // the longest so far
      const int64_t padded = len * static_cast<int64_t>(end + 1 - at);
      if (gpu ? padded > 16384 : (padded > 4096 || 4 * padded > 5 * (real + len))) break;
      real += len;
      ++end;
    }
    batches.emplace_back(order.begin() + at, order.begin() + end);
    at = end;
  }
  return batches;
}

COMB_INLINE Plugin::PaddedBatch Plugin::padded_batch(const Decoder& base,
                                                     const std::vector<const std::vector<int32_t>*>& documents,
                                                     const KVCache& prefix_states) const {
  RECORD_FUNCTION("comb::padded_batch", std::vector<c10::IValue>());
  const int64_t n_docs = static_cast<int64_t>(documents.size());
  const int64_t pre = static_cast<int64_t>(config_.encoder_prefix.size());
  COMB_CHECK(pre == 0 || prefix_states.length() == pre,
             "encode: prefix states of {} positions, the encoder prefix has {}", prefix_states.length(), pre);
  std::vector<int64_t> lens;
  for (const auto* d : documents) lens.push_back(static_cast<int64_t>(d->size()));
  const int64_t m = *std::max_element(lens.begin(), lens.end());
  // Padding (token 0) after each document's tokens: causally, no real token reads it.
  std::vector<int64_t> flat(n_docs * m, 0);
  for (int64_t d = 0; d < n_docs; ++d) std::copy(documents[d]->begin(), documents[d]->end(), flat.begin() + d * m);
  at::Tensor ids = detail::upload(at::tensor(flat, at::kLong).view({n_docs, m}), base.device());
  // The base's cached forward over the documents, after the prefix's states: the same causal
  // computation as encode_batch's, on the decoder's own (fused) path.
  KVCache cache = base.make_cache(n_docs, pre + m);
  if (pre > 0) {
    for (int64_t j = 0; j < config_.n_encoder_layers(); ++j) {
      at::Tensor k = prefix_states.keys(j).narrow(2, 0, pre), v = prefix_states.values(j).narrow(2, 0, pre);
      cache.write(j, 0, k.expand({n_docs, k.size(1), pre, k.size(3)}), v.expand({n_docs, v.size(1), pre, v.size(3)}));
    }
    cache.set_length(pre);
  }
  at::Tensor back_cos, back_sin;
  if (config_.relative_positions)
    std::tie(back_cos, back_sin) = back_rope(detail::upload(at::tensor(lens, at::kLong), rope_cos_.device()), m);
  at::Tensor h = base.embed(ids);
  return PaddedBatch{std::move(lens), h, back_cos, back_sin, std::move(cache)};
}

COMB_INLINE std::vector<DocumentKV> Plugin::encode_padded(const Decoder& base,
                                                          const std::vector<const std::vector<int32_t>*>& documents,
                                                          const KVCache& prefix_states, const PluginWeights* w) const {
  const PluginWeights& weights = w ? *w : weights_;
  PaddedBatch b = [&] {
    c10::AutoGradMode no_grad(false);  // the base is frozen: its states need no graph
    return padded_batch(base, documents, prefix_states);
  }();
  return encoder_pass(
      b.lens, [&](int64_t k) { return documents_kv(weights, k, b.h, b.lens, b.back_cos, b.back_sin); },
      [&](int64_t j) {
        c10::AutoGradMode no_grad(false);
        b.h = base.layer(j, b.h, b.cache);
      });
}

COMB_INLINE std::vector<DocumentKV> Plugin::encode_trainable(const Decoder& base, const PluginWeights& w,
                                                             const std::vector<std::vector<int32_t>>& documents) const {
  RECORD_FUNCTION("comb::encode_trainable", std::vector<c10::IValue>());
  COMB_CHECK(encoder_is_base() && !w.tok_embd.defined(),
             "encode_trainable: needs an encoder of the base's own causal layers and weights without an embedding");
  const KVCache prefix_states = [&] {
    c10::AutoGradMode no_grad(false);
    return encoder_prefix_states(base);
  }();
  return in_encoding_batches(base, documents, [&](const std::vector<const std::vector<int32_t>*>& batch) {
    return encode_padded(base, batch, prefix_states, &w);
  });
}

COMB_INLINE std::vector<DocumentKV> Plugin::encoder_pass(const std::vector<int64_t>& lens,
                                                         const std::function<BlockKV(int64_t k)>& block,
                                                         const std::function<void(int64_t j)>& layer) const {
  std::vector<DocumentKV> out(lens.size());
  for (size_t d = 0; d < out.size(); ++d) {
    out[d].n_tokens = lens[d];
    out[d].keys.resize(config_.n_blocks());
    out[d].values.resize(config_.n_blocks());
  }
  auto project = [&](int64_t depth) {
    for (int64_t k = 0; k < config_.n_blocks(); ++k)
      if (config_.read_depth(k) == depth) {
        auto [keys, values] = block(k);
        for (size_t d = 0; d < out.size(); ++d) {
          out[d].keys[k] = std::move(keys[d]);
          out[d].values[k] = std::move(values[d]);
        }
      }
  };
  project(0);
  for (int64_t j = 0; j < config_.n_encoder_layers(); ++j) {
    layer(j);
    project(j + 1);
  }
  return out;
}

COMB_INLINE bool Plugin::encodes_alongside(const Decoder& base) const {
  if (!config_.joint_attention || !encoder_is_base() || !base.cpu_kernels() || at::GradMode::is_enabled())
    return false;
  for (int64_t k = 0; k < config_.n_blocks(); ++k)  // a block's states exist by its layer
    if (config_.read_depth(k) > config_.cross_layers.at(k)) return false;
  return true;
}

COMB_INLINE at::Tensor Plugin::encode_alongside(const Decoder& base, const std::vector<std::vector<int32_t>>& documents,
                                                const KVCache& prefix_states, const at::Tensor& tokens, KVCache& cache,
                                                const JoinBlock& join) const {
  COMB_CHECK(encodes_alongside(base), "encode_alongside: needs joint blocks that read depths at or before their layer, "
             "an encoder of the base's own layers and the fused CPU path, without gradients");
  COMB_CHECK(!documents.empty(), "encode_alongside: no document");
  COMB_CHECK(tokens.dim() == 2 && tokens.size(0) == cache.batch() && tokens.size(1) > 0 &&
                 cache.length() + tokens.size(1) <= cache.capacity(),
             "encode_alongside: tokens [{}] after {} of a cache of capacity {}", fmt::join(tokens.sizes(), ", "),
             cache.length(), cache.capacity());
  for (const auto& d : documents) check_document(d);
  const int64_t n_enc = config_.n_encoder_layers();
  // The documents in encode_many's batches, each with its blocks' K/V once computed.
  struct Batch {
    std::vector<size_t> docs;
    PaddedBatch p;
    std::vector<std::vector<at::Tensor>> keys, values;  // per block, per document: [n_head_kv, len, head_dim]
  };
  std::vector<Batch> batches;
  for (auto& indices : encoding_batches(documents)) {
    std::vector<const std::vector<int32_t>*> batch;
    for (size_t i : indices) batch.push_back(&documents[i]);
    batches.push_back(Batch{std::move(indices), padded_batch(base, batch, prefix_states),
                            std::vector<std::vector<at::Tensor>>(config_.n_blocks()),
                            std::vector<std::vector<at::Tensor>>(config_.n_blocks())});
  }
  // The prompt reads its documents as every forward does (LayerReads), the blocks joined as the
  // pass reaches their layers.
  class Joined final : public LayerReads {
   public:
    explicit Joined(const Plugin& plugin) : plugin_(plugin) {}
    const JointKV* joint(int64_t layer) const override {
      const int64_t k = plugin_.block_before(layer);
      return k < 0 ? nullptr : blocks.at(static_cast<size_t>(k));
    }
    std::vector<const JointKV*> blocks;  // [block]: set when the pass reaches its layer

   private:
    const Plugin& plugin_;
  } reads(*this);
  reads.blocks.assign(config_.n_blocks(), nullptr);
  at::Tensor x = base.embed(tokens);
  for (int64_t layer = 0; layer < base.config().n_layer; ++layer) {
    // The blocks that read this depth (the documents' states after `layer` encoder layers).
    if (layer <= n_enc)
      for (int64_t k = 0; k < config_.n_blocks(); ++k)
        if (config_.read_depth(k) == layer)
          for (auto& b : batches)
            std::tie(b.keys[k], b.values[k]) = documents_kv(weights_, k, b.p.h, b.p.lens, b.p.back_cos, b.p.back_sin);
    if (const int64_t k = block_before(layer); k >= 0) {
      std::vector<at::Tensor> keys(documents.size()), values(documents.size());
      for (const auto& b : batches)
        for (size_t d = 0; d < b.docs.size(); ++d) {
          keys[b.docs[d]] = std::move(b.keys[k][d]);  // handed over
          values[b.docs[d]] = std::move(b.values[k][d]);
        }
      reads.blocks[k] = join(k, std::move(keys), std::move(values));
    }
    std::vector<Decoder::LayerPart> parts;
    if (layer < n_enc)
      for (auto& b : batches) parts.push_back({b.p.h, &b.p.cache, nullptr});
    parts.push_back({x, &cache, &reads});
    std::vector<at::Tensor> out = base.layer_parts(layer, parts);
    x = out.back();
    if (layer < n_enc)
      for (size_t j = 0; j < batches.size(); ++j) batches[j].p.h = out[j];
  }
  cache.advance(tokens.size(1));
  return x;
}

COMB_INLINE KVCache Plugin::begin_encoding(const Decoder& base, const std::vector<int32_t>& tokens,
                                           const KVCache& prefix_states) const {
  COMB_CHECK(encoder_is_base(), "encoding in pieces needs the base's own causal layers as the encoder");
  check_document(tokens);
  const int64_t pre = static_cast<int64_t>(config_.encoder_prefix.size());
  COMB_CHECK(pre == 0 || prefix_states.length() == pre,
             "encode: prefix states of {} positions, the encoder prefix has {}", prefix_states.length(), pre);
  KVCache cache = base.make_cache(1, pre + static_cast<int64_t>(tokens.size()));
  if (pre > 0) {
    for (int64_t j = 0; j < config_.n_encoder_layers(); ++j)
      cache.write(j, 0, prefix_states.keys(j).narrow(2, 0, pre), prefix_states.values(j).narrow(2, 0, pre));
    cache.set_length(pre);
  }
  return cache;
}

COMB_INLINE void Plugin::encode_piece(const Decoder& base, const std::vector<int32_t>& tokens, int64_t begin, int64_t end,
                                      KVCache& cache, std::vector<std::vector<at::Tensor>>& keys,
                                      std::vector<std::vector<at::Tensor>>& values) const {
  const int64_t n = static_cast<int64_t>(tokens.size());
  COMB_CHECK(0 <= begin && begin < end && end <= n, "encode_piece: tokens [{}, {}) of a document of {}", begin, end, n);
  COMB_CHECK(cache.length() == static_cast<int64_t>(config_.encoder_prefix.size()) + begin,
             "encode_piece: the cache holds {} positions, the piece starts after {}", cache.length(),
             config_.encoder_prefix.size() + begin);
  keys.resize(config_.n_blocks());
  values.resize(config_.n_blocks());
  at::Tensor back_cos, back_sin;
  if (config_.relative_positions) {
    std::tie(back_cos, back_sin) = back_rope(detail::upload(at::tensor(std::vector<int64_t>{n}, at::kLong), rope_cos_.device()), n);
    back_cos = back_cos.narrow(2, begin, end - begin);
    back_sin = back_sin.narrow(2, begin, end - begin);
  }
  at::Tensor ids =
      detail::upload(at::tensor(std::vector<int64_t>(tokens.begin() + begin, tokens.begin() + end), at::kLong),
                     base.device());
  at::Tensor h = base.embed(ids.unsqueeze(0));
  auto project = [&](int64_t depth) {
    for (int64_t k = 0; k < config_.n_blocks(); ++k)
      if (config_.read_depth(k) == depth) {
        auto [kk, vv] = documents_kv(weights_, k, h, {end - begin}, back_cos, back_sin);
        keys[k].push_back(std::move(kk[0]));
        values[k].push_back(std::move(vv[0]));
      }
  };
  project(0);
  for (int64_t j = 0; j < config_.n_encoder_layers(); ++j) {
    h = base.layer(j, h, cache);
    project(j + 1);
  }
  cache.advance(end - begin);
}

COMB_INLINE DocumentKV Plugin::finish_encoding(const std::vector<std::vector<at::Tensor>>& keys,
                                               const std::vector<std::vector<at::Tensor>>& values, int64_t n_tokens) {
  DocumentKV out;
  out.n_tokens = n_tokens;
  for (size_t k = 0; k < keys.size(); ++k) {
    out.keys.push_back(at::cat(keys[k], 1).contiguous());
    out.values.push_back(at::cat(values[k], 1).contiguous());
    COMB_CHECK(out.keys.back().size(1) == n_tokens, "finish_encoding: block {} holds {} of {} tokens", k,
               out.keys.back().size(1), n_tokens);
  }
  return out;
}

COMB_INLINE std::vector<DocumentKV> Plugin::encode_packed(const Decoder& base,
                                                          const std::vector<const std::vector<int32_t>*>& documents,
                                                          const KVCache& prefix_states, bool varlen) const {
  RECORD_FUNCTION("comb::encode_packed", std::vector<c10::IValue>());
  COMB_CHECK(encoder_is_base(), "encode_packed: the encoder is not the base's own causal layers");
  COMB_CHECK(!documents.empty(), "encode_packed: no document");
  const int64_t pre = static_cast<int64_t>(config_.encoder_prefix.size());
  COMB_CHECK(pre == 0 || prefix_states.length() == pre,
             "encode: prefix states of {} positions, the encoder prefix has {}", prefix_states.length(), pre);
  std::vector<int64_t> lens, flat;
  for (const auto* d : documents) {
    check_document(*d);
    lens.push_back(static_cast<int64_t>(d->size()));
    flat.insert(flat.end(), d->begin(), d->end());
  }
  const Decoder::PackedRows rows = base.packed_rows(lens, pre);
  const auto n_docs = static_cast<int64_t>(documents.size());
  const int64_t n = rows.first.back();
  at::Tensor h = base.embed(detail::upload_ints(flat, at::kLong, base.device()).view({1, n}));
  at::Tensor back_cos, back_sin;
  if (config_.relative_positions) {  // token j of document d turned back by len_d - j, as back_rope
    std::vector<int64_t> back;
    for (int64_t len : lens)
      for (int64_t j = 0; j < len; ++j) back.push_back(len - j);
    const at::Tensor b = detail::upload_ints(back, at::kLong, rope_cos_.device());
    back_cos = rope_cos_.index_select(0, b).view({1, 1, n, -1});
    back_sin = -rope_sin_.index_select(0, b).view({1, 1, n, -1});  // sin(-a) = -sin(a)
  }
  // Each block's K/V of every document [1, n_head_kv, n, head_dim] cut into the documents' entries
  // as the pass computes it (on a CUDA device with comb's ops one launch a block, into one allocation
  // per document).
  std::vector<std::array<int64_t, 3>> at_rows;
  for (int64_t d = 0; d < n_docs; ++d) at_rows.push_back({0, rows.first[d], lens[d]});
  detail::DocumentSplit split(std::move(at_rows), config_.n_blocks());
  encoder_pass(
      lens,
      [&](int64_t k) {
        auto [keys, values] = block_kv(weights_, k, h, back_cos, back_sin);
        split.add(k, keys, values);
        return BlockKV(std::vector<at::Tensor>(n_docs), std::vector<at::Tensor>(n_docs));  // the split's
      },
      [&](int64_t j) {
        h = base.layer_packed(j, h, rows, pre > 0 ? prefix_states.keys(j) : at::Tensor(),
                              pre > 0 ? prefix_states.values(j) : at::Tensor(), varlen);
      });
  return split.take();
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> Plugin::back_rope(const at::Tensor& lens, int64_t len) const {
  const int64_t n_docs = lens.size(0), hd = base_config_.head_dim;
  // len_d - j: >= 1 for real tokens, 0 (no turn) for padding
  at::Tensor back = (lens.unsqueeze(1) - at::arange(len, lens.options()).unsqueeze(0)).clamp_min(0);
  return {rope_cos_.index_select(0, back.reshape({-1})).view({n_docs, 1, len, hd}),
          -rope_sin_.index_select(0, back.reshape({-1})).view({n_docs, 1, len, hd})};  // sin(-a) = -sin(a)
}

COMB_INLINE std::vector<DocumentKV> Plugin::split_documents(const std::vector<at::Tensor>& keys,
                                                            const std::vector<at::Tensor>& values,
                                                            const std::vector<int64_t>& lens) {
  std::vector<std::array<int64_t, 3>> rows;
  for (size_t d = 0; d < lens.size(); ++d) rows.push_back({static_cast<int64_t>(d), 0, lens[d]});
  return split_rows(keys, values, rows);
}

COMB_INLINE std::vector<DocumentKV> Plugin::split_rows(const std::vector<at::Tensor>& keys,
                                                       const std::vector<at::Tensor>& values,
                                                       const std::vector<std::array<int64_t, 3>>& rows) {
  RECORD_FUNCTION("comb::split_rows", std::vector<c10::IValue>());
  COMB_CHECK(!keys.empty() && values.size() == keys.size(), "split_rows: {} key and {} value blocks", keys.size(),
             values.size());
  detail::DocumentSplit split(rows, static_cast<int64_t>(keys.size()));
  for (size_t k = 0; k < keys.size(); ++k) split.add(static_cast<int64_t>(k), keys[k], values[k]);
  return split.take();
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> Plugin::block_kv(const PluginWeights& w, int64_t k, const at::Tensor& states,
                                                               const at::Tensor& back_cos, const at::Tensor& back_sin) const {
  RECORD_FUNCTION("comb::block_kv", std::vector<c10::IValue>());
  const auto& c = base_config_;
  const c10::ScalarType dt = states.scalar_type();
  auto W = [&](const at::Tensor& t) { return t.scalar_type() == dt ? t : t.to(dt); };
  const int64_t n_docs = states.size(0), len = states.size(1);
  // RMSNorm: on a CUDA half device without gradients comb's fused kernel (one launch for ATen's
  // six; the same float32 normalisation, its sum in another order), else the ATen composition.
  const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
  const bool fused_norm = ops && ops->add_rms_norm && states.is_cuda() && (dt == at::kBFloat16 || dt == at::kHalf) &&
                          !at::GradMode::is_enabled() && !states.requires_grad();
  auto norm = [&](const at::Tensor& x, const at::Tensor& weight) {
    return fused_norm ? ops->add_rms_norm(x.contiguous(), at::Tensor(), W(weight).contiguous(), c.rms_eps)
                      : rms_norm(x, W(weight), c.rms_eps);
  };
  at::Tensor s = config_.kv_norm ? norm(states, w.kv_norm[k]) : states;
  at::Tensor ke = at::linear(s, W(w.wk[k])).view({n_docs, len, c.n_head_kv, c.head_dim});
  if (config_.qk_norm) ke = norm(ke, w.cross[k].k_norm);
  at::Tensor keys;
  if (back_cos.defined() && fused_norm && ops->rope_rows && back_cos.numel() == n_docs * len * c.head_dim &&
      back_sin.numel() == back_cos.numel()) {
    // Each row turned back in place in one launch (rope_rows over rows of n_head_kv key heads),
    // equal to apply_rope's seven operations; ke is this call's own product.
    at::Tensor rows = ke.contiguous();
    ops->rope_rows(rows.view({n_docs * len, c.n_head_kv * c.head_dim}),
                   back_cos.to(dt).reshape({n_docs * len, c.head_dim}).contiguous(),
                   back_sin.to(dt).reshape({n_docs * len, c.head_dim}).contiguous(), c.n_head_kv, 0);
    keys = rows.transpose(1, 2);
  } else {
    keys = ke.transpose(1, 2);
    if (back_cos.defined()) keys = apply_rope(keys, back_cos.to(dt), back_sin.to(dt));
  }
  at::Tensor values = at::linear(s, W(w.wv[k])).view({n_docs, len, c.n_head_kv, c.head_dim}).transpose(1, 2);
  return {keys, values};
}

COMB_INLINE std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> Plugin::documents_kv(
    const PluginWeights& w, int64_t k, const at::Tensor& s, const std::vector<int64_t>& lens, const at::Tensor& back_cos,
    const at::Tensor& back_sin) const {
  RECORD_FUNCTION("comb::documents_kv", std::vector<c10::IValue>());
  const auto& c = base_config_;
  const int64_t n_docs = s.size(0), m = s.size(1), n_kv = c.n_head_kv, hd = c.head_dim, kv_dim = n_kv * hd;
  COMB_CHECK(static_cast<int64_t>(lens.size()) == n_docs, "documents_kv: {} lengths for {} documents", lens.size(),
             n_docs);
  for (int64_t len : lens) COMB_CHECK(0 < len && len <= m, "documents_kv: a document of {} tokens in rows of {}", len, m);
  std::vector<at::Tensor> keys(n_docs), values(n_docs);
  auto is_f32 = [](const at::Tensor& t) { return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat; };
  const bool direct = !at::GradMode::is_enabled() && is_f32(s) && config_.kv_norm && !config_.qk_norm &&
                      is_f32(w.kv_norm[k]) && is_f32(w.wk[k]) && is_f32(w.wv[k]) &&
                      (!back_cos.defined() || (is_f32(back_cos) && is_f32(back_sin)));
  if (!direct) {
    auto [kk, vv] = block_kv(w, k, s, back_cos, back_sin);
    std::vector<DocumentKV> docs = split_documents({kk}, {vv}, lens);
    for (int64_t d = 0; d < n_docs; ++d) {
      keys[d] = std::move(docs[d].keys[0]);
      values[d] = std::move(docs[d].values[0]);
    }
    return {keys, values};
  }
  // NOTE: block_kv's ATen steps (norm, two projections over the padded rows, five temporaries of
  // the rotation, then a copy per document) cost more than the GEMMs on a few short documents,
  // 28 times in a cold request.
  const int64_t e = c.n_embd;
  std::vector<int64_t> first(n_docs + 1, 0);  // document d's rows [first[d], first[d + 1]) of the real ones
  for (int64_t d = 0; d < n_docs; ++d) first[d + 1] = first[d] + lens[d];
  const int64_t rows = first[n_docs];
  const at::Tensor x = s.contiguous();
  at::Tensor normed = at::empty({rows, e}, x.options());
  const float* xp = x.data_ptr<float>();
  float* np = normed.data_ptr<float>();
  const at::Tensor norm_weight = w.kv_norm[k].contiguous();  // held: data_ptr of a temporary would dangle
  const float* weight = norm_weight.data_ptr<float>();
  for (int64_t d = 0; d < n_docs; ++d)
    detail::cpu::rms_norm_rows(xp + d * m * e, weight, np + first[d] * e, e, static_cast<float>(c.rms_eps), 0, lens[d]);
  const at::Tensor kp = at::linear(normed, w.wk[k]), vp = at::linear(normed, w.wv[k]);  // [rows, kv_dim]
  at::Tensor cos_t, sin_t;
  if (back_cos.defined()) {
    cos_t = back_cos.contiguous();
    sin_t = back_sin.contiguous();
  }
  for (int64_t d = 0; d < n_docs; ++d) {
    const int64_t len = lens[d];
    keys[d] = at::empty({n_kv, len, hd}, x.options());
    values[d] = at::empty({n_kv, len, hd}, x.options());
  }
  at::parallel_for(0, n_docs * n_kv, 1, [&](int64_t b, int64_t end) {
    for (int64_t item = b; item < end; ++item) {
      const int64_t d = item / n_kv, h = item % n_kv, len = lens[d];
      const float* ksrc = kp.data_ptr<float>() + first[d] * kv_dim + h * hd;
      const float* vsrc = vp.data_ptr<float>() + first[d] * kv_dim + h * hd;
      float* kdst = keys[d].data_ptr<float>() + h * len * hd;
      float* vdst = values[d].data_ptr<float>() + h * len * hd;
      for (int64_t t = 0; t < len; ++t) {
        if (cos_t.defined())
          detail::cpu::rotate_rows(ksrc + t * kv_dim, kv_dim, cos_t.data_ptr<float>() + (d * m + t) * hd,
                                   sin_t.data_ptr<float>() + (d * m + t) * hd, hd, 1, kdst + t * hd, hd);
        else
          std::copy(ksrc + t * kv_dim, ksrc + t * kv_dim + hd, kdst + t * hd);
        std::copy(vsrc + t * kv_dim, vsrc + t * kv_dim + hd, vdst + t * hd);
      }
    }
  });
  return {keys, values};
}

COMB_INLINE std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> Plugin::encode_batch(const Decoder& base,
                                                                                 const PluginWeights& w,
                                                                                 const at::Tensor& tokens,
                                                                                 const at::Tensor& mask) const {
  const auto& c = base_config_;
  const auto& p = config_;
  const c10::ScalarType dt = base.dtype();
  auto W = [&](const at::Tensor& t) { return t.scalar_type() == dt ? t : t.to(dt); };
  const int64_t n_docs = tokens.size(0), len = tokens.size(1), pre = static_cast<int64_t>(p.encoder_prefix.size());
  COMB_CHECK(len <= p.max_document_tokens, "a document has {} tokens; the encoder takes at most {}", len,
             p.max_document_tokens);
  at::Tensor ids = tokens, real = mask;
  if (pre > 0) {
    at::Tensor head =
        detail::upload(at::tensor(p.encoder_prefix, at::kLong), tokens.device()).unsqueeze(0).expand({n_docs, pre});
    ids = at::cat({head, tokens}, 1);
    if (mask.defined()) real = at::cat({at::ones({n_docs, pre}, mask.options()), mask}, 1);
  }
  const int64_t total = pre + len;
  at::Tensor h = w.tok_embd.defined() ? at::embedding(W(w.tok_embd), ids) : base.embed(ids);
  at::Tensor cos = base.rope_cos().narrow(0, 0, total), sin = base.rope_sin().narrow(0, 0, total);
  // Padding comes after a document's real tokens: causally it is never seen; both ways it is masked.
  at::Tensor enc_mask = real.defined() && !p.encoder_causal ? real.view({n_docs, 1, 1, total}) : at::Tensor();
  std::vector<at::Tensor> keys(p.n_blocks()), values(p.n_blocks());
  at::Tensor back_cos, back_sin;
  if (p.relative_positions)
    std::tie(back_cos, back_sin) =
        back_rope(mask.defined() ? mask.sum(1).to(at::kLong)
                                 : at::full({n_docs}, len, at::TensorOptions().dtype(at::kLong).device(tokens.device())),
                  len);
  auto project = [&](int64_t depth) {
    for (int64_t k = 0; k < p.n_blocks(); ++k)  // the blocks read the document's tokens only
      if (p.read_depth(k) == depth)
        std::tie(keys[k], values[k]) = block_kv(w, k, pre > 0 ? h.narrow(1, pre, len) : h, back_cos, back_sin);
  };
  project(0);
  for (int64_t j = 0; j < p.n_encoder_layers(); ++j) {
    const LayerWeights& l = w.encoder.at(j);
    // The base's own layers kept quantized (encoder_from_base) are read as they are.
    h = llama_layer(h, l.quantized ? l : LayerWeights{W(l.attn_norm), W(l.wqkv), W(l.wo), W(l.ffn_norm), W(l.w_gate_up),
                                                       W(l.w_down), nullptr},
                    c, cos, sin, p.encoder_causal, enc_mask);
    project(j + 1);
  }
  return {std::move(keys), std::move(values)};
}

COMB_INLINE std::vector<JointKV> Plugin::joint_kv(const PluginWeights& w, const std::vector<std::vector<at::Tensor>>& keys_in,
                                     const std::vector<std::vector<at::Tensor>>& values_in,
                                     const std::vector<int64_t>& doc_counts, int64_t anchor,
                                     const std::vector<std::vector<at::Tensor>>& key_scales,
                                     const std::vector<std::vector<at::Tensor>>& value_scales) const {
  COMB_CHECK(config_.joint_attention, "joint_kv: this plug-in's blocks do not join their layers' attention");
  COMB_CHECK(anchor == 0 || config_.documents_after_prefix,
             "joint_kv: documents anchored at position {} need a plug-in with documents_after_prefix", anchor);
  COMB_CHECK(anchor >= 0 && anchor < rope_cos_.size(0), "joint_kv: anchor {} outside the context of {}", anchor,
             rope_cos_.size(0));
  COMB_CHECK(static_cast<int64_t>(keys_in.size()) == config_.n_blocks() && values_in.size() == keys_in.size(),
             "joint_kv: K/V for {} and {} blocks, the plug-in has {}", keys_in.size(), values_in.size(),
             config_.n_blocks());
  const auto& c = base_config_;
  if (auto direct = joint_kv_direct(w, keys_in, values_in, doc_counts, anchor, key_scales, value_scales))
    return std::move(*direct);
  if (auto gpu = joint_kv_cuda(w, keys_in, values_in, doc_counts, anchor, key_scales, value_scales))
    return std::move(*gpu);
  // int8 entries linked as they are: read as float32 here.
  std::vector<std::vector<at::Tensor>> keys = keys_in, values = values_in;
  dequantize_linked(keys, values, key_scales, value_scales);
  std::vector<JointKV> out;
  for (size_t k = 0; k < keys.size(); ++k) {
    const auto& ks = keys[k];
    const auto& vs = values[k];
    COMB_CHECK(!ks.empty() && ks.size() == vs.size(), "joint_kv: {} keys and {} values linked", ks.size(), vs.size());
    // Each row's documents joined (cat, differentiable: training runs this too), then padded.
    std::vector<at::Tensor> row_keys, row_values;
    std::vector<int64_t> lens;
    size_t d = 0;
    for (int64_t count : doc_counts) {
      COMB_CHECK(count >= 0 && d + count <= ks.size(), "joint_kv: doc_counts name more documents than the {} linked",
                 ks.size());
      std::vector<at::Tensor> rk(ks.begin() + d, ks.begin() + d + count), rv(vs.begin() + d, vs.begin() + d + count);
      d += count;
      if (config_.consecutive_documents) {
        // Each document's keys (at -n..-1) turned back by the tokens of the documents after it, so
        // that the row's documents lie one after another and the last ends at -1. RoPE rotations
        // compose; cos(-a) = cos(a), sin(-a) = -sin(a).
        int64_t total = 0, after = 0;
        for (const at::Tensor& t : rk) total += t.size(1);
        for (int64_t i = count - 1; i >= 0; --i) {
          const int64_t turn = config_.document_offset(after, total);
          if (turn > 0) {
            COMB_CHECK(turn < rope_cos_.size(0), "joint_kv: {} document tokens linked, beyond the context of {}",
                       turn, rope_cos_.size(0));
            const int64_t hd = rk[i].size(-1);
            rk[i] = apply_rope(rk[i], rope_cos_.select(0, turn).to(rk[i].scalar_type()).view({1, 1, hd}),
                               -rope_sin_.select(0, turn).to(rk[i].scalar_type()).view({1, 1, hd}));
          }
          after += rk[i].size(1);
        }
      }
      row_keys.push_back(rk.empty() ? at::zeros({c.n_head_kv, 0, c.head_dim}, ks[0].options()) : at::cat(rk, 1));
      row_values.push_back(rv.empty() ? at::zeros({c.n_head_kv, 0, c.head_dim}, vs[0].options()) : at::cat(rv, 1));
      lens.push_back(row_keys.back().size(1));
    }
    COMB_CHECK(d == ks.size(), "joint_kv: doc_counts name {} documents, {} are linked", d, ks.size());
    const int64_t m = *std::max_element(lens.begin(), lens.end());
    for (size_t r = 0; r < lens.size(); ++r) {
      row_keys[r] = at::constant_pad_nd(row_keys[r], {0, 0, 0, m - lens[r]});
      row_values[r] = at::constant_pad_nd(row_values[r], {0, 0, 0, m - lens[r]});
    }
    JointKV j;
    j.keys = at::stack(row_keys);
    if (anchor > 0) {
      // RoPE rotations compose: keys at -n..-1 turned by `anchor` are keys at anchor-n..anchor-1.
      const int64_t hd = j.keys.size(-1);
      j.keys = apply_rope(j.keys, rope_cos_.select(0, anchor).to(j.keys.scalar_type()).view({1, 1, 1, hd}),
                          rope_sin_.select(0, anchor).to(j.keys.scalar_type()).view({1, 1, 1, hd}));
    }
    j.anchor = anchor;
    j.values = at::stack(row_values);
    if (std::any_of(lens.begin(), lens.end(), [&](int64_t l) { return l != m; }))
      j.valid = at::arange(m, ks[0].options().dtype(at::kLong)).unsqueeze(0) <
                detail::upload(at::tensor(lens, at::kLong), ks[0].device()).unsqueeze(1);
    j.bias = w.cross.at(k).doc_bias;
    out.push_back(std::move(j));
  }
  return out;
}

COMB_INLINE std::vector<Plugin::JoinPlace> Plugin::join_places(const std::vector<at::Tensor>& keys,
                                                              const std::vector<int64_t>& doc_counts, int64_t anchor,
                                                              std::vector<int64_t>& lens) const {
  std::vector<JoinPlace> places;
  lens.clear();
  size_t d = 0;
  for (size_t r = 0; r < doc_counts.size(); ++r) {
    const int64_t count = doc_counts[r];
    COMB_CHECK(count >= 0 && d + count <= keys.size(), "joint_kv: doc_counts name more documents than the {} linked",
               keys.size());
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += keys[d + i].size(1);
    // consecutive: document i ends where the next begins, the last at the anchor.
    int64_t before = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t len = keys[d + i].size(1);
      const int64_t after = config_.consecutive_documents ? config_.document_offset(total - before - len, total) : 0;
      COMB_CHECK(after < rope_cos_.size(0), "joint_kv: {} document tokens linked, beyond the context of {}", after,
                 rope_cos_.size(0));
      places.push_back({d + i, static_cast<int64_t>(r), before, anchor - after});
      before += len;
    }
    lens.push_back(total);
    d += count;
  }
  COMB_CHECK(d == keys.size(), "joint_kv: doc_counts name {} documents, {} are linked", d, keys.size());
  return places;
}

COMB_INLINE std::optional<std::vector<JointKV>> Plugin::joint_kv_cuda(
    const PluginWeights& w, const std::vector<std::vector<at::Tensor>>& keys,
    const std::vector<std::vector<at::Tensor>>& values, const std::vector<int64_t>& doc_counts, int64_t anchor,
    const std::vector<std::vector<at::Tensor>>& key_scales,
    const std::vector<std::vector<at::Tensor>>& value_scales) const {
  const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
  const c10::ScalarType out_type = rope_cos_.scalar_type();
  if (!ops || !ops->join_documents || at::GradMode::is_enabled() || keys.empty() || keys[0].empty() ||
      !keys[0][0].is_cuda() || !rope_cos_.is_cuda() || (out_type != at::kBFloat16 && out_type != at::kHalf))
    return std::nullopt;
  RECORD_FUNCTION("comb::joint_kv_cuda", std::vector<c10::IValue>());
  const int64_t n_kv = base_config_.n_head_kv, hd = base_config_.head_dim;
  const c10::Device device = rope_cos_.device();
  const bool scaled = !key_scales.empty();
  if (scaled && (key_scales.size() != keys.size() || value_scales.size() != keys.size())) return std::nullopt;
  // What the kernel reads (else the general path, which says what is wrong or handles it).
  auto on = [&](const at::Tensor& t, std::initializer_list<int64_t> sizes) {
    return t.defined() && t.device() == device && t.is_contiguous() && t.sizes() == c10::IntArrayRef(sizes);
  };
  for (size_t k = 0; k < keys.size(); ++k) {
    if (keys[k].size() != keys[0].size() || values[k].size() != keys[k].size()) return std::nullopt;
    if (scaled && (key_scales[k].size() != keys[k].size() || value_scales[k].size() != keys[k].size()))
      return std::nullopt;
    for (size_t d = 0; d < keys[k].size(); ++d) {
      const at::Tensor& kt = keys[k][d];
      const int64_t len = kt.dim() == 3 ? kt.size(1) : -1;
      if (!on(kt, {n_kv, len, hd}) || !on(values[k][d], {n_kv, len, hd}) ||
          values[k][d].scalar_type() != kt.scalar_type() || len != keys[0][d].size(1))
        return std::nullopt;
      const bool int8 = scaled && key_scales[k][d].defined();
      if (int8) {
        const at::Tensor& ks = key_scales[k][d];
        if (kt.scalar_type() != at::kChar || ks.scalar_type() != at::kHalf ||
            value_scales[k][d].scalar_type() != at::kHalf || !(on(ks, {n_kv, len, 1}) || on(ks, {n_kv, 1, hd})) ||
            !on(value_scales[k][d], {n_kv, len, 1}))
          return std::nullopt;
      } else if (kt.scalar_type() != at::kFloat && kt.scalar_type() != out_type) {
        return std::nullopt;
      }
    }
  }
  std::vector<int64_t> lens;
  const std::vector<JoinPlace> places = join_places(keys[0], doc_counts, anchor, lens);
  const int64_t rows = static_cast<int64_t>(lens.size()), m = *std::max_element(lens.begin(), lens.end());
  const bool padded = std::any_of(lens.begin(), lens.end(), [&](int64_t l) { return l != m; });
  const at::TensorOptions opts = at::TensorOptions().dtype(out_type).device(device);
  std::vector<JointKV> out(keys.size());
  std::vector<at::Tensor> out_keys, out_values;
  // Every block's bias as float32 in two launches (a stack, one conversion), rows of one tensor,
  // where one conversion a block would be one launch and one allocation each.
  std::vector<at::Tensor> biases;
  for (size_t k = 0; k < keys.size(); ++k)
    if (w.cross.at(k).doc_bias.defined()) biases.push_back(w.cross.at(k).doc_bias.reshape({-1}));
  const bool same_bias_shape = !biases.empty() && std::all_of(biases.begin(), biases.end(), [&](const at::Tensor& b) {
    return b.sizes() == biases[0].sizes() && b.device() == device;
  });
  const at::Tensor biases_f32 = same_bias_shape ? at::stack(biases).to(at::kFloat) : at::Tensor();
  int64_t next_bias = 0;
  for (size_t k = 0; k < keys.size(); ++k) {
    // Joined once in the decoder's dtype, the bias once as float32: what a CUDA layer reads as it is.
    out[k].keys = padded ? at::zeros({rows, n_kv, m, hd}, opts) : at::empty({rows, n_kv, m, hd}, opts);
    out[k].values = padded ? at::zeros({rows, n_kv, m, hd}, opts) : at::empty({rows, n_kv, m, hd}, opts);
    if (padded)
      out[k].valid = at::arange(m, opts.dtype(at::kLong)).unsqueeze(0) <
                     detail::upload(at::tensor(lens, at::kLong), device).unsqueeze(1);
    out[k].anchor = anchor;
    const at::Tensor& bias = w.cross.at(k).doc_bias;
    if (bias.defined())
      out[k].bias = biases_f32.defined() ? biases_f32[next_bias++].view(bias.sizes())
                                         : bias.to(device, at::kFloat).contiguous();
    out_keys.push_back(out[k].keys);
    out_values.push_back(out[k].values);
  }
  std::vector<detail::JoinPart> parts;
  parts.reserve(keys.size() * places.size());
  for (size_t k = 0; k < keys.size(); ++k)
    for (const JoinPlace& p : places) {
      detail::JoinPart part;
      part.block = static_cast<int64_t>(k), part.row = p.row, part.offset = p.offset, part.angle = p.angle;
      part.keys = keys[k][p.doc], part.values = values[k][p.doc];
      if (scaled && key_scales[k][p.doc].defined())
        part.key_scales = key_scales[k][p.doc], part.value_scales = value_scales[k][p.doc];
      parts.push_back(std::move(part));
    }
  int64_t turns = 1;  // the angles used: [0, turns)
  for (const JoinPlace& p : places) turns = std::max(turns, std::abs(p.angle) + 1);
  ops->join_documents(parts, out_keys, out_values, rope_cos_.narrow(0, 0, turns).to(at::kFloat).contiguous(),
                      rope_sin_.narrow(0, 0, turns).to(at::kFloat).contiguous());
  return out;
}

COMB_INLINE std::optional<std::vector<JointKV>> Plugin::joint_kv_direct(const PluginWeights& w,
                                                          const std::vector<std::vector<at::Tensor>>& keys,
                                                          const std::vector<std::vector<at::Tensor>>& values,
                                                          const std::vector<int64_t>& doc_counts, int64_t anchor,
                                                          const std::vector<std::vector<at::Tensor>>& key_scales,
                                                          const std::vector<std::vector<at::Tensor>>& value_scales,
                                                          int64_t first_block) const {
  RECORD_FUNCTION("comb::joint_kv_direct", std::vector<c10::IValue>());
  // NOTE: joint_kv's tensor ops rotate each document's keys twice (back by the documents after it,
  // then forward by the anchor) and copy them through cat, pad and stack: 27 ms of a 120 ms warm
  // request on nq's ten documents (28 blocks). Here each key row is rotated once, by the composed
  // angle, straight into the joined tensor; values are copied once; int8 entries are read as they
  // are stored (dequantized in the same pass). Inference on CPU float32 only (training needs
  // joint_kv's gradients).
  if (at::GradMode::is_enabled() || keys.empty()) return std::nullopt;
  COMB_CHECK(first_block >= 0 && first_block + static_cast<int64_t>(keys.size()) <= config_.n_blocks(),
             "joint_kv: blocks [{}, {}) of a plug-in of {}", first_block, first_block + keys.size(),
             config_.n_blocks());
  const int64_t n_kv = base_config_.n_head_kv, hd = base_config_.head_dim;
  const bool scaled = !key_scales.empty();
  if (scaled && (key_scales.size() != keys.size() || value_scales.size() != keys.size())) return std::nullopt;
  auto is = [](const at::Tensor& t, c10::ScalarType dtype, std::initializer_list<int64_t> sizes) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
           t.sizes() == c10::IntArrayRef(sizes);
  };
  auto scale = [&](const at::Tensor& t, std::initializer_list<int64_t> sizes) {  // float16 or float32
    return is(t, at::kHalf, sizes) || is(t, at::kFloat, sizes);
  };
  for (size_t k = 0; k < keys.size(); ++k) {
    if (keys[k].empty() || keys[k].size() != keys[0].size() || values[k].size() != keys[k].size()) return std::nullopt;
    if (scaled && (key_scales[k].size() != keys[k].size() || value_scales[k].size() != keys[k].size()))
      return std::nullopt;
    for (size_t d = 0; d < keys[k].size(); ++d) {
      const int64_t len = keys[k][d].dim() == 3 ? keys[k][d].size(1) : -1;
      const bool int8 = scaled && key_scales[k][d].defined();
      const c10::ScalarType dt = int8 ? at::kChar : at::kFloat;
      if (!is(keys[k][d], dt, {n_kv, len, hd}) || !is(values[k][d], dt, {n_kv, len, hd}) ||
          (int8 && (!(scale(key_scales[k][d], {n_kv, len, 1}) || scale(key_scales[k][d], {n_kv, 1, hd})) ||
                    !scale(value_scales[k][d], {n_kv, len, 1}))))
        return std::nullopt;  // the general path says what is wrong, or handles it
    }
  }
  std::vector<int64_t> lens;
  const std::vector<JoinPlace> places = join_places(keys[0], doc_counts, anchor, lens);
  const int64_t rows = static_cast<int64_t>(lens.size()), m = *std::max_element(lens.begin(), lens.end());
  // The rotation tables of every angle used (a negative angle: cos(-a) = cos(a), sin(-a) = -sin(a)).
  const at::Tensor cos_table = rope_cos_.to(at::kFloat).contiguous(), sin_table = rope_sin_.to(at::kFloat).contiguous();
  std::vector<std::vector<float>> turns(places.size());
  for (size_t i = 0; i < places.size(); ++i) {
    const int64_t a = std::abs(places[i].angle);
    const float* cs = cos_table.data_ptr<float>() + a * hd;
    const float* sn = sin_table.data_ptr<float>() + a * hd;
    turns[i].assign(cs, cs + hd);
    for (int64_t j = 0; j < hd; ++j) turns[i].push_back(places[i].angle < 0 ? -sn[j] : sn[j]);
  }
  std::vector<JointKV> out(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    out[k].keys = at::empty({rows, n_kv, m, hd}, at::kFloat);
    out[k].values = at::empty({rows, n_kv, m, hd}, at::kFloat);
    if (std::any_of(lens.begin(), lens.end(), [&](int64_t l) { return l != m; })) {
      out[k].keys.zero_();  // padding stays 0 (and masked)
      out[k].values.zero_();
      out[k].valid = at::arange(m, at::kLong).unsqueeze(0) < at::tensor(lens, at::kLong).unsqueeze(1);
    }
    out[k].anchor = anchor;
    out[k].bias = w.cross.at(first_block + k).doc_bias;
  }
  at::parallel_for(0, static_cast<int64_t>(keys.size() * places.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const size_t k = job / places.size(), i = job % places.size();
      const JoinPlace& p = places[i];
      const at::Tensor& ks = keys[k][p.doc];
      const at::Tensor& vs = values[k][p.doc];
      const int64_t len = ks.size(1), half = hd / 2;
      float* kd = out[k].keys.data_ptr<float>() + (p.row * n_kv * m + p.offset) * hd;
      float* vd = out[k].values.data_ptr<float>() + (p.row * n_kv * m + p.offset) * hd;
      const float* cs = turns[i].data();
      const float* sn = cs + hd;
      if (scaled && key_scales[k][p.doc].defined()) {  // int8: a scale per value row; per key
        // channel over the document's tokens, or per key row (short documents)
        const at::Tensor& kst = key_scales[k][p.doc];
        const at::Tensor& vst = value_scales[k][p.doc];
        std::vector<float> scales(kst.numel() + vst.numel());  // float16 or float32, read as float
        auto read = [](const at::Tensor& t, float* out) {
          if (t.scalar_type() == at::kHalf) {
            const at::Half* x = t.data_ptr<at::Half>();
            for (int64_t i = 0; i < t.numel(); ++i) out[i] = static_cast<float>(x[i]);
          } else {
            std::copy(t.data_ptr<float>(), t.data_ptr<float>() + t.numel(), out);
          }
        };
        read(kst, scales.data());
        read(vst, scales.data() + kst.numel());
        const float* kscale = scales.data();
        const float* vscale = scales.data() + kst.numel();
        const bool key_rows = kst.size(2) == 1;
        const int8_t* kq = ks.data_ptr<int8_t>();
        const int8_t* vq = vs.data_ptr<int8_t>();
        for (int64_t h = 0; h < n_kv; ++h)
          for (int64_t t = 0; t < len; ++t) {
            const int8_t* x = kq + (h * len + t) * hd;
            float* y = kd + (h * m + t) * hd;
            if (key_rows) {
              const float sc = kscale[h * len + t];
              for (int64_t j = 0; j < half; ++j) {
                const float a = x[j] * sc, b = x[j + half] * sc;
                y[j] = a * cs[j] - b * sn[j];
                y[j + half] = b * cs[j + half] + a * sn[j + half];
              }
            } else {
              const float* sc = kscale + h * hd;
              for (int64_t j = 0; j < half; ++j) {
                const float a = x[j] * sc[j], b = x[j + half] * sc[j + half];
                y[j] = a * cs[j] - b * sn[j];
                y[j + half] = b * cs[j + half] + a * sn[j + half];
              }
            }
            const int8_t* xv = vq + (h * len + t) * hd;
            const float vsc = vscale[h * len + t];
            float* yv = vd + (h * m + t) * hd;
            for (int64_t j = 0; j < hd; ++j) yv[j] = xv[j] * vsc;
          }
        continue;
      }
      for (int64_t h = 0; h < n_kv; ++h) {
        const float* kr = ks.data_ptr<float>() + h * len * hd;
        const float* vr = vs.data_ptr<float>() + h * len * hd;
        if (p.angle == 0)
          std::copy(kr, kr + len * hd, kd + h * m * hd);
        else
          detail::cpu::rotate_rows(kr, hd, cs, sn, hd, len, kd + h * m * hd, hd);
        std::copy(vr, vr + len * hd, vd + h * m * hd);
      }
    }
  });
  return out;
}

COMB_INLINE at::Tensor Plugin::cross_block(int64_t k, const at::Tensor& x, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts,
                               int64_t start) const {
  return cross_block(weights_, k, x, keys, values, doc_counts, start);
}

COMB_INLINE at::Tensor Plugin::cross_block(const PluginWeights& w, int64_t k, const at::Tensor& x,
                               const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                               const std::vector<int64_t>& doc_counts, int64_t start) const {
  const auto& c = base_config_;
  const auto& b = w.cross.at(k);
  const c10::ScalarType dt = x.scalar_type();
  auto W = [&](const at::Tensor& t) { return t.scalar_type() == dt ? t : t.to(dt); };
  const int64_t batch = x.size(0), n = x.size(1);
  at::Tensor q = at::linear(rms_norm(x, W(b.attn_norm), c.rms_eps), W(b.wq)).view({batch, n, c.n_head, c.head_dim});
  if (config_.qk_norm) q = rms_norm(q, W(b.q_norm), c.rms_eps);
  if (config_.relative_positions) {
    COMB_CHECK(start >= 0 && start + n <= rope_cos_.size(0), "cross block: positions [{}, {}) beyond the context of {}",
               start, start + n, rope_cos_.size(0));
    q = apply_rope(q.transpose(1, 2), rope_cos_.narrow(0, start, n).to(dt), rope_sin_.narrow(0, start, n).to(dt))
            .transpose(1, 2);
  }
  at::Tensor attn = ops::cross_attention(q, keys, values, doc_counts, 1.0 / std::sqrt(double(c.head_dim)),
                                         config_.attention_sinks ? b.sinks : at::Tensor());
  at::Tensor h = x + at::tanh(W(b.attn_gate)) * at::linear(attn.reshape({batch, n, c.q_dim()}), W(b.wo));
  if (!config_.cross_mlp) return h;
  return h + at::tanh(W(b.mlp_gate)) * swiglu_mlp(rms_norm(h, W(b.ffn_norm), c.rms_eps), W(b.w_gate_up), W(b.w_down));
}

}  // namespace comb
