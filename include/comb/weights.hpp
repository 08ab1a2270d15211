#pragma once
// The Llama family's weights and the one table that maps checkpoint names (GGUF and Hugging
// Face layouts) to them. Fusions (q|k|v, gate|up) happen here, never in the forward pass.
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "comb/config.hpp"
#include "comb/tensor_source.hpp"

namespace comb {

struct LayerWeights {
  at::Tensor attn_norm;  // [n_embd]
  at::Tensor wqkv;       // [q_dim + 2 * kv_dim, n_embd]; q and k rows in rotate-half order
  at::Tensor wo;         // [n_embd, q_dim]
  at::Tensor ffn_norm;   // [n_embd]
  at::Tensor w_gate_up;  // [2 * n_ff, n_embd]; gate rows then up rows
  at::Tensor w_down;     // [n_embd, n_ff]
};

struct LlamaWeights {
  at::Tensor tok_embd;     // [n_vocab, n_embd]
  at::Tensor output_norm;  // [n_embd]
  at::Tensor output;       // [n_vocab, n_embd]; the same storage as tok_embd when tied
  at::Tensor rope_freqs;   // [head_dim / 2] GGUF frequency divisors (llama3 scaling), or undefined
  std::vector<LayerWeights> layers;
};

// Loads every weight of `config` from `source`, converted to `dtype` on `device`. Every missing
// or mis-shaped tensor is reported in one comb::Error. `hf_prefix` goes before every Hugging Face
// name ("language_model." for a COMB checkpoint, whose decoder lives under that prefix).
LlamaWeights load_llama_weights(const TensorSource& source, const ModelConfig& config, c10::ScalarType dtype,
                                c10::Device device, const std::string& hf_prefix = "");

// Appends the tensors of one layer under `prefix` + Hugging Face suffixes (q|k|v, gate|up split).
void append_llama_layer_hf_named(std::vector<std::pair<std::string, at::Tensor>>& out, const std::string& prefix,
                                 const LayerWeights& layer, const ModelConfig& config);

// Reads named tensors with expected shapes, collecting every problem before throwing once.
class WeightReader {
 public:
  WeightReader(const TensorSource& source, c10::ScalarType dtype, c10::Device device)
      : source_(source), dtype_(dtype), device_(device) {}
  // The tensor `name` of `shape`, or an undefined tensor (and a recorded problem) when it is
  // missing, mis-shaped or unreadable. A missing optional tensor is no problem.
  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape, bool required = true);
  // A Llama layer whose tensors are `prefix` + Hugging Face suffixes ("self_attn.q_proj.weight", ...).
  LayerWeights layer(const std::string& prefix, const ModelConfig& config);
  // Throws one comb::Error listing every problem, prefixed by `what`.
  void finish(const std::string& what) const;

 private:
  const TensorSource& source_;
  c10::ScalarType dtype_;
  c10::Device device_;
  std::vector<std::string> problems_;
};

// The tensors of `weights` under Hugging Face names (q|k|v and gate|up split again), for saving.
std::vector<std::pair<std::string, at::Tensor>> llama_weights_hf_named(const LlamaWeights& weights,
                                                                       const ModelConfig& config);

}  // namespace comb
