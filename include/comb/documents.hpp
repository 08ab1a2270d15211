#pragma once
// The one owner of a request's documents: comb::Documents renders a document's tokens, finds its
// cache in the store or computes it (and stores it): the plug-in's encoder K/V, or for the
// post-training methods (naive, EPIC, CacheBlend) the decoder's K/V of the document alone, at once
// or a piece at a time; it pins them in memory while a request reads them, and links a request's
// documents in its order for the decoder. The server, `comb generate`, `comb qa` and `comb eval`
// (through PicEngine) all go through it; Model knows no store.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comb/decoder.hpp"
#include "comb/plugin.hpp"
#include "comb/store.hpp"

namespace comb {

class Model;

// A document as a request names it: a title and its text.
struct QaDocument {
  std::string title, text;
};

// A document's cache being computed a piece at a time (Documents::begin).
struct DocumentWork {
  std::vector<int32_t> tokens;
  CacheKey key;
  bool decoder = false;                                // the decoder's K/V, else the encoder's
  int64_t done = 0;                                    // tokens computed so far
  std::optional<KVCache> cache;                        // the decoder's (or the encoder's) K/V so far
  std::vector<std::vector<at::Tensor>> keys, values;   // encoder: per block, the pieces' K/V
};

class Documents {
 public:
  // `store`: where document caches are kept and found (nullptr: none; each is encoded when asked).
  explicit Documents(const Model& model, std::shared_ptr<PICacheStore> store = nullptr);

  // A document as every prompt holds it, alone: "Title: <title>\n<text>\n\n" (a client that
  // sends the whole prompt as text, comb loadgen's, writes this).
  static std::string text(const QaDocument& document);
  // Its tokens (text() read as data: control tokens written in it stay text).
  std::vector<int32_t> tokens(const QaDocument& document) const;
  static std::vector<int32_t> tokens(const Model& model, const QaDocument& document);

  // The store's key of a document's encoder K/V (its tokens, the plug-in and weights, the tenant).
  CacheKey key(const std::vector<int32_t>& tokens, const std::string& tenant = "") const;
  // Documents' encoder K/V in order: from the store where it holds them, the others encoded
  // together (Plugin::encode_many, each once however often it is listed) and stored. `from_cache`,
  // if given, receives which came from the store.
  std::vector<std::shared_ptr<const DocumentKV>> get(const std::vector<std::vector<int32_t>>& documents,
                                                     const std::string& tenant = "",
                                                     std::vector<bool>* from_cache = nullptr) const;
  std::shared_ptr<const DocumentKV> get(const std::vector<int32_t>& tokens, const std::string& tenant = "",
                                        bool* from_cache = nullptr) const;
  // A request's documents and its prompt: get() and, where the plug-in allows
  // (Plugin::encodes_alongside) and a document is to be encoded, the prompt's `tokens` after
  // `cache` computed in the same pass (each layer's weights read once for the documents and the
  // prompt). `linked` receives the documents linked (link(), the joined keys built where the pass
  // computed them). Returns the prompt's logits when it was computed (`cache` advanced), else an
  // undefined tensor and the prompt is left to compute (Model::forward with `linked`). What is
  // stored, and read, is what get() stores.
  at::Tensor get_with_prompt(const std::vector<std::vector<int32_t>>& documents, const std::string& tenant,
                             std::vector<bool>* from_cache, const at::Tensor& tokens, KVCache& cache, int64_t anchor,
                             LinkedDocuments& linked, LogitsMode mode = LogitsMode::last) const;
  // Encoder K/V as a document cache keeps them: in the plug-in's cache dtype
  // (PluginConfig::cache_dtype) when there is no store or it keeps each entry as it comes
  // (StoreOptions::dtype Undefined, "auto"), else unchanged (the store converts). A request that
  // computes a document reads what a later request will read from the cache.
  DocumentKV cached_form(DocumentKV kv) const;
  // Stores a document's encoder K/V computed elsewhere (in pieces) under its key, in cached_form.
  std::shared_ptr<const DocumentKV> put(const CacheKey& key, DocumentKV kv) const;

  // A request's documents linked in its order for the decoder's blocks; `anchor`: the prompt
  // position they end at for a plug-in with documents_after_prefix (the instruction prefix's
  // length), else 0.
  LinkedDocuments link(const std::vector<std::shared_ptr<const DocumentKV>>& entries, int64_t anchor = 0) const;

  // The post-training methods' cache of a document (naive, EPIC, CacheBlend): the decoder's K/V of
  // the document computed alone from position 0 (blocks = layers), kept in the same store under
  // keys of their own. decoder_kv() finds it or computes and stores it; `computed`, if given,
  // receives which.
  CacheKey decoder_key(const std::vector<int32_t>& tokens, const std::string& tenant = "") const;
  std::shared_ptr<const DocumentKV> decoder_kv(const std::vector<int32_t>& tokens, const std::string& tenant = "",
                                               bool* computed = nullptr) const;
  // decoder_kv() of each piece of a request. `batched` (default: on a CUDA decoder, where one
  // forward costs what one piece's does): the missing ones computed together, packed in as few
  // forwards as Plugin::encoding_batches allows (Decoder::layer_packed: one for ten short documents,
  // one FlashAttention launch a layer on a CUDA half decoder, elsewhere or with COMB_CUDA_VARLEN=0
  // each piece's attention apart; a piece alone takes decoder_kv's path); else one after another,
  // as decoder_kv computes them. A piece given twice
  // is computed once when there is a store. `computed`, if given, receives which were computed.
  std::vector<std::shared_ptr<const DocumentKV>> decoder_kv_many(const std::vector<std::vector<int32_t>>& pieces,
                                                                 const std::string& tenant = "",
                                                                 std::vector<bool>* computed = nullptr,
                                                                 std::optional<bool> batched = std::nullopt) const;

  // A document's cache (`kind`: the plug-in's encoder K/V or the decoder's) computed a piece at a
  // time, so that a server runs other work between the pieces and a long document never holds
  // it: begin() is nullptr when the store has it; each advance() computes at most `max_tokens`
  // more and is true once the cache is computed and stored. An encoder other than the base's own
  // layers computes the whole document in its first piece.
  enum class Cache { encoder, decoder };
  std::unique_ptr<DocumentWork> begin(const std::vector<int32_t>& tokens, const std::string& tenant, Cache kind) const;
  // `forward` (the decoder's K/V only): the piece's forward done by the caller (decoder.hpp's
  // PieceForward, a server's decoding step), over the document's cache without reads.
  bool advance(DocumentWork& work, int64_t max_tokens, const PieceForward& forward = nullptr) const;

  // What a paged decoding step (Decoder::step_paged) reads of a request's `linked` documents, built
  // once a request, in float32 on the CPU: the rotated keys the prompt's forward joined (documents
  // after the prefix, or consecutive), else each document's K/V as linked (taken from `linked`,
  // int8 ones dequantized), or residual blocks over `linked` as it stands. `linked` must outlive
  // the reads.
  std::unique_ptr<DocumentReads> paged_reads(LinkedDocuments& linked) const;

  // Pins `key`'s entry in the store's memory while a request reads it (counted: the last unpin()
  // releases it). False, and nothing held, when no memory tier holds it.
  bool pin(const CacheKey& key) const;
  void unpin(const CacheKey& key) const;

  const Model& model() const { return model_; }
  // The store (nullptr: none).
  PICacheStore* store() const { return store_.get(); }
  const std::shared_ptr<PICacheStore>& shared_store() const { return store_; }

 private:
  // The store's entries of a request's documents (nullptr where it has none) and the documents to
  // encode, each once however often it is linked: source[i] is document i's index in `missing`,
  // -1 for an entry from the store.
  struct Lookup {
    std::vector<std::shared_ptr<const DocumentKV>> entries;
    std::vector<std::vector<int32_t>> missing;
    std::vector<int64_t> source;
  };
  Lookup look_up(const std::vector<std::vector<int32_t>>& documents, const std::string& tenant,
                 std::vector<bool>* from_cache) const;
  const Plugin& plugin() const;
  // The decoder over `tokens` [from, to) after the positions `cache` holds (made on the first
  // piece; through `forward` if given); the document's decoder K/V once `to` is its end, else nothing.
  std::optional<DocumentKV> decoder_piece(const std::vector<int32_t>& tokens, int64_t from, int64_t to,
                                          std::optional<KVCache>& cache, const PieceForward& forward = nullptr) const;
  // The dtype a document's entry is read back in: the store's (StoreOptions::dtype) where it sets
  // one, else the plug-in's cache dtype, else Undefined (as computed).
  c10::ScalarType kept_dtype() const;
  // New documents' K/V on a CUDA device turned to int8 in one pass where they are kept int8 (the
  // CPU's codes and scales bit for bit, so every tier holds the same entry whichever device made
  // it; two launches for the request instead of some thirty per document and block); otherwise
  // left for cached_form, one at a time.
  void quantize_on_device(std::vector<DocumentKV>& kvs) const;

  const Model& model_;
  std::shared_ptr<PICacheStore> store_;
  // Decoder-K/V entries share the store with encoder ones: a fingerprint of their own keeps them
  // apart (hashed from the weights on first use).
  mutable std::once_flag decoder_fingerprint_once_;
  mutable std::string decoder_fingerprint_;
  mutable std::mutex pins_mutex_;
  mutable std::map<std::pair<uint64_t, uint64_t>, int> pins_;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/documents.ipp"
#endif
