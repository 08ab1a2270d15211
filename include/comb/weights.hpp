#pragma once
// The Llama family's weights and the one table that maps checkpoint names (GGUF and Hugging
// Face layouts) to them. Fusions (q|k|v, gate|up) happen here, never in the forward pass.
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comb/config.hpp"
#include "comb/quantized.hpp"
#include "comb/tensor_source.hpp"

namespace comb {

// A layer's four matrices kept quantized (Options::quantize); see LayerWeights::quantized.
struct QuantizedLayer {
  QuantizedMatrix wqkv, wo, w_gate_up, w_down;
};

struct LayerWeights {
  at::Tensor attn_norm;  // [n_embd]
  at::Tensor wqkv;       // [q_dim + 2 * kv_dim, n_embd]; q and k rows in rotate-half order
  at::Tensor wo;         // [n_embd, q_dim]
  at::Tensor ffn_norm;   // [n_embd]
  at::Tensor w_gate_up;  // [2 * n_ff, n_embd]; gate rows then up rows
  at::Tensor w_down;     // [n_embd, n_ff]
  // When set, the four matrices live here, kept quantized, and the tensors above are undefined:
  // read them through project() and dense_matrix().
  std::shared_ptr<const QuantizedLayer> quantized;
};

// A layer's matrices by role, for project() and dense_matrix().
enum class Proj { qkv, o, gate_up, down };
// x [..., in] times layer matrix `p` (transposed): [..., out], dense or kept quantized.
at::Tensor project(const LayerWeights& l, Proj p, const at::Tensor& x);
// A kept-quantized layer's matrix by role.
const QuantizedMatrix& quantized_matrix(const QuantizedLayer& q, Proj p);
// The matrix itself, as a float tensor (dequantized, a new tensor, when kept quantized).
at::Tensor dense_matrix(const LayerWeights& l, Proj p);

struct LlamaWeights {
  at::Tensor tok_embd;     // [n_vocab, n_embd]
  at::Tensor output_norm;  // [n_embd]
  at::Tensor output;       // [n_vocab, n_embd]; the same storage as tok_embd when tied
  at::Tensor rope_freqs;   // [head_dim / 2] GGUF frequency divisors (llama3 scaling), or undefined
  std::vector<LayerWeights> layers;
  // Kept quantized (Options::quantize): the embedding and output head here, tok_embd and output
  // undefined. Tied heads share one matrix.
  std::shared_ptr<const QuantizedMatrix> tok_embd_q, output_q;
  bool quantized() const { return tok_embd_q || output_q || (!layers.empty() && layers[0].quantized); }
  // Kept quantized: base_fingerprint() of the same weights loaded as floats, computed on load (the
  // same model, so plug-ins built for it apply). Empty otherwise.
  std::string fingerprint;
  // What cache keys add for these weights: caches computed with weights kept quantized differ from
  // those of the float weights, so the two never share an entry ("" for float weights).
  std::string cache_tag() const { return quantized() ? "+quantized-" + quantization : ""; }
  std::string quantization;  // Options::quantize when the weights are kept quantized ("gguf", "int8", "int4")
  int64_t bytes() const;  // every weight's bytes as held (a tied head counted once)
};

// Loads every weight of `config` from `source`, converted to `dtype` on `device`. Every missing
// or mis-shaped tensor is reported in one comb::Error. `hf_prefix` goes before every Hugging Face
// name ("language_model." for a COMB checkpoint, whose decoder lives under that prefix).
// keep_quantized: matrices stored in groups (GGUF Q4_0, Q4_1, Q8_0) stay quantized
// (LayerWeights::quantized, tok_embd_q, output_q; CPU and float32 only); a layer with any matrix
// stored otherwise keeps all four as `dtype`.
LlamaWeights load_llama_weights(const TensorSource& source, const ModelConfig& config, c10::ScalarType dtype,
                                c10::Device device, const std::string& hf_prefix = "", bool keep_quantized = false);

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

// A fingerprint of a base decoder (base_fingerprint(), decoder.hpp) fed piece by piece: the
// embedding, the final norm, layer 0's attention norm and q|k|v rows, float as the checkpoint defines them (a tensor may come in row chunks: the hash is over
// its bytes in order).
class BaseFingerprint {
 public:
  explicit BaseFingerprint(const ModelConfig& config);
  ~BaseFingerprint();
  BaseFingerprint(const BaseFingerprint&) = delete;
  BaseFingerprint& operator=(const BaseFingerprint&) = delete;
  void add(const at::Tensor& t);  // hashed as bfloat16
  std::string finish();

 private:
  void* state_ = nullptr;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/weights.ipp"
#endif
