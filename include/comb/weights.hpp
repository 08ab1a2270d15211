#pragma once
// The Llama family's weights and the one table that maps checkpoint names (GGUF and Hugging
// Face layouts) to them. Fusions (q|k|v, gate|up) happen here, never in the forward pass.
#include <ATen/core/Tensor.h>

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
// or mis-shaped tensor is reported in one comb::Error.
LlamaWeights load_llama_weights(const TensorSource& source, const ModelConfig& config, c10::ScalarType dtype,
                                c10::Device device);

// The tensors of `weights` under Hugging Face names (q|k|v and gate|up split again), for saving.
std::vector<std::pair<std::string, at::Tensor>> llama_weights_hf_named(const LlamaWeights& weights,
                                                                       const ModelConfig& config);

}  // namespace comb
