#pragma once
// The frozen Llama-family decoder: RMSNorm, RoPE (llama3 scaling included), grouped-query
// attention through at::scaled_dot_product_attention (on the CPU, rows after cached ones: two
// calls merged by log-sum-exp), SwiGLU, tied or untied output head.
#include <ATen/core/Tensor.h>

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "comb/config.hpp"
#include "comb/detail/upload.hpp"
#include "comb/kv_cache.hpp"
#include "comb/weights.hpp"

namespace comb {

namespace detail {
class DecodeStep;       // detail/decode_step.hpp
struct DecodeStepSpec;  // detail/decode_step.hpp
}  // namespace detail

// Which positions get logits.
enum class LogitsMode { last, all };

class LayerReads;
// A piece of one sequence's forward done by a caller that computes it with other work (a server's
// decoding step, Decoder::step_paged's PagedPiece): runs tokens [1, n] over `cache` (appending their
// K/V and advancing it) with `reads` (documents, or null) and returns float32 logits [1, 1,
// n_vocab] after the last of them, as Decoder::forward(tokens, cache, LogitsMode::last, reads) does.
using PieceForward = std::function<at::Tensor(const at::Tensor& tokens, KVCache& cache, const LayerReads* reads)>;

// RMSNorm over the last dimension, Hugging Face semantics: normalise in fp32, scale in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Splits a fused projection [batch, n, q_dim + 2 kv_dim] into views q [batch, n_head, n, head_dim]
// and k, v [batch, n_head_kv, n, head_dim].
std::array<at::Tensor, 3> split_qkv(const at::Tensor& qkv, const ModelConfig& config);
// Llama's MLP: down(silu(gate(x)) * up(x)) with w_gate_up [2 * n_ff, n_embd] (gate rows first).
at::Tensor swiglu_mlp(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down);
// The same with a layer's own matrices, dense or kept quantized.
at::Tensor swiglu_mlp(const at::Tensor& x, const LayerWeights& l);
// Keys and values a layer's queries read beside their own context, in the same softmax (the
// plug-in's joint blocks): keys, values [batch, n_head_kv, m, head_dim] (RoPE applied as wanted),
// valid [batch, m] bool (undefined: all are real), bias [n_head] (undefined: 0) added to every
// score of them. A row with no valid key gets exactly its own context's attention.
struct JointKV {
  at::Tensor keys, values, valid, bias;
  int64_t anchor = 0;  // prompt positions before it do not read the joined keys
};

// Keys and values one row of a paged step (Decoder::step_paged) reads beside its own positions, in
// the same softmax: segments of float32 [n_head_kv, n, head_dim], contiguous, read in order, and a
// bias [n_head] (float32) added to each of their scores, or null.
struct JointSegments {
  std::vector<const float*> keys, values;
  std::vector<int64_t> lengths;
  const float* bias = nullptr;
};

// What a forward reads besides its own tokens, layer by layer: a plug-in's documents
// (plugin.hpp's DocumentReads is the one implementation). Every forward of the decoder calls it:
// the cached one (Decoder::forward), training's differentiable one (Decoder::hidden) and the
// server's paged decoding step (Decoder::step_paged).
class LayerReads {
 public:
  virtual ~LayerReads() = default;
  // The state layer `layer` reads, from x [batch, n, n_embd] whose first row is at prompt
  // position `start` (a residual cross block before the layer), or x itself.
  virtual at::Tensor before(int64_t layer, const at::Tensor& x, int64_t start) const {
    (void)layer, (void)start;
    return x;
  }
  // Whether before() may return other than x itself (a residual cross block): a forward that reads
  // only joint() may take the CUDA graph step.
  virtual bool changes_state() const { return true; }
  // What layer `layer`'s attention reads beside its context (joint_attention()), or nullptr.
  virtual const JointKV* joint(int64_t layer) const {
    (void)layer;
    return nullptr;
  }
  // The same as segments for one row of a paged step (none by default).
  virtual JointSegments segments(int64_t layer) const {
    (void)layer;
    return {};
  }
  // Whether segments() is the only way these reads give their documents: only the fused CPU
  // paged step (Decoder::step_paged with cpu_kernels()) reads them; every other forward refuses
  // them rather than run without the documents.
  virtual bool segments_only() const { return false; }
};
// Grouped-query attention of q [batch, n_head, n, head_dim] (RoPE applied) over `joint`'s keys and
// its own context keys, values [batch, n_head_kv, start + n, head_dim], query j seeing context keys
// [0, start + j]: one softmax over both, differentiable in every input.
// Without gradients on CPU (float32, no padded joined keys) it runs joint_attention_merged.
at::Tensor joint_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                           const JointKV& joint);
// The same softmax for inference: the context and the joined keys attended apart by the fused CPU
// kernel and merged by their log-sum-exp (exact up to rounding). CPU float32, joint.valid undefined.
at::Tensor joint_attention_merged(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                                  const JointKV& joint);
// The same softmax by the fused CPU row kernel, for few rows (a warm request's question, a decoding
// step): each row of each KV head's query group over the joined keys (plus the bias; rows at
// positions before joint.anchor read none) and its causal context, every key read once for the
// group. q [batch, n, n_head, head_dim] contiguous, the cache's keys and values [batch, n_head_kv,
// capacity, head_dim] with the n new rows at [start, start + n); returns [batch, n, n_head * head_dim].
// Where merged_attention_applies(joint).
at::Tensor joint_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                                const JointKV& joint);
// Whether joint_attention_merged takes these joined keys (no gradients recorded, CPU float32 keys
// and values, no padding); the queries and context must be CPU float32 too.
bool merged_attention_applies(const JointKV& joint);
// One Llama layer over x [batch, n, n_embd] at positions 0..n-1 without a cache: RMSNorm, RoPE
// (cos, sin [n, head_dim]), grouped-query attention (causal, or bidirectional under `mask`
// [batch, 1, 1, n] bool, true = attend; undefined: every key), SwiGLU. The encoder's layers and
// training's decoder pass.
// With `joint` (causal only): the attention also reads its keys, see joint_attention().
at::Tensor llama_layer(const at::Tensor& x, const LayerWeights& l, const ModelConfig& config, const at::Tensor& cos,
                       const at::Tensor& sin, bool causal, const at::Tensor& mask = {}, const JointKV* joint = nullptr);
// Tokens [begin, end) of `tokens` as the decoder takes one sequence: int64 [1, end - begin].
at::Tensor token_ids(const std::vector<int32_t>& tokens, int64_t begin, int64_t end);
// Which of keys [0, n_keys) queries at `positions` [m] see (causal by position): bool [m, n_keys].
at::Tensor visible_keys(const at::Tensor& positions, int64_t n_keys);
// Rotate-half RoPE on x [..., n, head_dim] with cos, sin [n, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

class Decoder {
 public:
  Decoder(ModelConfig config, LlamaWeights weights, c10::ScalarType dtype, c10::Device device);

  // fp32 on CPU runs fused kernels for the small steps (norms, RoPE, short attention, GEMV);
  // off, every step goes through generic ATen ops (the path other devices and dtypes take).
  void set_cpu_kernels(bool on) { cpu_kernels_ = on; }
  bool cpu_kernels() const { return cpu_kernels_ && device_.is_cpu() && dtype_ == c10::kFloat; }
  // On a CUDA device with dense float16 or bfloat16 weights, one sequence's layers run comb's fused
  // CUDA kernels (RMSNorm, RoPE with the cache append, SwiGLU's activation, attention of few rows
  // with the documents' keys in the same softmax; detail/decode_step.hpp), and a short forward (up
  // to 64 tokens, COMB_CUDA_STEP_ROWS up to 128: a decoding step, a warm request's question; with a
  // plug-in's joint blocks or no documents) runs as one captured CUDA graph of them, one per bucket
  // of rows (1, 2, 4, ..., 64), the tokens padded up to it. Off (or COMB_CUDA_KERNELS=0 in the
  // environment): generic ATen ops only; COMB_CUDA_GRAPHS=0 leaves out the graph alone. Where comb
  // has no CUDA ops the generic path runs either way.
  void set_cuda_kernels(bool on) { cuda_kernels_ = on; }
  // The server's paged step (step_paged) over rows without documents replayed as one CUDA graph
  // per bucket of rows (comb's kernels, a half-precision CUDA decoder). On by default (on one H200,
  // docs/benchmarks.md); COMB_CUDA_PAGED_GRAPHS=0 in the environment turns it off.
  void set_cuda_paged_graphs(bool on) { cuda_paged_graphs_ = on; }
  // Whether short forwards over `cache` may take the CUDA graphs (forward() also needs reads of
  // joint blocks only, and the last row's logits alone).
  bool cuda_graph_applies(const KVCache& cache) const;
  // Whether layers over `cache` take the fused CUDA kernels.
  bool cuda_kernels_apply(const KVCache& cache) const;
  // What the CUDA decoding step reads of this decoder (its sizes and dense weights).
  detail::DecodeStepSpec decode_step_spec() const;

  // One input of layer_parts(): x [batch, n, n_embd] after the positions `cache` holds (it writes
  // its K/V there; the caller advances the cache after the last layer), reading what `reads` gives
  // the layer if given (as every forward reads documents).
  struct LayerPart {
    at::Tensor x;
    KVCache* cache = nullptr;
    const LayerReads* reads = nullptr;
  };
  // Layer i over several inputs with one read of its weights: all their rows go through each
  // projection and the MLP together, each attends over its own cache (and joined keys). The fused
  // CPU path only (cpu_kernels()); the joined keys as joint_attention_merged takes them. A cold
  // request's documents (through the encoder, the base's own layers) and its prompt use it.
  std::vector<at::Tensor> layer_parts(int64_t i, const std::vector<LayerPart>& parts) const;

  // Runs `tokens` [batch, n] (int64) at positions cache.length() .. + n, appends their K/V to
  // `cache`, and returns float32 logits [batch, n or 1, n_vocab]. `reads`: what the layers read
  // besides the tokens (documents), or nothing.
  at::Tensor forward(const at::Tensor& tokens, KVCache& cache, LogitsMode mode = LogitsMode::last,
                     const LayerReads* reads = nullptr) const;

  // Training's pass: `tokens` [batch, n] at positions 0..n-1, causal, without a cache, through the
  // generic (differentiable) layer; returns the final-normed hidden state [batch, n, n_embd].
  at::Tensor hidden(const at::Tensor& tokens, const LayerReads* reads = nullptr) const;

  // One row of a paged decoding step: `token` fed at `position`, its K/V written into the blocks of
  // `blocks` (which hold positions [0, position]); `reads`: its documents, or nullptr.
  struct PagedRow {
    int64_t token = 0;
    int64_t position = 0;
    const std::vector<int32_t>* blocks = nullptr;
    const LayerReads* reads = nullptr;
  };
  // Runs fn(0) .. fn(n - 1), in parallel where it can (which thread runs which must not matter).
  using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& fn)>;
  // One decoding step of several sequences whose K/V lie in `pool` (the decoder's dtype and
  // device): returns float32 logits [rows, n_vocab] on the decoder's device.
  // On the fused CPU path (cpu_kernels()): row-wise kernels throughout, so a row's numbers do not
  // depend on the other rows (a request's greedy output is the same in a batch of any size); `run`
  // (null: at::parallel_for) runs its loops; a row's documents as segments (Documents::paged_reads).
  // Otherwise (any device and dtype, the GPU's server): every row through each matrix together,
  // the rows without documents attending in one padded batch over their gathered blocks, a row
  // with documents alone through joint_attention over the reads' joint() keys (documents read as
  // a forward reads them, Model::document_reads).
  //
  // `piece` (off the fused CPU path only, paged_piece_applies()): a piece of one sequence's prompt
  // computed in the same forward, its rows through each matrix with the decoding rows': tokens
  // [1, n] (int64) at positions cache->length() .. + n, their K/V appended to *cache (advanced by n
  // after), each attending causally over the cache and what `reads` gives (its documents), as
  // forward() would. piece->logits receives float32 [n_vocab] after its last token.
  struct PagedPiece {
    at::Tensor tokens;
    KVCache* cache = nullptr;
    const LayerReads* reads = nullptr;
    at::Tensor logits;  // out
  };
  at::Tensor step_paged(BlockPool& pool, const std::vector<PagedRow>& rows, const ParallelFor& run = nullptr,
                        PagedPiece* piece = nullptr) const;
  // Whether step_paged takes a prompt's piece beside its rows (the generic path: not the fused CPU
  // kernels, whose rows are computed one by one).
  bool paged_piece_applies() const { return !cpu_kernels(); }

  // The steps of forward(), for wrappers that add blocks between layers.
  at::Tensor embed(const at::Tensor& tokens) const;                                    // -> [batch, n, n_embd]
  at::Tensor layer(int64_t i, const at::Tensor& x, KVCache& cache,
                   const JointKV* joint = nullptr) const;  // x: [batch, n, n_embd]
  at::Tensor logits(const at::Tensor& x, LogitsMode mode) const;                      // -> [batch, n|1, n_vocab]
  // Several sequences packed in one row sequence, each after the same `pre` positions whose K/V a
  // layer reads from elsewhere (Plugin::encode_packed: documents after the encoder prefix): sequence
  // d holds rows [first[d], first[d + 1]) of x [1, first.back(), n_embd] at positions pre, pre + 1,
  // ... Built once (on the decoder's device) for every layer of a pass; layer_packed() runs them.
  struct PackedRows {
    std::vector<int64_t> first;  // n_seq + 1 row offsets, from 0
    int64_t pre = 0, longest = 0;
    at::Tensor cos, sin;         // [rows, head_dim]: each row's RoPE angle
    at::Tensor gather;           // long [n_seq * pre + rows]: each sequence's keys, the pre's then its own
    at::Tensor cu_rows, cu_keys; // int32 [n_seq + 1]: each sequence's first row and first key
  };
  PackedRows packed_rows(const std::vector<int64_t>& lengths, int64_t pre) const;
  // Layer `i` of the packed sequences: each attends to layer i's `pre` positions of prefix_keys and
  // prefix_values ([1, n_head_kv, >= pre, head_dim], keys turned) and causally to itself; no cache
  // is written. `varlen` (a CUDA bfloat16/float16 decoder): one FlashAttention launch over every
  // sequence (variable lengths); else a sequence at a time. On a CUDA half decoder the norms and the
  // activation are the fused kernels, else generic ATen ops. `kv` (when given): the layer's keys
  // (turned, each row at its position) and values of every row, [1, n_head_kv, rows, head_dim] (the
  // last dimension contiguous), as a cache at the rows' positions would hold them.
  at::Tensor layer_packed(int64_t i, const at::Tensor& x, const PackedRows& rows, const at::Tensor& prefix_keys,
                          const at::Tensor& prefix_values, bool varlen,
                          std::pair<at::Tensor, at::Tensor>* kv = nullptr) const;
  // Layer `i` for tokens at explicit, increasing `positions` [m] (batch 1): their K/V go into
  // `cache` at those positions, and each attends to every cached position up to its own among
  // [0, n_keys). For recomputing chosen tokens over a cache filled by other means.
  at::Tensor layer_at(int64_t i, const at::Tensor& x, const at::Tensor& positions, KVCache& cache,
                      int64_t n_keys) const;  // x: [1, m, n_embd]
  // K (after RoPE) that layer `i` would compute for x [1, m, n_embd] at `positions`: [1, n_head_kv, m, head_dim].
  at::Tensor keys_at(int64_t i, const at::Tensor& x, const at::Tensor& positions) const;

  // Writes the K/V that layer `layer` computed for n tokens at positions [0, n) (k, v [batch,
  // n_head_kv, n, head_dim]) into `cache` at positions [pos, pos + n), the keys rotated by `pos`
  // with this model's RoPE (exact up to rounding: R(pos + i) = R(pos) R(i)). Reused documents.
  // k, v may be rows of `cache` itself. Throws if [pos, pos + n) is past the cache's capacity or
  // the model's context, or if the shapes differ from the cache's.
  void place(int64_t layer, KVCache& cache, int64_t pos, const at::Tensor& k, const at::Tensor& v) const;

  KVCache make_cache(int64_t batch, int64_t capacity) const;
  const ModelConfig& config() const { return config_; }
  const LlamaWeights& weights() const { return weights_; }
  const at::Tensor& rope_cos() const { return rope_cos_; }  // [n_ctx, head_dim]
  const at::Tensor& rope_sin() const { return rope_sin_; }
  c10::ScalarType dtype() const { return dtype_; }
  c10::Device device() const { return device_; }

 private:
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const;
  // The generic path's attention of layer i from its projection qkv [batch, n, q_dim + 2 kv_dim]:
  // RoPE at the cache's positions, K/V appended, [batch, n, q_dim] before the output projection.
  at::Tensor attention(int64_t i, const at::Tensor& qkv, KVCache& cache, const JointKV* joint = nullptr) const;
  // `joint`: read through joint_attention_merged (no gradients, float32, no padded joined keys).
  at::Tensor layer_cpu(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint = nullptr) const;
  at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w) const;
  at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w) const;

  ModelConfig config_;
  LlamaWeights weights_;
  c10::ScalarType dtype_;
  c10::Device device_;
  at::Tensor rope_cos_, rope_sin_;  // [n_ctx, head_dim]
  bool cpu_kernels_ = true;
  bool cuda_kernels_ = true;
  bool cuda_paged_graphs_ = true;  // from COMB_CUDA_PAGED_GRAPHS at construction
  // Who this decoder is to the paged step's graphs kept with a pool (they read its weights): a
  // graph made for a decoder since destroyed is never replayed.
  std::shared_ptr<const int> identity_ = std::make_shared<const int>(0);
  // The CUDA decoding step, made on first use; one caller at a time.
  mutable std::shared_ptr<detail::DecodeStep> cuda_step_;
  mutable std::shared_ptr<std::mutex> cuda_step_mutex_ = std::make_shared<std::mutex>();
  // base_fingerprint(), computed once per decoder (it reads the whole embedding: on a GPU a copy of
  // it to the host), shared by copies of the decoder, which share its weights.
  struct FingerprintMemo {
    std::once_flag once;
    std::string value;
  };
  std::shared_ptr<FingerprintMemo> fingerprint_ = std::make_shared<FingerprintMemo>();
  friend std::string base_fingerprint(const Decoder& base);
  // forward()'s short forward as the graph step: n <= detail::step_rows() tokens [1, n] that fit
  // the cache, reading `reads` (null, or joint blocks alone); an undefined tensor when the reads do
  // not fit the step (nothing run).
  at::Tensor cuda_step(const at::Tensor& tokens, KVCache& cache, const LayerReads* reads) const;
  at::Tensor layer_cuda(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint) const;
  // step_paged's path off the fused CPU kernels (generic ATen ops; the CUDA norm and activation
  // kernels on a CUDA half decoder).
  at::Tensor step_paged_generic(BlockPool& pool, const std::vector<PagedRow>& rows, PagedPiece* piece) const;
  // A piece's attention of layer i over its cache (and joined keys), as layer() would take it:
  // comb's CUDA kernels where they apply (attend_cuda), else generic ATen ops (attention()).
  at::Tensor attend_piece(int64_t i, const at::Tensor& qkv, KVCache& cache, const JointKV* joint) const;
  // Whether attention over `cache` (and `joint`'s keys: one batch row, no padding) takes comb's
  // CUDA kernels: the one condition layer() and attend_piece() share.
  bool cuda_attention_applies(const KVCache& cache, const JointKV* joint) const;
  // layer_cuda's attention from qkv [1, n, q_dim + 2 kv_dim]: RoPE and the cache append in one
  // kernel, then the rows kernel (few rows or joined keys) or SDPA; [1, n, q_dim].
  at::Tensor attend_cuda(int64_t i, const at::Tensor& qkv, KVCache& cache, const JointKV* joint) const;
  // Its rows through comb's CUDA kernels, from device tensors alone (ids and positions int64 [n],
  // block tables int32 [n, max_blocks]; longest: the most keys a row reads, the joined ones apart;
  // joined: undefined (no row reads documents), or int64 [n_layer, n, 5], each row's joined keys
  // at each layer as CudaLayerOps::paged_attention_joined reads them): float32 logits [n, n_vocab].
  // Run as it is, or captured (detail::PagedGraphs).
  at::Tensor paged_kernels_step(BlockPool& pool, const at::Tensor& ids, const at::Tensor& positions,
                                const at::Tensor& table, int64_t longest, const at::Tensor& joined = {}) const;
  // oneDNN copies of each layer's {wqkv, wo, w_gate_up, w_down} for prefill GEMMs on CPU; the
  // dense weights above are views of the same memory (see prepack_onednn()), or empty.
  std::vector<std::array<at::Tensor, 4>> onednn_;
  void prepack_onednn();
};

// A fingerprint of a base decoder: its dimensions and (bf16-rounded) embedding and norms, so that
// the same base loaded from GGUF or safetensors, in any dtype, gives the same string. Computed on
// the first call for a decoder, then remembered.
std::string base_fingerprint(const Decoder& base);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/decoder.ipp"
#endif
