// Position-independent caching methods (full, prefix, naive, CacheBlend, EPIC, COMB) in one engine.
// Compiled into libcomb (src/pic.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "comb/detail/decode_step.hpp"
#include "comb/error.hpp"
#include "comb/pic.hpp"

namespace comb {

COMB_INLINE Method parse_method(const std::string& name) {
  static const std::pair<const char*, Method> table[] = {{"full", Method::full},     {"prefix", Method::prefix},
                                                         {"naive", Method::naive},   {"cacheblend", Method::cacheblend},
                                                         {"epic", Method::epic},     {"comb", Method::comb}};
  for (auto& [n, m] : table)
    if (name == n) return m;
  COMB_FAIL("unknown method '{}' (expected full, prefix, naive, cacheblend, epic or comb)", name);
}

COMB_INLINE std::string method_name(Method m) {
  switch (m) {
    case Method::full: return "full";
    case Method::prefix: return "prefix";
    case Method::naive: return "naive";
    case Method::cacheblend: return "cacheblend";
    case Method::epic: return "epic";
    case Method::comb: return "comb";
  }
  return "?";
}



COMB_INLINE StoreOptions PicOptions::store_options(c10::Device device) const {
  StoreOptions store;
  store.host_bytes = cache_bytes;
  if (device.is_cuda()) {
    store.device = device;
    store.device_bytes = device_cache_bytes >= 0 ? device_cache_bytes : cache_bytes;
    static const bool pinned = [] {
      const char* v = std::getenv("COMB_CUDA_PINNED_HOST");
      return v != nullptr && std::strcmp(v, "1") == 0;
    }();
    store.pinned_host = pinned;
  }
  store.dtype = cache_dtype;
  store.remote_url = cache_url;
  store.remote_ttl_s = cache_ttl_s;
  return store;
}

COMB_INLINE std::vector<int32_t> PicRequest::tokens() const {
  std::vector<int32_t> out = prefix;
  for (const auto& d : documents) out.insert(out.end(), d.begin(), d.end());
  out.insert(out.end(), suffix.begin(), suffix.end());
  return out;
}


// ================================================================================================
// PrefixCache
// ================================================================================================

COMB_INLINE std::vector<uint64_t> PrefixCache::chain(const std::vector<int32_t>& tokens, int64_t n,
                                                   const std::string& salt) const {
  std::vector<uint64_t> out;
  uint64_t h = 0x636f6d62;  // any fixed seed, turned by the salt
  if (!salt.empty()) h = XXH3_64bits_withSeed(salt.data(), salt.size(), h);
  for (int64_t b = 0; (b + 1) * block_ <= n; ++b) {
    h = XXH3_64bits_withSeed(tokens.data() + b * block_, block_ * sizeof(int32_t), h);
    out.push_back(h);
  }
  return out;
}

COMB_INLINE std::vector<uint64_t> PrefixCache::acquire(const std::vector<int32_t>& tokens, const std::string& salt) {
  std::vector<uint64_t> out;
  for (uint64_t h : chain(tokens, static_cast<int64_t>(tokens.size()), salt)) {
    auto it = blocks_.find(h);
    if (it == blocks_.end()) break;
    ++it->second.refs;
    out.push_back(h);
  }
  touch(out);
  return out;
}

// Makes a chain's blocks the most recently used, its first block the most recent of all: a chain
// then loses its tail first, and what stays of it is still a prefix that can be matched (a chain
// whose first block went would keep its other blocks in memory with no way to reach them).
COMB_INLINE void PrefixCache::touch(const std::vector<uint64_t>& chain) {
  for (auto h = chain.rbegin(); h != chain.rend(); ++h) {
    Block& block = blocks_.at(*h);
    lru_.erase(block.lru);
    lru_.push_front(*h);
    block.lru = lru_.begin();
  }
}

COMB_INLINE void PrefixCache::release(const std::vector<uint64_t>& blocks) {
  for (uint64_t h : blocks) {
    auto it = blocks_.find(h);
    COMB_CHECK(it != blocks_.end() && it->second.refs > 0, "prefix cache: releasing a block not held");
    --it->second.refs;
  }
  evict();
}

namespace detail::pic {
// Copies K/V pieces (`parts`: contiguous [n_head_kv, len, head_dim] of the cache's dtype and
// device, each for the layer `block` at positions [offset, offset + len)) into a one-sequence CUDA
// bfloat16/float16 cache in one join_documents launch: the RoPE angle 0 (cos 1, sin 0), which
// copies finite keys and values exactly. False, and nothing copied, where that launch does not
// apply (no CUDA ops, another cache or dtype).
COMB_INLINE bool copy_in_one_launch(const std::vector<JoinPart>& parts, KVCache& cache) {
  const CudaLayerOps* ops = cuda_layer_ops();
  const at::Tensor& k0 = cache.keys(0);
  const auto t = k0.scalar_type();
  if (parts.empty() || !ops || !ops->join_documents || !k0.is_cuda() || cache.batch() != 1 ||
      (t != at::kBFloat16 && t != at::kHalf))
    return false;
  std::vector<at::Tensor> keys, values;
  for (int64_t l = 0; l < cache.n_layers(); ++l) {
    if (!cache.keys(l).is_contiguous() || !cache.values(l).is_contiguous()) return false;
    keys.push_back(cache.keys(l));
    values.push_back(cache.values(l));
  }
  for (const auto& p : parts)
    if (p.block < 0 || p.block >= cache.n_layers() || p.keys.device() != k0.device() || p.keys.scalar_type() != t)
      return false;
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(k0.device());
  ops->join_documents(parts, keys, values, at::ones({1, k0.size(3)}, f32), at::zeros({1, k0.size(3)}, f32));
  return true;
}
}  // namespace detail::pic

COMB_INLINE void PrefixCache::fill(const std::vector<uint64_t>& blocks, KVCache& cache) const {
  RECORD_FUNCTION("comb::prefix_fill", std::vector<c10::IValue>());
  // On a CUDA half cache every block of every layer in one launch, not a copy per block and layer.
  bool every_layer = !blocks.empty() && cache.keys(0).is_cuda();
  for (size_t b = 0; every_layer && b < blocks.size(); ++b)
    every_layer = static_cast<int64_t>(blocks_.at(blocks[b]).k.size()) == cache.n_layers();
  if (every_layer) {
    std::vector<detail::JoinPart> parts;
    for (int64_t l = 0; l < cache.n_layers(); ++l)
      for (size_t b = 0; b < blocks.size(); ++b) {
        const Block& block = blocks_.at(blocks[b]);
        detail::JoinPart part;
        part.block = l, part.offset = static_cast<int64_t>(b) * block_;
        part.keys = block.k[static_cast<size_t>(l)][0].contiguous();  // [n_head_kv, block, head_dim]
        part.values = block.v[static_cast<size_t>(l)][0].contiguous();
        parts.push_back(std::move(part));
      }
    if (detail::pic::copy_in_one_launch(parts, cache)) return;
  }
  for (size_t b = 0; b < blocks.size(); ++b) {
    const Block& block = blocks_.at(blocks[b]);
    for (size_t l = 0; l < block.k.size(); ++l)
      cache.write(static_cast<int64_t>(l), static_cast<int64_t>(b) * block_, block.k[l], block.v[l]);
  }
}

COMB_INLINE void PrefixCache::insert(const std::vector<int32_t>& tokens, int64_t n, const KVCache& cache,
                                     const std::string& salt) {
  COMB_CHECK(cache.batch() == 1, "prefix cache: one sequence at a time, found a batch of {}", cache.batch());
  COMB_CHECK(n >= 0 && n <= static_cast<int64_t>(tokens.size()), "prefix cache: insert of {} tokens from a list of {}",
             n, tokens.size());
  auto hashes = chain(tokens, std::min<int64_t>(n, cache.length()), salt);
  // On a CUDA device without gradients, each new block is one allocation [n_layer, 2, n_head_kv,
  // block, head_dim] whose layers' keys and values are views, every new block's rows of a layer
  // copied in one launch (split_documents, a block for a document and a layer for its block):
  // n_layer launches where a copy a block, layer, keys and values would be 4 n_layer a block.
  const detail::CudaLayerOps* ops = cache.keys(0).is_cuda() && !c10::GradMode::is_enabled() ? detail::cuda_layer_ops()
                                                                                           : nullptr;
  std::vector<at::Tensor> whole(hashes.size());  // by block index; defined on that path
  if (ops && ops->split_documents) {
    const at::Tensor& k0 = cache.keys(0);
    std::vector<std::array<int64_t, 3>> rows;
    std::vector<at::Tensor> outs;
    for (size_t b = 0; b < hashes.size(); ++b) {
      if (blocks_.count(hashes[b])) continue;
      rows.push_back({0, static_cast<int64_t>(b) * block_, block_});
      whole[b] = at::empty({cache.n_layers(), 2, k0.size(1), block_, k0.size(3)}, k0.options());
      outs.push_back(whole[b]);
    }
    if (!rows.empty())
      for (int64_t l = 0; l < cache.n_layers(); ++l)
        ops->split_documents(cache.keys(l), cache.values(l), rows, outs, l);
  }
  for (size_t b = 0; b < hashes.size(); ++b) {
    if (blocks_.count(hashes[b])) continue;  // used again: touched below
    Block block;
    for (int64_t l = 0; l < cache.n_layers(); ++l) {
      if (whole[b].defined()) {  // views [1, n_head_kv, block, head_dim] of the block's allocation
        const at::Tensor& w = whole[b];
        const int64_t each = w.size(2) * w.size(3) * w.size(4);
        const std::vector<int64_t> sizes{1, w.size(2), w.size(3), w.size(4)};
        const std::vector<int64_t> strides{each, w.size(3) * w.size(4), w.size(4), 1};
        block.k.push_back(w.as_strided(sizes, strides, w.storage_offset() + 2 * l * each));
        block.v.push_back(w.as_strided(sizes, strides, w.storage_offset() + (2 * l + 1) * each));
      } else {
        block.k.push_back(cache.keys(l).narrow(2, static_cast<int64_t>(b) * block_, block_).clone());
        block.v.push_back(cache.values(l).narrow(2, static_cast<int64_t>(b) * block_, block_).clone());
      }
      block.bytes += 2 * block.k.back().numel() * block.k.back().element_size();
    }
    // Map, then LRU list, then byte count, each step undone if the next throws, so that every
    // listed block exists and bytes_ counts exactly the blocks held. The block goes right behind the
    // one before it (the first block at the front): a chain's first block stays ahead of its last
    // even if a later copy fails; touch() below then makes the chain the most recent.
    auto slot = blocks_.emplace(hashes[b], std::move(block)).first;
    try {
      slot->second.lru = lru_.insert(b == 0 ? lru_.begin() : std::next(blocks_.at(hashes[b - 1]).lru), hashes[b]);
    } catch (...) {
      blocks_.erase(slot);
      throw;
    }
    bytes_ += slot->second.bytes;
  }
  touch(hashes);
  evict();
}

COMB_INLINE void PrefixCache::evict() {
  auto it = lru_.end();
  while (bytes_ > budget_ && it != lru_.begin()) {
    --it;
    auto& block = blocks_.at(*it);
    if (block.refs > 0) continue;
    bytes_ -= block.bytes;
    blocks_.erase(*it);
    it = lru_.erase(it);
  }
}

COMB_INLINE void PrefixCache::clear() {
  for (const auto& [h, b] : blocks_) COMB_CHECK(b.refs == 0, "prefix cache: clear() while a request holds blocks");
  blocks_.clear();
  lru_.clear();
  bytes_ = 0;
}

// ================================================================================================
// PicEngine
// ================================================================================================

COMB_INLINE PicEngine::PicEngine(const Model& model, Method method, PicOptions options)
    : PicEngine(model, method, options, nullptr, nullptr) {}

COMB_INLINE PicEngine::PicEngine(const Model& model, Method method, PicOptions options,
                                 std::shared_ptr<Documents> shared_documents, std::shared_ptr<PrefixCache> shared_prefix)
    : model_(model), method_(method), options_(std::move(options)) {
  COMB_CHECK(options_.blend_ratio >= 0 && options_.blend_ratio <= 1, "CacheBlend ratio must be in [0, 1], found {}",
             options_.blend_ratio);
  // Layer 0's keys depend on the token and its position alone: reused ones equal fresh ones there,
  // so the first layer with a deviation to rank is 1.
  COMB_CHECK(method != Method::cacheblend || (options_.check_layer >= 1 && options_.check_layer < model.config().n_layer),
             "CacheBlend check layer must be in [1, {}) (layer 0's keys do not depend on the context), found {}",
             model.config().n_layer, options_.check_layer);
  COMB_CHECK(options_.epic_k >= 0, "EPIC k must be >= 0, found {}", options_.epic_k);
  COMB_CHECK(options_.prefix_block > 0, "prefix block must be > 0, found {}", options_.prefix_block);
  COMB_CHECK(options_.comb_recompute_last >= 0, "comb's recomputed last documents must be >= 0, found {}",
             options_.comb_recompute_last);
  if (method == Method::comb) COMB_CHECK(model.plugin(), "--method comb needs a plug-in (--plugin FILE; the default model has a shipped one)");
  documents_ = shared_documents ? std::move(shared_documents)
                                : std::make_shared<Documents>(model, std::make_shared<PICacheStore>(
                                                                     options_.store_options(model.decoder().device())));
  COMB_CHECK(documents_->store(), "a PicEngine keeps its documents' caches in a store: give Documents one");
  prefix_ = shared_prefix ? std::move(shared_prefix)
                          : std::make_shared<PrefixCache>(options_.prefix_block, options_.cache_bytes);
}

COMB_INLINE PicEngine::~PicEngine() = default;

COMB_INLINE void PicEngine::clear() {
  // The old store's queued disk writes made first: the new one, over the same directory, then
  // counts every file in its budget.
  documents_->store()->flush();
  documents_ = std::make_shared<Documents>(model_, std::make_shared<PICacheStore>(documents_->store()->options()));
  prefix_->clear();
}

COMB_INLINE double PicEngine::cache_bytes_per_token() const {
  const auto& c = model_.config();
  // Per token of a document of `typical` tokens (int8: scales included; keys' per channel are per document).
  constexpr int64_t typical = 128;
  // "auto": each entry as computed (the decoder's dtype), a plug-in's documents in its cache dtype.
  auto per_token = [&](int64_t blocks, c10::ScalarType as_computed) {
    const c10::ScalarType dtype =
        options_.cache_dtype == c10::ScalarType::Undefined ? as_computed : options_.cache_dtype;
    return double(DocumentKV::storage_bytes(dtype, blocks, c.n_head_kv, c.head_dim, typical)) / typical;
  };
  const c10::ScalarType decoder_dtype = model_.decoder().dtype();
  switch (method_) {
    case Method::full: return 0;
    case Method::comb: {
      const std::string& d = model_.plugin()->config().cache_dtype;
      return per_token(model_.plugin()->config().n_blocks(), d.empty() ? decoder_dtype : parse_cache_dtype(d));
    }
    case Method::prefix: return 2.0 * c.n_layer * c.kv_dim() * c10::elementSize(model_.decoder().dtype());
    default: return per_token(c.n_layer, decoder_dtype);
  }
}

COMB_INLINE CacheKey PicEngine::document_key(const std::vector<int32_t>& document, const std::string& tenant) const {
  return method_ == Method::comb ? documents_->key(document, tenant) : documents_->decoder_key(document, tenant);
}

COMB_INLINE bool PicEngine::warm(const std::vector<int32_t>& document, const std::string& tenant) {
  c10::InferenceMode guard;
  COMB_CHECK(!document.empty(), "an empty document has no cache");
  bool computed = false;
  switch (method_) {
    case Method::full:
    case Method::prefix: return false;  // no per-document cache
    case Method::comb: {
      bool cached = false;
      documents_->get(document, tenant, &cached);
      return !cached;
    }
    default: documents_->decoder_kv(document, tenant, &computed); return computed;
  }
}

COMB_INLINE std::unique_ptr<DocumentWork> PicEngine::begin_document(const std::vector<int32_t>& document,
                                                                    const std::string& tenant) {
  COMB_CHECK(!document.empty(), "an empty document has no cache");
  if (method_ == Method::full || method_ == Method::prefix) return nullptr;  // no per-document cache
  return documents_->begin(document, tenant, method_ == Method::comb ? Documents::Cache::encoder : Documents::Cache::decoder);
}

COMB_INLINE bool PicEngine::continue_document(DocumentWork& w, int64_t max_tokens, const PieceForward& forward) {
  return documents_->advance(w, max_tokens, forward);
}

// Fills the cache with the prefix and every document reused as is (naive), each document's keys
// rotated from positions [0, len) to where it stands. spans: where each document landed.
COMB_INLINE void PicEngine::fill_reused(const PicRequest& r, PicPrefill& out, std::vector<DocSpan>& spans) {
  RECORD_FUNCTION("comb::fill_reused", std::vector<c10::IValue>());
  const Decoder& dec = model_.decoder();
  // On a CUDA half decoder, every piece's K/V of every layer placed in one launch (each key turned
  // to its position in float32, rounded once), read as the store holds them (int8 or half, on the
  // device); elsewhere one Decoder::place per piece and layer.
  const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
  const bool joined = ops && ops->join_documents && dec.cuda_kernels_apply(out.cache);
  std::vector<detail::JoinPart> parts;
  int64_t pos = 0;
  // Every piece's K/V first (the missing ones computed together on a GPU), then placed in order.
  std::vector<std::vector<int32_t>> pieces;
  if (!r.prefix.empty()) pieces.push_back(r.prefix);
  pieces.insert(pieces.end(), r.documents.begin(), r.documents.end());
  std::vector<bool> computed_pieces;
  const auto kvs = documents_->decoder_kv_many(pieces, out.tenant, &computed_pieces);
  auto place = [&](size_t piece, bool is_document) {
    const bool computed = computed_pieces[piece];
    auto kv = kvs[piece];
    const int64_t n = static_cast<int64_t>(pieces[piece].size());
    (computed ? out.computed : out.reused) += n;
    if (joined) {
      // As stored where the kernel reads it (int8, float32 or the decoder's dtype on its device; int4
      // as its int8 codes); else one conversion (a host-tier entry: one copy).
      if (DocumentKV::packs_int4(kv->dtype())) kv = std::make_shared<const DocumentKV>(kv->int8_codes());
      const c10::ScalarType t = kv->keys[0].scalar_type();
      const bool int8 = kv->quantized() && kv->key_scales[0].scalar_type() == at::kHalf &&
                        kv->value_scales[0].scalar_type() == at::kHalf;  // float32 scales: older entries
      const bool readable = int8 || (!kv->quantized() && (t == at::kFloat || t == dec.dtype()));
      if (kv->keys[0].device() != dec.device() || !readable)
        kv = std::make_shared<const DocumentKV>(kv->to(dec.device(), readable ? (int8 ? at::kChar : t) : dec.dtype()));
      for (int64_t l = 0; l < out.cache.n_layers(); ++l) {
        detail::JoinPart part;
        part.block = l, part.offset = pos, part.angle = pos;
        part.keys = kv->keys[l].contiguous(), part.values = kv->values[l].contiguous();
        if (kv->quantized()) part.key_scales = kv->key_scales[l], part.value_scales = kv->value_scales[l];
        parts.push_back(std::move(part));
      }
    } else {
      if (kv->quantized()) kv = std::make_shared<const DocumentKV>(kv->to(dec.device(), dec.dtype()));
      for (int64_t l = 0; l < out.cache.n_layers(); ++l) {
        dec.place(l, out.cache, pos, kv->keys[l].to(dec.device(), dec.dtype()).unsqueeze(0),
                  kv->values[l].to(dec.device(), dec.dtype()).unsqueeze(0));
      }
    }
    if (is_document) spans.push_back({pos, n});
    pos += n;
  };
  for (size_t i = 0; i < pieces.size(); ++i) place(i, r.prefix.empty() || i > 0);
  COMB_CHECK(pos <= out.cache.capacity(), "the reused pieces fill {} positions of a cache of {}", pos,
             out.cache.capacity());
  if (!parts.empty()) {
    std::vector<at::Tensor> keys, values;
    for (int64_t l = 0; l < out.cache.n_layers(); ++l) keys.push_back(out.cache.keys(l)), values.push_back(out.cache.values(l));
    const int64_t turns = std::max<int64_t>(pos, 1);  // the angles used: [0, pos)
    ops->join_documents(parts, keys, values, dec.rope_cos().narrow(0, 0, turns).to(at::kFloat).contiguous(),
                        dec.rope_sin().narrow(0, 0, turns).to(at::kFloat).contiguous());
  }
  out.cache.set_length(pos);
}

// Runs the tokens at `positions` (increasing) from layer `from_layer` on, given their hidden
// state there (or embeddings when undefined); returns the logits of the last of them.
COMB_INLINE at::Tensor PicEngine::recompute(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions,
                                int64_t from_layer, at::Tensor hidden, PicPrefill& out) {
  const Decoder& dec = model_.decoder();
  const int64_t n_keys = static_cast<int64_t>(tokens.size());
  at::Tensor pos = at::tensor(positions, at::kLong);
  if (!hidden.defined()) hidden = dec.embed(token_ids(tokens, 0, n_keys).index_select(1, pos));
  for (int64_t i = from_layer; i < dec.config().n_layer; ++i) hidden = dec.layer_at(i, hidden, pos, out.cache, n_keys);
  out.cache.set_length(n_keys);
  return dec.logits(hidden, LogitsMode::last)[0][-1];
}

namespace detail::pic {  // this file's own helpers
// Prefix-cache blocks a request reads, held until it is done with them, failure included: a block
// left referenced could never be evicted.
struct HeldBlocks {
  PrefixCache& cache;
  std::vector<uint64_t> blocks;
  ~HeldBlocks() {
    try {
      if (!blocks.empty()) cache.release(blocks);
    } catch (...) {  // release() throws only for blocks not held, which acquire() rules out
    }
  }
};
}  // namespace detail::pic

COMB_INLINE PicPrefill PicEngine::prefill(const PicRequest& r, int64_t max_new_tokens) {
  PicPrefill out = start(r, max_new_tokens);
  advance(out, out.pending());
  return out;
}

COMB_INLINE bool PicEngine::advance(PicPrefill& out, int64_t max_tokens) {
  return advance(out, max_tokens, nullptr);
}

COMB_INLINE bool PicEngine::advance(PicPrefill& out, int64_t max_tokens, const PieceForward& forward) {
  if (out.done()) return true;
  COMB_CHECK(max_tokens > 0 || out.pending() == 0, "advance() by {} tokens", max_tokens);
  c10::InferenceMode guard;
  const int64_t from = out.cache.length(), to = std::min(out.n_prompt, from + std::max<int64_t>(max_tokens, 1));
  const at::Tensor tokens = token_ids(out.tokens, from, to);
  at::Tensor logits;
  if (!forward) {
    logits = model_.forward(tokens, out.cache, out.documents.empty() ? nullptr : &out.documents);
  } else {
    const std::unique_ptr<DocumentReads> reads =
        out.documents.empty() ? nullptr : model_.document_reads(out.documents, 1);
    logits = forward(tokens, out.cache, reads.get());
    COMB_CHECK(out.cache.length() == to && logits.dim() == 3 && logits.size(0) == 1,
               "a piece's forward should advance the prompt's cache to {} and return logits [1, n, n_vocab]; found "
               "the cache at {} and logits [{}]", to, out.cache.length(), fmt::join(logits.sizes(), ", "));
  }
  out.computed += to - from;
  if (to < out.n_prompt) return false;
  out.logits = logits[0][-1];
  if (out.prefix_insert > 0) prefix_->insert(out.tokens, out.prefix_insert, out.cache, out.tenant);
  return true;
}

COMB_INLINE PicPrefill PicEngine::start(const PicRequest& r, int64_t max_new_tokens) {
  c10::InferenceMode guard;
  const Decoder& dec = model_.decoder();
  const auto& c = dec.config();
  const bool comb = method_ == Method::comb;
  // comb: the documents the plug-in links, and the last comb_recompute_last given to the decoder
  // as text after the prefix (where the linked ones end), computed with the question; linked as
  // well with comb_recompute_linked.
  const size_t n_text = comb ? static_cast<size_t>(std::min<int64_t>(options_.comb_recompute_last,
                                                                     static_cast<int64_t>(r.documents.size())))
                             : 0;
  const bool trim = n_text > 0 && !options_.comb_recompute_linked;
  PicRequest trimmed;
  if (trim) {
    trimmed = r;
    trimmed.documents.resize(r.documents.size() - n_text);
  }
  const PicRequest& linked = trim ? trimmed : r;
  std::vector<int32_t> decoder_tokens = comb ? r.prefix : r.tokens();
  if (comb) {
    for (size_t d = r.documents.size() - n_text; d < r.documents.size(); ++d)
      decoder_tokens.insert(decoder_tokens.end(), r.documents[d].begin(), r.documents[d].end());
    decoder_tokens.insert(decoder_tokens.end(), r.suffix.begin(), r.suffix.end());
  }
  const int64_t n = static_cast<int64_t>(decoder_tokens.size());
  COMB_CHECK(!r.suffix.empty(), "a request needs a question (its suffix is empty)");
  for (size_t d = 0; d < r.documents.size(); ++d) COMB_CHECK(!r.documents[d].empty(), "document {} is empty", d);
  COMB_CHECK(n < c.n_ctx, "the request has {} tokens but the model's context holds {}", n, c.n_ctx);
  PicPrefill out{dec.make_cache(1, std::min<int64_t>(c.n_ctx, n + std::max<int64_t>(max_new_tokens, 1))), {}, {}, n,
                 0, 0, decoder_tokens, 0, tenant(r)};
  switch (method_) {
    case Method::full: prefill_full(decoder_tokens, out); break;
    case Method::prefix: prefill_prefix(decoder_tokens, out); break;
    case Method::naive: prefill_naive(r, decoder_tokens, out); break;
    case Method::epic: prefill_epic(r, decoder_tokens, out); break;
    case Method::cacheblend: prefill_cacheblend(r, decoder_tokens, out); break;
    case Method::comb: prefill_comb(linked, decoder_tokens, out); break;
  }
  return out;
}

// Everything computed, nothing cached.
COMB_INLINE void PicEngine::prefill_full(const std::vector<int32_t>&, PicPrefill&) {}  // all pending

// The longest run of whole cached blocks that begins the prompt (copied, then let go), then the
// rest computed (at least one token; pending) and its whole blocks cached when done.
COMB_INLINE void PicEngine::prefill_prefix(const std::vector<int32_t>& tokens, PicPrefill& out) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  detail::pic::HeldBlocks held{*prefix_, prefix_->acquire(tokens, out.tenant)};
  while (!held.blocks.empty() && static_cast<int64_t>(held.blocks.size()) * prefix_->block_tokens() >= n) {
    prefix_->release({held.blocks.back()});  // keep at least one token to compute
    held.blocks.pop_back();
  }
  const int64_t m = static_cast<int64_t>(held.blocks.size()) * prefix_->block_tokens();
  prefix_->fill(held.blocks, out.cache);
  out.cache.set_length(m);
  out.prefix_insert = n;
  out.reused = m;
}

// Each document's K/V as cached (computed alone from position 0), moved to its place; the question
// computed after them.
COMB_INLINE void PicEngine::prefill_naive(const PicRequest& r, const std::vector<int32_t>&, PicPrefill& out) {
  std::vector<DocSpan> spans;
  fill_reused(r, out, spans);  // the question pending
}

// As naive, and the first epic_k tokens of every document not at position 0 recomputed.
COMB_INLINE void PicEngine::prefill_epic(const PicRequest& r, const std::vector<int32_t>& tokens, PicPrefill& out) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<DocSpan> spans;
  fill_reused(r, out, spans);
  std::vector<int64_t> positions;
  for (const auto& s : spans)
    // EPIC spares the first chunk, whose K/V are exact: a document at position 0. With a prompt
    // prefix (the eval's instruction), the prefix is that chunk and every document is recomputed.
    if (s.offset > 0)
      for (int64_t i = 0; i < std::min(options_.epic_k, s.length); ++i) positions.push_back(s.offset + i);
  for (int64_t p = out.cache.length(); p < n; ++p) positions.push_back(p);
  out.logits = recompute(tokens, positions, 0, {}, out);
  out.computed += static_cast<int64_t>(positions.size());
}

// As naive; every token runs the layers up to the check layer, and from there only the selected
// ones (cacheblend_selection) are recomputed.
COMB_INLINE void PicEngine::prefill_cacheblend(const PicRequest& r, const std::vector<int32_t>& tokens, PicPrefill& out) {
  const Decoder& dec = model_.decoder();
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<DocSpan> spans;
  fill_reused(r, out, spans);
  const int64_t n_context = out.cache.length();
  // Every token runs the layers before the check layer (their K/V replace the reused ones there).
  at::Tensor pos = at::arange(n, at::kLong);
  at::Tensor hidden = dec.embed(token_ids(tokens, 0, n));
  for (int64_t i = 0; i < options_.check_layer; ++i) hidden = dec.layer_at(i, hidden, pos, out.cache, n);
  std::vector<int64_t> chosen = cacheblend_selection(hidden, pos, spans, n_context, n, out);
  at::Tensor chosen_pos = detail::upload(at::tensor(chosen, at::kLong), dec.device());
  out.logits = recompute(tokens, chosen, options_.check_layer, hidden.index_select(1, chosen_pos), out);
  out.computed += static_cast<int64_t>(chosen.size());
}

COMB_INLINE std::vector<int64_t> PicEngine::cacheblend_selection(const at::Tensor& hidden, const at::Tensor& pos,
                                                     const std::vector<DocSpan>& spans, int64_t n_context, int64_t n,
                                                     const PicPrefill& out) const {
  const Decoder& dec = model_.decoder();
  at::Tensor fresh = dec.keys_at(options_.check_layer, hidden.narrow(1, 0, n_context), pos.narrow(0, 0, n_context));
  at::Tensor reused = out.cache.keys(options_.check_layer).narrow(2, 0, n_context).to(fresh.scalar_type());
  at::Tensor deviation = (fresh - reused).to(at::kFloat).pow(2).sum({0, 1, 3}).cpu();  // [n_context]
  std::vector<int64_t> doc_positions;
  for (const auto& s : spans)
    for (int64_t i = 0; i < s.length; ++i) doc_positions.push_back(s.offset + i);
  const int64_t pick = static_cast<int64_t>(std::ceil(options_.blend_ratio * double(doc_positions.size())));
  std::vector<int64_t> chosen;
  if (pick > 0) {
    at::Tensor candidates = at::tensor(doc_positions, at::kLong);
    at::Tensor top = std::get<1>(deviation.index_select(0, candidates).topk(pick));
    at::Tensor picked = candidates.index_select(0, top);
    chosen.assign(picked.data_ptr<int64_t>(), picked.data_ptr<int64_t>() + picked.numel());
  }
  for (int64_t p = n_context; p < n; ++p) chosen.push_back(p);
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

// The documents through the plug-in's encoder (or from the store), linked for the cross blocks;
// the decoder computes the prompt without them (its instruction prefix from the prefix cache when
// the plug-in reads documents only after it).
COMB_INLINE void PicEngine::prefill_comb(const PicRequest& r, const std::vector<int32_t>&, PicPrefill& out) {
  RECORD_FUNCTION("comb::prefill_comb", std::vector<c10::IValue>());
  const Plugin& plugin = *model_.plugin();
  int64_t anchor = 0;
  if (plugin.config().documents_after_prefix) {
    // The instruction prefix reads no document: its K/V are the bare decoder's, so its whole
    // blocks come from the prefix cache and a warm request computes the question alone.
    const int64_t p = static_cast<int64_t>(r.prefix.size());
    anchor = p;
    out.prefix_insert = p;  // the prefix is the first p of the decoder's tokens
    detail::pic::HeldBlocks held{*prefix_, prefix_->acquire(r.prefix, out.tenant)};
    const int64_t m = static_cast<int64_t>(held.blocks.size()) * prefix_->block_tokens();
    // A prompt that starts with the plug-in's encoder prefix (the QA instruction) can take those
    // tokens' K/V from the states the model holds for the encoder, which run through every layer
    // of the decoder: the same computation, done once per model.
    const auto& instruction = plugin.config().encoder_prefix;
    const int64_t pre = static_cast<int64_t>(instruction.size());
    // (None when the encoder is not the base's own layers.)
    const KVCache* states = pre > 0 && pre <= p && std::equal(instruction.begin(), instruction.end(), r.prefix.begin())
                                ? model_.encoder_prefix_states()
                                : nullptr;
    // On a CUDA half decoder the states cover every layer in one launch, in place of the prefix
    // cache's blocks and a copy per block and layer.
    bool placed = false;
    if (states && m <= pre && model_.decoder().cuda_kernels_apply(out.cache)) {
      std::vector<detail::JoinPart> parts;
      for (int64_t layer = 0; layer < model_.config().n_layer; ++layer) {
        detail::JoinPart part;
        part.block = layer;
        part.keys = states->keys(layer)[0];  // [n_head_kv, pre, head_dim]: the states' capacity is pre
        part.values = states->values(layer)[0];
        parts.push_back(std::move(part));
      }
      placed = detail::pic::copy_in_one_launch(parts, out.cache);
    }
    if (placed) {
      out.cache.set_length(pre);
      out.reused += pre;
    } else {
      prefix_->fill(held.blocks, out.cache);
      out.cache.set_length(m);
      out.reused += m;
    }
    // Past the prefix cache's blocks, the rest of the instruction from those states.
    if (states && out.cache.length() < pre) {
      for (int64_t layer = 0; layer < model_.config().n_layer; ++layer)
        out.cache.write(layer, m, states->keys(layer).narrow(2, m, pre - m), states->values(layer).narrow(2, m, pre - m));
      out.cache.set_length(pre);
      out.reused += pre - m;
    }
  }
  // The documents from the store or encoded (together, in batches where lengths allow); when some
  // are encoded and the plug-in allows, the prompt is computed in the same pass (each layer's
  // weights read once for both), else left pending.
  std::vector<bool> cached;
  const int64_t from = out.cache.length();
  at::Tensor logits = documents_->get_with_prompt(r.documents, out.tenant, &cached,
                                                 token_ids(out.tokens, from, out.n_prompt), out.cache,
                                                 anchor, out.documents);
  for (size_t i = 0; i < r.documents.size(); ++i)
    (cached[i] ? out.reused : out.computed) += static_cast<int64_t>(r.documents[i].size());
  if (!logits.defined()) return;  // the prompt pending
  out.computed += out.n_prompt - from;
  out.logits = logits[0][-1];
  if (out.prefix_insert > 0) prefix_->insert(out.tokens, out.prefix_insert, out.cache, out.tenant);
}

COMB_INLINE GenerationResult PicEngine::generate(const PicRequest& request, const GenerateOptions& options, PicCounts* counts) {
  auto started = std::chrono::steady_clock::now();
  PicPrefill p = prefill(request, options.max_tokens);
  GenerationResult r = model_.decode(p.cache, p.logits, options, p.documents.empty() ? nullptr : &p.documents,
                                     started, p.n_prompt);
  if (counts) *counts = {p.n_prompt, p.computed, p.reused};
  return r;
}

}  // namespace comb
