#pragma once
// The COMB plug-in: a small encoder whose per-document K/V the frozen decoder reads through gated
// cross-attention blocks. With gates at 0 (a fresh plug-in) or no documents, the decoder is unchanged.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comb/config.hpp"
#include "comb/decoder.hpp"
#include "comb/weights.hpp"

namespace comb {

class TensorSource;

struct PluginConfig {
  std::vector<int64_t> cross_layers;  // decoder layer each cross block runs before; one per encoder layer
  int64_t max_document_tokens = 0;    // longest document the encoder takes
  std::string base_fingerprint;       // the base decoder the plug-in was built for (base_fingerprint())

  int64_t n_encoder_layers() const { return static_cast<int64_t>(cross_layers.size()); }
  nlohmann::json to_json() const;
  static PluginConfig from_json(const nlohmann::json& j, const std::string& where);
};

struct CrossBlockWeights {
  at::Tensor attn_norm;  // [n_embd]
  at::Tensor wq;         // [q_dim, n_embd]
  at::Tensor q_norm;     // [head_dim]
  at::Tensor k_norm;     // [head_dim]
  at::Tensor wo;         // [n_embd, q_dim]
  at::Tensor attn_gate;  // [1]
  at::Tensor ffn_norm;   // [n_embd]
  at::Tensor w_gate_up;  // [2 * n_ff, n_embd]
  at::Tensor w_down;     // [n_embd, n_ff]
  at::Tensor mlp_gate;   // [1]
};

struct PluginWeights {
  at::Tensor tok_embd;                 // [n_vocab, n_embd] own encoder embedding, or undefined: the base's
  std::vector<LayerWeights> encoder;   // L_E bidirectional Llama layers
  std::vector<at::Tensor> wk, wv;      // per encoder layer: [kv_dim, n_embd]
  std::vector<CrossBlockWeights> cross;
};

// One document's encoder output: per cross block, K (after k_norm) and V.
struct DocumentKV {
  std::vector<at::Tensor> keys;    // per block: [n_head_kv, n_tokens, head_dim]
  std::vector<at::Tensor> values;  // per block: [n_head_kv, n_tokens, head_dim]
  int64_t n_tokens = 0;
  int64_t bytes() const;
  // A copy on `device` in `dtype`.
  DocumentKV to(c10::Device device, c10::ScalarType dtype) const;
};

struct PluginInitOptions {
  int64_t n_encoder_layers = 4;
  std::vector<int64_t> cross_layers;  // empty: spread evenly, the last block before the last layer
  bool copy_decoder_layers = true;    // encoder layer i starts as a copy of decoder layer cross_layers[i]
  // With copies: encoder layer i copies decoder layer i, and cross block i (before decoder layer
  // i + 1 unless cross_layers says otherwise) starts as that layer's attention over the documents'
  // states (its k/v projections with the input norm folded in, V scaled to the states' RMS), so
  // that cross-attention is useful from the first step and its gate can open.
  bool first_layers = false;
  uint64_t seed = 0;
  double init_std = 0.02;
};

// A fingerprint of a base decoder: its dimensions and (bf16-rounded) embedding and norms, so that
// the same base loaded from GGUF or safetensors, in any dtype, gives the same string.
std::string base_fingerprint(const Decoder& base);

class Plugin {
 public:
  // A new plug-in for `base`: gates 0, so it changes nothing until trained.
  static Plugin fresh(const Decoder& base, const PluginInitOptions& options);
  // A plug-in-only safetensors file (see docs/formats.md); refused when built for another base.
  static Plugin load(const std::string& path, const Decoder& base);
  // Reads the plug-in part of a COMB checkpoint in the reference layout (chunk_model.*, cross_layers.*).
  static Plugin from_checkpoint(const TensorSource& source, const PluginConfig& config, const Decoder& base);
  // Writes a plug-in-only safetensors file, in `dtype` (Undefined: as the weights are).
  void save(const std::string& path, c10::ScalarType dtype = c10::ScalarType::Undefined) const;

  const PluginConfig& config() const { return config_; }
  const PluginWeights& weights() const { return weights_; }
  PluginWeights& mutable_weights() { return weights_; }
  // Identifies these weights (XXH3-128, hex): caches made by another plug-in never match.
  const std::string& fingerprint() const { return fingerprint_; }
  // Cross block index that runs before decoder layer `layer`, or -1.
  int64_t block_before(int64_t layer) const;

  // Encodes one document [n] (positions 0..n-1, bidirectional) into per-block K/V.
  DocumentKV encode(const Decoder& base, const std::vector<int32_t>& tokens) const;
  // Cross block `k` on x [batch, n, n_embd], reading linked keys/values (see Linker).
  at::Tensor cross_block(int64_t k, const at::Tensor& x, const std::vector<at::Tensor>& keys,
                         const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts) const;
  // Names and tensors of the plug-in, in the reference checkpoint's naming.
  std::vector<std::pair<std::string, at::Tensor>> named_tensors() const;
  void refresh_fingerprint();

 private:
  Plugin(PluginConfig config, PluginWeights weights, const Decoder& base);
  PluginConfig config_;
  PluginWeights weights_;
  ModelConfig base_config_;
  std::string fingerprint_;
};

}  // namespace comb
