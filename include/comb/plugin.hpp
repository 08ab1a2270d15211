#pragma once
// The COMB plug-in: a small encoder whose per-document K/V the frozen decoder reads through gated
// cross-attention blocks. With gates at 0 (a fresh plug-in) or no documents, the decoder is unchanged.
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comb/config.hpp"
#include "comb/decoder.hpp"
#include "comb/document_kv.hpp"
#include "comb/weights.hpp"

namespace comb {

class TensorSource;

struct PluginConfig {
  std::vector<int64_t> cross_layers;  // decoder layer each cross block runs before (increasing)
  int64_t max_document_tokens = 0;    // longest document the encoder takes
  std::string base_fingerprint;       // the base decoder the plug-in was built for (base_fingerprint())
  // The layout. Defaults are the reference implementation's: one bidirectional encoder layer per
  // cross block, block k reading the output of encoder layer k, QK-norm, a gated MLP per block.
  int64_t encoder_layers = 0;         // 0: one per cross block
  std::vector<int64_t> read_depths;   // per block: how many encoder layers its K/V come after; empty: k + 1
  bool encoder_from_base = false;     // encoder layer j is the base decoder's layer j (frozen, not in the file)
  bool encoder_causal = false;        // the encoder attends causally (as the decoder does) instead of both ways
  std::vector<int64_t> encoder_prefix;  // tokens the encoder reads before every document, not read by the blocks
  bool kv_norm = false;               // an RMSNorm (weight per block) on encoder states before k/v projections
  bool qk_norm = true;                // RMSNorm on cross-attention queries and keys
  // RoPE in the cross-attention: a document's keys at positions -n..-1 (counted back from its own
  // end, so every document sits right before the prompt, whatever its place among the others) and
  // the queries at their positions in the prompt. Still position-independent: a document's cache
  // depends on its own tokens only.
  bool relative_positions = false;
  bool attention_sinks = false;       // a learned logit per head for attending to nothing
  bool cross_mlp = true;              // a gated MLP after each cross-attention
  // Each block joins its decoder layer's attention instead of running before it: the layer's own
  // queries read the documents' K/V and their context in one softmax (joint_attention()), with a
  // learned logit per head added to the documents' scores. Such a block has no query, output,
  // gate or MLP weights of its own; only its K/V projections (and kv_norm) and that bias.
  bool joint_attention = false;
  // Joint blocks only: the documents sit between the instruction prefix and the question, as in a
  // full prompt. The prompt's first `anchor` tokens (the prefix; LinkedDocuments::anchor) do not
  // read them, so their K/V are the bare decoder's and come from a prefix cache; the documents'
  // keys end right before position `anchor`. Off: every prompt token reads them (anchor 0).
  bool documents_after_prefix = false;
  // Joint blocks only: the linked documents sit one after another, in the order linked, as in a
  // full prompt (the last one ends where a single document would), instead of each ending right
  // before the prompt. Each cache still depends on its document alone; the keys are turned into
  // place when linked (Plugin::joint_kv), so the order linked now matters as it does in a prompt.
  bool consecutive_documents = false;
  // Consecutive documents only, 0 (the default): off. When a row's linked documents hold more than
  // this many tokens in all, their distances from the question shrink in proportion: a document
  // that ends `after` tokens before the question (of `total` linked) is turned as if it ended
  // after * document_span / total tokens before it (rounded down; document_offset). Each document
  // keeps its own tokens' spacing, so the documents' spans overlap. The far documents of a long
  // row are read at the distances a plug-in trained on shorter rows has seen.
  int64_t document_span = 0;
  // With document_span, 0 (the default) or fewer tokens than it: the distances up to this many
  // tokens are kept as linked and only those beyond shrink, into (document_near, document_span]:
  // the documents nearest the question are read where a row within the span reads them.
  int64_t document_near = 0;
  // How its document caches are kept when the store's dtype is "auto" (StoreOptions::dtype
  // Undefined, the default): "" (float32 as computed), "bfloat16", "float16", "int8", "int8-int4"
  // or "int4". The dtype
  // the plug-in was measured with; a store given a dtype keeps that one instead.
  std::string cache_dtype;

  int64_t n_blocks() const { return static_cast<int64_t>(cross_layers.size()); }
  int64_t n_encoder_layers() const { return encoder_layers > 0 ? encoder_layers : n_blocks(); }
  int64_t read_depth(int64_t k) const { return read_depths.empty() ? k + 1 : read_depths.at(k); }
  // Where a consecutive document ending `after` tokens before the question (of `total` linked in
  // its row) is placed: `after` itself unless document_span shrinks it (beyond document_near).
  int64_t document_offset(int64_t after, int64_t total) const {
    if (document_span <= 0 || total <= document_span || after <= document_near) return after;
    return document_near + (after - document_near) * (document_span - document_near) / (total - document_near);
  }
  nlohmann::json to_json() const;
  static PluginConfig from_json(const nlohmann::json& j, const std::string& where);
};

// Tensors a layout leaves out are undefined (q_norm, k_norm without QK-norm; sinks without sinks;
// the MLP's without cross_mlp).
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
  at::Tensor sinks;      // [n_head]: logit of attending to nothing
  at::Tensor doc_bias;   // [n_head]: joint_attention: added to every document score
};

struct PluginWeights {
  at::Tensor tok_embd;                 // [n_vocab, n_embd] own encoder embedding, or undefined: the base's
  std::vector<LayerWeights> encoder;   // L_E Llama layers (empty when the encoder is the base's layers)
  std::vector<at::Tensor> kv_norm;     // per cross block: [n_embd] (with kv_norm)
  std::vector<at::Tensor> wk, wv;      // per cross block: [kv_dim, n_embd]
  std::vector<CrossBlockWeights> cross;
};

// One document's encoder output: per cross block, K (after k_norm) and V.
struct PluginInitOptions {
  // `reads`: a plug-in that reads its documents before any training. The encoder is the base's own
  // first layers, causal (each document's states are the decoder's states of that document alone);
  // cross block k, before decoder layer L = cross_layers[k], reads the depth-L states through layer
  // L's own attention (its input norm on the states, its q/k/v/o projections, its score scale, no
  // QK-norm, no positions), with a sink per head at the log-sum-exp that head gives its own context
  // on `probes` (so the documents get the share of attention they would get beside that context),
  // the attention gate open and no MLP. Needs cross_layers.
  bool reads = false;
  std::vector<std::vector<int32_t>> probes;  // `reads`: prompts whose self-attention sets the sinks
  // `reads`: read by the encoder before each document and dropped (its first token, where a
  // decoder parks attention, so that the document's own first token does not become that sink).
  std::vector<int64_t> encoder_prefix;
  double open_gate = 0.995;                  // `reads`: tanh(attention gate)
  // `reads`: blocks that join their layer's attention (see PluginConfig::joint_attention), bias 0:
  // at step 0, the layer attends to the documents' states as to its own context.
  bool joint_attention = false;
  bool documents_after_prefix = false;       // joint: see PluginConfig
  bool consecutive_documents = false;        // joint: see PluginConfig
  bool relative_positions = true;            // `reads`: see PluginConfig
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
  // This plug-in with only the cross blocks `keep` (indices, increasing): each kept block as it
  // was (its layer, its read depth, its weights), the encoder cut to the deepest depth they read.
  // Its documents' caches hold those blocks alone (bytes in proportion), and a cold request
  // encodes through fewer layers when the deepest blocks go; what the dropped blocks read is lost,
  // untrained (measure it: docs/evaluation.md).
  Plugin with_blocks(const std::vector<int64_t>& keep, const Decoder& base) const;
  // Sets PluginConfig::cache_dtype ("" or "float32", "bfloat16", "float16", "int8", "int8-int4",
  // "int4"); the
  // fingerprint follows, so caches kept in another dtype are not mixed up with its own.
  void set_cache_dtype(const std::string& dtype);
  // Sets PluginConfig::document_span (0: off; only for consecutive documents) and document_near
  // (below the span). A document's cache
  // holds the same numbers, only where linking places it changes; the fingerprint changes with the
  // field, so a store keys such caches apart.
  void set_document_span(int64_t tokens, int64_t near = 0);
  // Identifies these weights (XXH3-128, hex): caches made by another plug-in never match.
  const std::string& fingerprint() const { return fingerprint_; }
  // Cross block index that runs before decoder layer `layer`, or -1.
  int64_t block_before(int64_t layer) const;
  // Per block K, V [n_docs, n_head_kv, len, head_dim] cut into one DocumentKV per document
  // (document d's first lens[d] positions, copied).
  static std::vector<DocumentKV> split_documents(const std::vector<at::Tensor>& keys,
                                                 const std::vector<at::Tensor>& values,
                                                 const std::vector<int64_t>& lens);
  // The same from per block K, V [batch, n_head_kv, n, head_dim] with document d at batch row
  // rows[d][0], positions [rows[d][1], rows[d][1] + rows[d][2]). Both copy in one launch a block,
  // into one allocation per document whose blocks are views of it, on a CUDA device with comb's ops
  // and without gradients (CudaLayerOps::split_documents); else a copy per document and block.
  static std::vector<DocumentKV> split_rows(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                            const std::vector<std::array<int64_t, 3>>& rows);
  // encode_many's documents (an encoder of the base's own layers) packed in one row sequence, after
  // `prefix_states`' encoder prefix: encode_padded's K/V without the padding, up to rounding
  // (Decoder::layer_packed; `varlen`: one FlashAttention launch a layer, a CUDA half base). On a
  // CUDA half base encode_many runs it (COMB_CUDA_VARLEN=0 in the environment: the padded batch).
  std::vector<DocumentKV> encode_packed(const Decoder& base, const std::vector<const std::vector<int32_t>*>& documents,
                                        const KVCache& prefix_states, bool varlen) const;
  // encoder_is_base(): documents [n_docs] through the base's cached forward as one padded batch,
  // each block's K/V projected with `w` (nullptr: this plug-in's own weights). The base's layers run
  // without gradients; the projections keep them where they are enabled (encode_trainable).
  std::vector<DocumentKV> encode_padded(const Decoder& base, const std::vector<const std::vector<int32_t>*>& documents,
                                        const KVCache& prefix_states, const PluginWeights* w = nullptr) const;
  // encode_many's computation (its batches, the base's cached forward, no gradient through the
  // base's frozen layers) with the blocks' K/V projected by `w` (training's masters), differentiable
  // in `w` where gradients are enabled. Needs encoder_is_base() and `w` without an embedding of its
  // own. Training encodes its documents so on the CPU (plugin_train_logits).
  std::vector<DocumentKV> encode_trainable(const Decoder& base, const PluginWeights& w,
                                           const std::vector<std::vector<int32_t>>& documents) const;
  // encode_many's batches (and Documents::decoder_kv_many's): indices of `documents`, by length
  // then tokens (so the same documents make the same batches in any order), padded tokens within
  // 5/4 of the real ones and 4096. On a GPU (`gpu`), where a forward costs its launches more than
  // its padding, as few batches as 16,384 padded tokens allow: a request's ten short documents go
  // through the layers once.
  static std::vector<std::vector<size_t>> encoding_batches(const std::vector<std::vector<int32_t>>& documents,
                                                           bool gpu = false);

  // Encodes one document [n] (positions 0..n-1) into per-block K/V. An encoder of the base's own
  // layers, causal, runs the base's cached forward (its fused kernels) after `prefix_states`, the
  // encoder prefix's states from encoder_prefix_states() (computed here when not given): a document
  // then costs its own tokens only, however long the prefix.
  DocumentKV encode(const Decoder& base, const std::vector<int32_t>& tokens,
                    const KVCache* prefix_states = nullptr) const;
  // Several documents at once, in order: with encoder_is_base(), documents of similar lengths go
  // through the base's layers as one padded batch (padding after each document's tokens, which a
  // causal encoder never reads), so a request of many short documents makes few calls; else one
  // encode() each.
  std::vector<DocumentKV> encode_many(const Decoder& base, const std::vector<std::vector<int32_t>>& documents,
                                      const KVCache* prefix_states = nullptr) const;
  // One document encoded a piece at a time (a server runs the pieces between decoding steps), with
  // encoder_is_base(): begin_encoding() checks the document and returns the encoder's cache holding
  // the prefix states; encode_piece() encodes tokens [begin, end) after tokens [0, begin) (their
  // states in `cache`) and appends their K/V per block to `keys`, `values`; the pieces joined
  // (finish_encoding) are encode()'s entry, up to the rounding of other matrix shapes.
  KVCache begin_encoding(const Decoder& base, const std::vector<int32_t>& tokens, const KVCache& prefix_states) const;
  void encode_piece(const Decoder& base, const std::vector<int32_t>& tokens, int64_t begin, int64_t end, KVCache& cache,
                    std::vector<std::vector<at::Tensor>>& keys, std::vector<std::vector<at::Tensor>>& values) const;
  static DocumentKV finish_encoding(const std::vector<std::vector<at::Tensor>>& keys,
                                    const std::vector<std::vector<at::Tensor>>& values, int64_t n_tokens);
  // Whether encode() runs the base's own cached forward (encoder_from_base, causal, the base's embedding).
  bool encoder_is_base() const;
  // A cold request's new documents and its prompt computed together (Documents::get_with_prompt):
  // true where that applies (joint blocks that read depths at or before their layer, an encoder of
  // the base's own layers, the base's fused CPU path, no gradients).
  bool encodes_alongside(const Decoder& base) const;
  // Block k's K/V of each document (float, [n_head_kv, len, head_dim], in the order given) ->
  // what the prompt's layer reads beside its context.
  using JoinBlock = std::function<const JointKV*(int64_t block, std::vector<at::Tensor> keys,
                                                 std::vector<at::Tensor> values)>;
  // encode_many's encoding of `documents` (the same batches) and the decoder's forward of `tokens`
  // after `cache`, layer by layer in one Decoder::layer_parts call each, so that each layer's
  // weights are read once for both: before the prompt's layer L, `join` receives the documents'
  // K/V of the block at L (computed by then) and returns the joined keys that layer reads. Returns
  // the prompt's last hidden state [batch, n, n_embd]; `cache` is advanced. Needs
  // encodes_alongside().
  at::Tensor encode_alongside(const Decoder& base, const std::vector<std::vector<int32_t>>& documents,
                              const KVCache& prefix_states, const at::Tensor& tokens, KVCache& cache,
                              const JoinBlock& join) const;
  // The encoder prefix through the encoder's layers: the same before every document, so a caller
  // that encodes many (Documents::get) computes it once. Needs encoder_is_base(). `layers`: how
  // many of the base's layers (-1: the encoder's; all of them give the decoder's own K/V of those
  // tokens, which a prompt that starts with them can take instead of computing them).
  KVCache encoder_prefix_states(const Decoder& base, int64_t layers = -1) const;
  // Cross block `k` on x [batch, n, n_embd], reading linked keys/values (see Linker).
  // `start`: the prompt position of x's first row (with relative_positions).
  at::Tensor cross_block(int64_t k, const at::Tensor& x, const std::vector<at::Tensor>& keys,
                         const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts,
                         int64_t start = 0) const;

  // The same two steps with other weights of this layout (training's float32 masters, cast to the
  // base's dtype inside): differentiable in `w`. encode_batch takes documents [n_docs, len] padded
  // after their real tokens (`mask` [n_docs, len] bool, undefined: none) and returns per block
  // K and V [n_docs, n_head_kv, len, head_dim].
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> encode_batch(const Decoder& base, const PluginWeights& w,
                                                                           const at::Tensor& tokens,
                                                                           const at::Tensor& mask) const;
  at::Tensor cross_block(const PluginWeights& w, int64_t k, const at::Tensor& x, const std::vector<at::Tensor>& keys,
                         const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts,
                         int64_t start = 0) const;
  // joint_attention: what each block adds to its layer's attention, from linked keys/values
  // [block][document] (see Linker), the documents of each batch row joined and the rows padded to
  // the longest. `anchor` (documents_after_prefix): the keys move from ending before position 0
  // to ending before position `anchor`, and prompt positions before it do not read them.
  // Documents linked int8 (Linker with keep_int8) come with their scales [block][document]
  // (undefined for a document of another dtype); empty: none.
  std::vector<JointKV> joint_kv(const PluginWeights& w, const std::vector<std::vector<at::Tensor>>& keys,
                                const std::vector<std::vector<at::Tensor>>& values,
                                const std::vector<int64_t>& doc_counts, int64_t anchor = 0,
                                const std::vector<std::vector<at::Tensor>>& key_scales = {},
                                const std::vector<std::vector<at::Tensor>>& value_scales = {}) const;
  // The path joint_kv takes without gradients on CPU (float32 or int8 entries): each key rotated
  // once, straight into place. nullopt where it does not apply (joint_kv's tensor ops then run).
  std::optional<std::vector<JointKV>> joint_kv_direct(const PluginWeights& w,
                                                      const std::vector<std::vector<at::Tensor>>& keys,
                                                      const std::vector<std::vector<at::Tensor>>& values,
                                                      const std::vector<int64_t>& doc_counts, int64_t anchor,
                                                      const std::vector<std::vector<at::Tensor>>& key_scales,
                                                      const std::vector<std::vector<at::Tensor>>& value_scales,
                                                      int64_t first_block = 0) const;  // keys[0] is this block's
  // The same on a CUDA device with a float16 or bfloat16 base: one launch joins every block (int8,
  // float32 or half entries, each key rotated once), the joined K/V in the base's dtype and the
  // biases float32, as a CUDA layer reads them. nullopt where it does not apply.
  std::optional<std::vector<JointKV>> joint_kv_cuda(const PluginWeights& w,
                                                    const std::vector<std::vector<at::Tensor>>& keys,
                                                    const std::vector<std::vector<at::Tensor>>& values,
                                                    const std::vector<int64_t>& doc_counts, int64_t anchor,
                                                    const std::vector<std::vector<at::Tensor>>& key_scales,
                                                    const std::vector<std::vector<at::Tensor>>& value_scales) const;
  // Where each linked document goes in its row's joined keys (documents keys [document], each
  // [n_head_kv, len, head_dim]): its row, offset and RoPE turn; lens: each row's joined length.
  struct JoinPlace {
    size_t doc;
    int64_t row, offset, angle;
  };
  std::vector<JoinPlace> join_places(const std::vector<at::Tensor>& keys, const std::vector<int64_t>& doc_counts,
                                     int64_t anchor, std::vector<int64_t>& lens) const;
  // Names and tensors of the plug-in, in the reference checkpoint's naming.
  std::vector<std::pair<std::string, at::Tensor>> named_tensors() const;
  void refresh_fingerprint();

 private:
  Plugin(PluginConfig config, PluginWeights weights, const Decoder& base);
  // Block k's K/V from encoder states s [n_docs, len, n_embd] of the documents' tokens: keys
  // [n_docs, n_head_kv, len, head_dim] (k_norm, RoPE at back_cos/back_sin when defined), values alike.
  std::pair<at::Tensor, at::Tensor> block_kv(const PluginWeights& w, int64_t k, const at::Tensor& s,
                                             const at::Tensor& back_cos, const at::Tensor& back_sin) const;
  // block_kv cut per document: keys and values [n_head_kv, lens[d], head_dim] of document d,
  // contiguous (as the store keeps them). Without gradients on the CPU (float32, kv_norm, no
  // k_norm): one pass that normalises the real rows only, two GEMMs, and writes each document's
  // keys turned back by RoPE and its values in place; otherwise block_kv's tensors cut and copied.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> documents_kv(const PluginWeights& w, int64_t k,
                                                                           const at::Tensor& s,
                                                                           const std::vector<int64_t>& lens,
                                                                           const at::Tensor& back_cos,
                                                                           const at::Tensor& back_sin) const;
  void check_document(const std::vector<int32_t>& tokens) const;
  // RoPE tables [n_docs, 1, len, head_dim] turning token j of document d (lens [n_docs]) to
  // position j - len_d; padding (j >= len_d) is not turned.
  std::pair<at::Tensor, at::Tensor> back_rope(const at::Tensor& lens, int64_t len) const;
  // The encoder's pass that encode_padded and encode_packed share: documents of `lens` tokens, each
  // block's K/V per document (`block(k)`: of the states so far) taken at the block's depth, before
  // the first encoder layer and after each step `layer(j)`.
  using BlockKV = std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>;
  std::vector<DocumentKV> encoder_pass(const std::vector<int64_t>& lens, const std::function<BlockKV(int64_t k)>& block,
                                       const std::function<void(int64_t j)>& layer) const;
  // encode_many's batches of `documents` (each checked first), each batch given to `encode`; the
  // documents' K/V in the order given. encode_many and encode_trainable share it.
  std::vector<DocumentKV> in_encoding_batches(
      const Decoder& base, const std::vector<std::vector<int32_t>>& documents,
      const std::function<std::vector<DocumentKV>(const std::vector<const std::vector<int32_t>*>&)>& encode) const;
  // One padded batch of documents ready for the base's cached forward: their lengths, embeddings
  // [n_docs, m, n_embd] (padding after each document), a cache holding the encoder prefix's
  // states, and (relative_positions) the turns back that end each document at -1.
  struct PaddedBatch {
    std::vector<int64_t> lens;
    at::Tensor h, back_cos, back_sin;
    KVCache cache;
  };
  PaddedBatch padded_batch(const Decoder& base, const std::vector<const std::vector<int32_t>*>& documents,
                           const KVCache& prefix_states) const;
  PluginConfig config_;
  PluginWeights weights_;
  ModelConfig base_config_;
  at::Tensor rope_cos_, rope_sin_;  // the base's tables [n_ctx, head_dim] (shared storage)
  std::string fingerprint_;
};

// How the decoder reads a request's linked documents through a plug-in: the LayerReads every forward
// takes (Model::forward, training's Decoder::hidden, the server's Decoder::step_paged). Before
// each layer with a block: a residual cross block (Plugin::cross_block) on the state, or, for a
// joint-attention plug-in, the block's keys read in the layer's own attention. The plug-in and
// the weights must outlive it.
class DocumentReads final : public LayerReads {
 public:
  // Residual blocks over linked K/V [block][document] (see Linker) and their requests' document
  // counts, with weights `w` (the plug-in's own, or training's).
  static DocumentReads residual(const Plugin& plugin, const PluginWeights& w, std::vector<std::vector<at::Tensor>> keys,
                                std::vector<std::vector<at::Tensor>> values, std::vector<int64_t> doc_counts);
  // The same over `linked` as it stands, with the plug-in's weights; nothing copied: `linked` must
  // outlive the reads (a decoding step builds one).
  static DocumentReads residual(const Plugin& plugin, const LinkedDocuments& linked);
  // Joint blocks reading joint[block] (Plugin::joint_kv). `paged`: read by a paged step
  // (segments()): each block's keys and values float32, contiguous, batch 1, and the blocks'
  // biases kept as float32 once here.
  static DocumentReads joined(const Plugin& plugin, std::vector<JointKV> joint, bool paged = false);
  // Joint blocks whose documents a paged step reads as linked, one segment a document (float32
  // [n_head_kv, len, head_dim], contiguous): documents neither anchored after a prefix nor
  // consecutive, whose keys need no turn.
  static DocumentReads segmented(const Plugin& plugin, std::vector<std::vector<at::Tensor>> keys,
                                 std::vector<std::vector<at::Tensor>> values);

  at::Tensor before(int64_t layer, const at::Tensor& x, int64_t start) const override;
  bool changes_state() const override { return mode_ == Mode::residual; }
  const JointKV* joint(int64_t layer) const override;
  JointSegments segments(int64_t layer) const override;
  bool segments_only() const override { return mode_ == Mode::segmented; }

 private:
  enum class Mode { residual, joined, segmented };
  DocumentReads(const Plugin& plugin, const PluginWeights& w, Mode mode, bool paged);
  const Plugin* plugin_;
  const PluginWeights* weights_;
  Mode mode_;
  const LinkedDocuments* linked_ = nullptr;             // residual over linked documents (not copied)
  std::vector<std::vector<at::Tensor>> keys_, values_;  // [block][document]: residual, segmented
  std::vector<int64_t> doc_counts_;                     // residual
  std::vector<JointKV> joint_;                          // joined: [block]
  std::vector<at::Tensor> bias_;  // paged joined, segmented: [block] float32 [n_head], or undefined
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/plugin.ipp"
#endif
