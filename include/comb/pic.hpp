#pragma once
// Position-independent caching methods in one engine, for comparison with COMB on the same work:
// full prefill, prefix caching, naive reuse, CacheBlend, EPIC, and COMB itself.
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "comb/documents.hpp"
#include "comb/model.hpp"
#include "comb/store.hpp"

namespace comb {

enum class Method { full, prefix, naive, cacheblend, epic, comb };
Method parse_method(const std::string& name);  // throws comb::Error on an unknown name
std::string method_name(Method method);

// A request in segments, each tokenized on its own, so that a document's tokens never depend on
// where it stands.
struct PicRequest {
  std::vector<int32_t> prefix;                   // chat header and instruction
  std::vector<std::vector<int32_t>> documents;   // each rendered alone
  std::vector<int32_t> suffix;                   // question and assistant header
  // Salt of every cache key this request reads or writes (documents and prefix blocks): requests
  // of different tenants share nothing. Empty: PicOptions::tenant.
  std::string tenant;
  std::vector<int32_t> tokens() const;           // all of it, in order: what `full` reads
};

struct PicOptions {
  // The two baselines' defaults are the settings their dev splits chose (docs/evaluation.md,
  // "The baselines' settings on dev splits": 0.3 on all three, k = 16 on two of three).
  double blend_ratio = 0.3;     // cacheblend: share of document tokens recomputed
  int64_t check_layer = 1;      // cacheblend: layer whose K deviation picks them
  int64_t epic_k = 16;          // epic: leading tokens recomputed per document
  int64_t prefix_block = 16;    // prefix: tokens per cached block
  // comb: the last N documents of a request go to the decoder as text, between the instruction
  // and the question, computed with the question on every request and reading the documents
  // linked before them; the others are linked through the plug-in (0, the default: every document
  // linked). A small recompute on top of COMB (docs/evaluation.md, "The last documents computed").
  int64_t comb_recompute_last = 0;
  // comb: those documents also linked through the plug-in (read twice: as text by the decoder's
  // own attention, and as every document is linked), instead of as text alone.
  bool comb_recompute_linked = false;
  int64_t cache_bytes = int64_t(4) << 30;  // budget of the document store / prefix cache
  // The document store's device tier on a CUDA device (-1: cache_bytes); smaller than what
  // requests read, the host tier behind it serves the rest (a benchmark of that tier).
  int64_t device_cache_bytes = -1;
  // Storage dtype of cached document K/V (every tier): float32, bfloat16, float16 or int8; or
  // Undefined ("auto", the default): each entry as computed (the decoder's dtype), a plug-in's
  // documents in its own cache dtype (PluginConfig::cache_dtype: int8 for the shipped one).
  c10::ScalarType cache_dtype = c10::ScalarType::Undefined;
  std::string tenant;           // salt of the store's keys
  // The document store's remote tier, shared with other processes (StoreOptions::remote_url):
  // "redis://HOST[:PORT][/DB]", or "" for none. clear() forgets the local tiers, not this one.
  std::string cache_url;
  int64_t cache_ttl_s = 0;      // expiry of the entries written there (0: none)
  // The document store these options describe (memory budget, dtype, remote tier) for a model on
  // `device`: on a CUDA device the caches are kept in its memory first (a device tier of
  // device_cache_bytes, else cache_bytes, read by requests without a copy), the least recently used
  // moved to a host tier of cache_bytes behind it; elsewhere the host tier alone.
  StoreOptions store_options(c10::Device device = c10::kCPU) const;
};

// Decoder K/V of whole token blocks, keyed by a hash chain over the tokens: reuse of an exact
// prefix. Blocks a running request holds (acquire() .. release()) are never evicted; of the others
// the least recently used go first, and within a chain its last blocks before its first.
class PrefixCache {
 public:
  PrefixCache(int64_t block_tokens, int64_t budget_bytes) : block_(block_tokens), budget_(budget_bytes) {}
  // The longest run of cached whole blocks at the start of `tokens`, referenced until release().
  // `salt` (a tenant) is hashed into every block's key: salts never share blocks.
  std::vector<uint64_t> acquire(const std::vector<int32_t>& tokens, const std::string& salt = "");
  void release(const std::vector<uint64_t>& blocks);
  // Copies the K/V of acquired `blocks` into `cache` at positions [0, blocks * block_tokens).
  void fill(const std::vector<uint64_t>& blocks, KVCache& cache) const;
  // Adds the whole blocks of tokens[0, n) that `cache` holds and the cache lacks (those it has
  // become the most recently used); evicts LRU unreferenced blocks past the budget.
  void insert(const std::vector<int32_t>& tokens, int64_t n, const KVCache& cache, const std::string& salt = "");
  int64_t block_tokens() const { return block_; }
  int64_t bytes() const { return bytes_; }
  int64_t n_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  void clear();

 private:
  struct Block {
    std::vector<at::Tensor> k, v;  // per layer: [batch 1, n_head_kv, block, head_dim]
    int64_t refs = 0;
    int64_t bytes = 0;
    std::list<uint64_t>::iterator lru;
  };
  std::vector<uint64_t> chain(const std::vector<int32_t>& tokens, int64_t n, const std::string& salt) const;
  void touch(const std::vector<uint64_t>& chain);
  void evict();
  int64_t block_, budget_, bytes_ = 0;
  std::unordered_map<uint64_t, Block> blocks_;
  std::list<uint64_t> lru_;  // front: most recent
};

// What a request cost: decoder positions, tokens computed now, tokens reused from a cache.
struct PicCounts {
  int64_t n_prompt = 0;
  int64_t computed = 0;
  int64_t reused = 0;
};

// The decoder's state after a request's prompt, ready to decode; or, between PicEngine::start()
// and the advance() that completes it, a prompt partly computed.
struct PicPrefill {
  KVCache cache;
  at::Tensor logits;          // [n_vocab] float: after the last prompt token (undefined until done)
  LinkedDocuments documents;  // comb: what the cross blocks read
  int64_t n_prompt = 0;       // decoder positions filled
  int64_t computed = 0;       // tokens that went through the model now (decoder and encoder)
  int64_t reused = 0;         // tokens whose K/V came from a cache
  // The decoder's tokens; positions [cache.length(), n_prompt) are still to compute.
  std::vector<int32_t> tokens;
  int64_t prefix_insert = 0;  // when done, the first this many go into the prefix cache
  std::string tenant;         // the salt of the prefix blocks inserted then
  bool done() const { return logits.defined(); }
  int64_t pending() const { return n_prompt - cache.length(); }
};

class PicEngine {
 public:
  PicEngine(const Model& model, Method method, PicOptions options = {});
  // Engines of several methods sharing one owner of documents (its store) and one prefix cache (a
  // server's): naive, EPIC and CacheBlend read the same decoder-K/V entries. options.cache_* are
  // then unused.
  PicEngine(const Model& model, Method method, PicOptions options, std::shared_ptr<Documents> documents,
            std::shared_ptr<PrefixCache> prefix);
  ~PicEngine();

  PicPrefill prefill(const PicRequest& request, int64_t max_new_tokens);
  // prefill() in steps, so that a server can run other work between them: start() does what
  // cannot be split (documents from the store or computed, reused K/V placed, EPIC's and
  // CacheBlend's recomputation) and leaves the rest of the prompt pending; each advance() computes
  // at most `max_tokens` more of it and is true once the prompt is complete (logits set). The
  // result is prefill()'s, up to the rounding of other matrix shapes.
  PicPrefill start(const PicRequest& request, int64_t max_new_tokens);
  bool advance(PicPrefill& prefill, int64_t max_tokens);
  // advance() with the piece's forward done by the caller (decoder.hpp's PieceForward: a server
  // computes it in its decoding step) over the prompt's cache and its documents' reads.
  bool advance(PicPrefill& prefill, int64_t max_tokens, const PieceForward& forward);
  // prefill() then decoding; `counts` receives the prefill's token counts if given.
  GenerationResult generate(const PicRequest& request, const GenerateOptions& options, PicCounts* counts = nullptr);
  // Forgets every cached document and prefix block.
  void clear();
  // One document's cache for this method (encoder K/V for comb, decoder K/V for naive, EPIC and
  // CacheBlend; none for full and prefix): found in the store, or computed now and stored (true).
  bool warm(const std::vector<int32_t>& document, const std::string& tenant);
  // warm() a piece at a time (Documents::begin and advance, this method's kind of cache):
  // begin_document() is nullptr when there is nothing to compute (the store has the cache, or the
  // method keeps none); each continue_document() computes at most `max_tokens` more of it and is
  // true once the cache is computed and stored.
  std::unique_ptr<DocumentWork> begin_document(const std::vector<int32_t>& document, const std::string& tenant);
  // `forward` (a decoder-K/V piece only, DocumentWork::decoder): the piece's forward done by the
  // caller, as advance()'s.
  bool continue_document(DocumentWork& work, int64_t max_tokens, const PieceForward& forward = nullptr);
  // The store's key of that cache.
  CacheKey document_key(const std::vector<int32_t>& document, const std::string& tenant) const;
  Method method() const { return method_; }
  PICacheStore& store() { return *documents_->store(); }
  // The owner of its documents' caches (the plug-in's encoder K/V and the post-training methods'
  // decoder K/V, in one store).
  Documents& documents() { return *documents_; }
  PrefixCache& prefix_cache() { return *prefix_; }
  // Bytes one cached document token takes for this method (0 for full).
  double cache_bytes_per_token() const;

 private:
  struct DocSpan {
    int64_t offset, length;
  };
  const std::string& tenant(const PicRequest& r) const { return r.tenant.empty() ? options_.tenant : r.tenant; }
  void fill_reused(const PicRequest& request, PicPrefill& out, std::vector<DocSpan>& spans);
  at::Tensor recompute(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions,
                       int64_t from_layer, at::Tensor hidden, PicPrefill& out);
  // One method each: `tokens` are the decoder's positions (for comb: the prompt without the
  // documents), `out` comes with an empty cache of the right size and receives the rest.
  void prefill_full(const std::vector<int32_t>& tokens, PicPrefill& out);
  void prefill_prefix(const std::vector<int32_t>& tokens, PicPrefill& out);
  void prefill_naive(const PicRequest& request, const std::vector<int32_t>& tokens, PicPrefill& out);
  void prefill_epic(const PicRequest& request, const std::vector<int32_t>& tokens, PicPrefill& out);
  void prefill_cacheblend(const PicRequest& request, const std::vector<int32_t>& tokens, PicPrefill& out);
  void prefill_comb(const PicRequest& request, const std::vector<int32_t>& tokens, PicPrefill& out);
  // CacheBlend's selection: the document positions whose keys at the check layer deviate most from
  // a fresh computation (blend_ratio of them), then every position after the documents.
  std::vector<int64_t> cacheblend_selection(const at::Tensor& hidden, const at::Tensor& positions,
                                            const std::vector<DocSpan>& spans, int64_t n_context, int64_t n,
                                            const PicPrefill& out) const;

  const Model& model_;
  Method method_;
  PicOptions options_;
  std::shared_ptr<Documents> documents_;
  std::shared_ptr<PrefixCache> prefix_;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/pic.ipp"
#endif
