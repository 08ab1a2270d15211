#pragma once
// ModelConfig: the decoder's hyper-parameters, read in one place from GGUF metadata or config.json.
#include <nlohmann/json.hpp>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace comb {

class GgufFile;

// RoPE frequency scaling. "none" or "llama3" (Llama-3.1's smooth low/high frequency blend).
struct RopeScaling {
  std::string type = "none";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct ModelConfig {
  std::string architecture = "llama";
  int64_t n_vocab = 0;
  int64_t n_embd = 0;     // hidden size
  int64_t n_ff = 0;       // MLP inner size
  int64_t n_layer = 0;
  int64_t n_head = 0;     // query heads
  int64_t n_head_kv = 0;  // key/value heads (grouped-query attention)
  int64_t head_dim = 0;
  int64_t n_ctx = 0;      // longest sequence the model supports
  double rms_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_embeddings = false;  // output head shares the token embedding

  int64_t q_dim() const { return n_head * head_dim; }
  int64_t kv_dim() const { return n_head_kv * head_dim; }
  int64_t n_group() const { return n_head / n_head_kv; }

  // Checks every field for consistency; throws comb::Error naming the field and `where`.
  void validate(const std::string& where) const;

  // From a GGUF file's "<arch>.*" metadata (tie_embeddings: no output.weight tensor).
  static ModelConfig from_gguf(const GgufFile& gguf);
  // From a Hugging Face config.json object.
  static ModelConfig from_hf_json(const nlohmann::json& config, const std::string& where);
  // The config.json object for this config (Hugging Face LlamaConfig layout).
  nlohmann::json to_hf_json() const;
};

// Parses "float32" / "fp32" / "bfloat16" / "bf16" / "float16" / "fp16"; throws on anything else.
c10::ScalarType parse_dtype(const std::string& name);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/config.ipp"
#endif
