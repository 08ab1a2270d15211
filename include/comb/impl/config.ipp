// comb::ModelConfig: from GGUF metadata and config.json, checks, and back to config.json.
// Compiled into libcomb (src/config.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include "comb/detail/json_number.hpp"
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "comb/error.hpp"
#include "comb/gguf.hpp"
#include "comb/config.hpp"

namespace comb {

COMB_INLINE void ModelConfig::validate(const std::string& where) const {
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

COMB_INLINE ModelConfig ModelConfig::from_gguf(const GgufFile& g) {
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

COMB_INLINE ModelConfig ModelConfig::from_hf_json(const nlohmann::json& j, const std::string& where) {
  auto req = [&](const char* key) -> const nlohmann::json& {
    COMB_CHECK(j.contains(key) && j[key].is_number(), "{}: config key '{}' is missing or not a number", where, key);
    return j[key];
  };
  ModelConfig c;
  std::string type = j.value("model_type", "");
  COMB_CHECK(type == "llama", "{}: model_type '{}' is not supported (expected llama)", where, type);
  COMB_CHECK(!j.value("attention_bias", false) && !j.value("mlp_bias", false),
             "{}: attention or MLP biases are not supported", where);
  c.n_vocab = detail::json_whole(req("vocab_size"), where + ": vocab_size");
  c.n_embd = detail::json_whole(req("hidden_size"), where + ": hidden_size");
  c.n_ff = detail::json_whole(req("intermediate_size"), where + ": intermediate_size");
  c.n_layer = detail::json_whole(req("num_hidden_layers"), where + ": num_hidden_layers");
  c.n_head = detail::json_whole(req("num_attention_heads"), where + ": num_attention_heads");
  c.n_head_kv = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                    ? detail::json_whole(j["num_key_value_heads"], where + ": num_key_value_heads")
                    : c.n_head;
  c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? detail::json_whole(j["head_dim"], where + ": head_dim")
                                                                   : (c.n_head > 0 ? c.n_embd / c.n_head : 0);
  c.n_ctx = detail::json_whole(req("max_position_embeddings"), where + ": max_position_embeddings");
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
    c.rope_scaling.original_max_position =
        detail::json_whole(rope.at("original_max_position_embeddings"), where + ": original_max_position_embeddings");
  } else {
    COMB_CHECK(rope_type == "default", "{}: RoPE type '{}' is not supported (supported: default, llama3)", where,
               rope_type);
  }
  c.validate(where);
  return c;
}

COMB_INLINE nlohmann::json ModelConfig::to_hf_json() const {
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

COMB_INLINE c10::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  COMB_FAIL("unknown dtype '{}' (expected float32, bfloat16 or float16)", name);
}

}  // namespace comb
