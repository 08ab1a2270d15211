// comb::Documents (see comb/documents.hpp): a request's documents rendered, found or encoded,
// pinned and linked. Compiled into libcomb (src/documents.cpp), or inline in every translation
// unit that defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <array>

#include "comb/detail/decode_step.hpp"
#include "comb/documents.hpp"
#include "comb/error.hpp"
#include "comb/model.hpp"

namespace comb {

COMB_INLINE Documents::Documents(const Model& model, std::shared_ptr<PICacheStore> store)
    : model_(model), store_(std::move(store)) {}

COMB_INLINE std::string Documents::text(const QaDocument& d) { return "Title: " + d.title + "\n" + d.text + "\n\n"; }

COMB_INLINE std::vector<int32_t> Documents::tokens(const Model& model, const QaDocument& d) {
  return model.tokenizer().encode(text(d), /*parse_special=*/false);
}

COMB_INLINE std::vector<int32_t> Documents::tokens(const QaDocument& d) const { return tokens(model_, d); }

COMB_INLINE const Plugin& Documents::plugin() const {
  COMB_CHECK(model_.plugin(), "documents need a plug-in: load one with Options::plugin (--plugin FILE)");
  return *model_.plugin();
}

COMB_INLINE CacheKey Documents::key(const std::vector<int32_t>& tokens, const std::string& tenant) const {
  return PICacheStore::key(tokens, plugin().fingerprint() + model_.decoder().weights().cache_tag(), tenant);
}

COMB_INLINE Documents::Lookup Documents::look_up(const std::vector<std::vector<int32_t>>& documents,
                                                 const std::string& tenant, std::vector<bool>* from_cache) const {
  Lookup l;
  l.entries.resize(documents.size());
  l.source.assign(documents.size(), -1);
  if (from_cache) from_cache->assign(documents.size(), false);
  for (size_t i = 0; i < documents.size(); ++i) {
    if (store_)
      if (auto hit = store_->get(key(documents[i], tenant))) {
        l.entries[i] = std::move(hit);
        if (from_cache) (*from_cache)[i] = true;
        continue;
      }
    auto same = std::find(l.missing.begin(), l.missing.end(), documents[i]);
    if (same == l.missing.end()) {
      same = l.missing.insert(l.missing.end(), documents[i]);
    } else if (from_cache) {  // linked again: computed once, for its first place
      (*from_cache)[i] = true;
    }
    l.source[i] = same - l.missing.begin();
  }
  return l;
}

COMB_INLINE std::shared_ptr<const DocumentKV> Documents::get(const std::vector<int32_t>& tokens,
                                                             const std::string& tenant, bool* from_cache) const {
  std::vector<bool> cached;
  auto out = get(std::vector<std::vector<int32_t>>{tokens}, tenant, &cached);
  if (from_cache) *from_cache = cached[0];
  return out[0];
}

COMB_INLINE std::vector<std::shared_ptr<const DocumentKV>> Documents::get(
    const std::vector<std::vector<int32_t>>& documents, const std::string& tenant,
    std::vector<bool>* from_cache) const {
  const Plugin& p = plugin();
  c10::InferenceMode guard;
  Lookup l = look_up(documents, tenant, from_cache);
  if (l.missing.empty()) return l.entries;
  std::vector<DocumentKV> encoded = p.encode_many(model_.decoder(), l.missing, model_.encoder_prefix_states());
  quantize_on_device(encoded);
  for (size_t j = 0; j < l.missing.size(); ++j) {
    auto kv = put(key(l.missing[j], tenant), std::move(encoded[j]));
    for (size_t i = 0; i < documents.size(); ++i)
      if (l.source[i] == static_cast<int64_t>(j)) l.entries[i] = kv;
  }
  return l.entries;
}

COMB_INLINE c10::ScalarType Documents::kept_dtype() const {
  c10::ScalarType t = c10::ScalarType::Undefined;
  const Plugin* p = model_.plugin();
  if (store_ && store_->options().dtype != c10::ScalarType::Undefined)
    t = store_->options().dtype;
  else if (p && !p->config().cache_dtype.empty())
    t = parse_cache_dtype(p->config().cache_dtype);  // checked when it loaded
  const int64_t hd = model_.config().head_dim;
  COMB_CHECK(t != kCacheInt4 || DocumentKV::rotates_int4_keys(hd),
             "int4 document caches code keys rotated by a Walsh-Hadamard matrix of order head_dim, which must be a "
             "power of two; this model's head_dim is {} (int8-int4 keeps int8 keys at any even head_dim)",
             hd);
  return t;
}

COMB_INLINE void Documents::quantize_on_device(std::vector<DocumentKV>& kvs) const {
  RECORD_FUNCTION("comb::quantize_on_device", std::vector<c10::IValue>());
  const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
  if (!ops || !ops->quantize_int8 || kvs.empty() || kept_dtype() != at::kChar) return;
  std::vector<std::vector<std::array<at::Tensor, 2>>> in(kvs.size());
  for (size_t d = 0; d < kvs.size(); ++d) {
    const DocumentKV& kv = kvs[d];
    if (kv.keys.empty() || kv.quantized() || kv.values.size() != kv.keys.size()) return;
    for (size_t b = 0; b < kv.keys.size(); ++b) {
      const at::Tensor &k = kv.keys[b], &v = kv.values[b];
      const auto t = k.scalar_type();
      if (!k.is_cuda() || k.dim() != 3 || v.sizes() != k.sizes() || v.scalar_type() != t ||
          (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf))
        return;
      in[d].push_back({k.contiguous(), v.contiguous()});
    }
  }
  std::vector<std::vector<std::array<at::Tensor, 4>>> out;
  ops->quantize_int8(in, out);
  for (size_t d = 0; d < kvs.size(); ++d) {
    DocumentKV q;
    q.n_tokens = kvs[d].n_tokens;
    for (const auto& [kc, ks, vc, vs] : out[d]) {
      q.keys.push_back(kc), q.key_scales.push_back(ks);
      q.values.push_back(vc), q.value_scales.push_back(vs);
    }
    kvs[d] = std::move(q);
  }
}

COMB_INLINE DocumentKV Documents::cached_form(DocumentKV kv) const {
  if (store_ && store_->options().dtype != c10::ScalarType::Undefined) return kv;  // the store converts
  const c10::ScalarType want = kept_dtype();
  if (want == c10::ScalarType::Undefined || kv.keys.empty() || kv.dtype() == want) return kv;
  return kv.to(kv.keys[0].device(), want);
}

COMB_INLINE std::shared_ptr<const DocumentKV> Documents::put(const CacheKey& key, DocumentKV kv) const {
  DocumentKV kept = cached_form(std::move(kv));
  return store_ ? store_->put(key, kept) : std::make_shared<const DocumentKV>(std::move(kept));
}

COMB_INLINE LinkedDocuments Documents::link(const std::vector<std::shared_ptr<const DocumentKV>>& entries,
                                           int64_t anchor) const {
  RECORD_FUNCTION("comb::link", std::vector<c10::IValue>());
  LinkedDocuments linked = Linker(model_.decoder().device(), plugin().config().joint_attention).link(entries);
  linked.anchor = anchor;
  return linked;
}

COMB_INLINE CacheKey Documents::decoder_key(const std::vector<int32_t>& tokens, const std::string& tenant) const {
  std::call_once(decoder_fingerprint_once_, [&] {
    decoder_fingerprint_ = "decoder-kv:" + base_fingerprint(model_.decoder()) + model_.decoder().weights().cache_tag();
  });
  return PICacheStore::key(tokens, decoder_fingerprint_, tenant);
}

COMB_INLINE std::optional<DocumentKV> Documents::decoder_piece(const std::vector<int32_t>& tokens, int64_t from,
                                                               int64_t to, std::optional<KVCache>& cache,
                                                               const PieceForward& forward) const {
  RECORD_FUNCTION("comb::decoder_piece", std::vector<c10::IValue>());
  const Decoder& dec = model_.decoder();
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (!cache) cache.emplace(dec.make_cache(1, n));
  if (forward) {
    forward(token_ids(tokens, from, to), *cache, nullptr);
    COMB_CHECK(cache->length() == to, "a document piece's forward should advance its cache to {}, found {}", to,
               cache->length());
  } else {
    dec.forward(token_ids(tokens, from, to), *cache);
  }
  if (to < n) return std::nullopt;
  DocumentKV kv;  // positions [0, n) of each layer: a block a layer
  kv.n_tokens = n;
  for (int64_t l = 0; l < cache->n_layers(); ++l) {
    kv.keys.push_back(cache->keys(l)[0].narrow(1, 0, n));
    kv.values.push_back(cache->values(l)[0].narrow(1, 0, n));
  }
  return kv;
}

COMB_INLINE std::shared_ptr<const DocumentKV> Documents::decoder_kv(const std::vector<int32_t>& tokens,
                                                                    const std::string& tenant, bool* computed) const {
  COMB_CHECK(!tokens.empty(), "an empty document has no cache");
  c10::InferenceMode guard;
  const CacheKey k = decoder_key(tokens, tenant);
  if (store_)
    if (auto hit = store_->get(k)) {
      if (computed) *computed = false;
      return hit;
    }
  if (computed) *computed = true;
  std::optional<KVCache> cache;
  DocumentKV kv = *decoder_piece(tokens, 0, static_cast<int64_t>(tokens.size()), cache);
  return store_ ? store_->put(k, kv) : std::make_shared<const DocumentKV>(std::move(kv));
}

COMB_INLINE std::vector<std::shared_ptr<const DocumentKV>> Documents::decoder_kv_many(
    const std::vector<std::vector<int32_t>>& pieces, const std::string& tenant, std::vector<bool>* computed,
    std::optional<bool> batched) const {
  RECORD_FUNCTION("comb::decoder_kv_many", std::vector<c10::IValue>());
  c10::InferenceMode inference;
  const Decoder& dec = model_.decoder();
  const size_t n = pieces.size();
  std::vector<std::shared_ptr<const DocumentKV>> out(n);
  if (computed) computed->assign(n, false);
  if (!batched.value_or(dec.device().is_cuda())) {  // one after another
    for (size_t i = 0; i < n; ++i) {
      bool c = false;
      out[i] = decoder_kv(pieces[i], tenant, &c);
      if (computed) (*computed)[i] = c;
    }
    return out;
  }
  // The store's entries; each missing piece once, in the order first asked.
  std::vector<CacheKey> keys(n);
  std::vector<std::vector<int32_t>> missing;
  std::vector<int64_t> source(n, -1);
  for (size_t i = 0; i < n; ++i) {
    COMB_CHECK(!pieces[i].empty(), "piece {} of {} is empty: an empty document has no cache", i, n);
    keys[i] = decoder_key(pieces[i], tenant);
    if (store_)
      if (auto hit = store_->get(keys[i])) {
        out[i] = std::move(hit);
        continue;
      }
    auto same = std::find(missing.begin(), missing.end(), pieces[i]);
    if (same == missing.end()) {
      same = missing.insert(missing.end(), pieces[i]);
      if (computed) (*computed)[i] = true;
    } else if (computed) {
      (*computed)[i] = !store_;  // without a store, decoder_kv would compute it again
    }
    source[i] = same - missing.begin();
  }
  std::vector<std::shared_ptr<const DocumentKV>> made(missing.size());
  auto keep = [&](size_t j, DocumentKV kv) {
    const CacheKey& k = keys[std::find(source.begin(), source.end(), static_cast<int64_t>(j)) - source.begin()];
    made[j] = store_ ? store_->put(k, kv) : std::make_shared<const DocumentKV>(std::move(kv));
  };
  // One FlashAttention launch a layer over the packed pieces where encode_many packs documents (a
  // CUDA half decoder with comb's ops; COMB_CUDA_VARLEN=0: a piece at a time in each layer).
  static const bool varlen_asked = detail::env_on("COMB_CUDA_VARLEN");
  const bool varlen = varlen_asked && dec.device().is_cuda() &&
                      (dec.dtype() == at::kBFloat16 || dec.dtype() == at::kHalf) && !at::GradMode::is_enabled() &&
                      detail::cuda_layer_ops() != nullptr;
  for (const auto& batch : Plugin::encoding_batches(missing, /*gpu=*/true)) {
    if (batch.size() == 1) {  // alone: decoder_kv's path (a fused one-sequence forward)
      std::optional<KVCache> cache;
      keep(batch[0], *decoder_piece(missing[batch[0]], 0, static_cast<int64_t>(missing[batch[0]].size()), cache));
      continue;
    }
    // The pieces packed in one row sequence, each from position 0 (Decoder::layer_packed: no padding;
    // on a CUDA half decoder the fused layers and one FlashAttention launch a layer), each layer's
    // K/V cut into the pieces' entries as the pass computes it (one launch a layer on a GPU).
    std::vector<int64_t> lens, flat;
    for (size_t j : batch) {
      lens.push_back(static_cast<int64_t>(missing[j].size()));
      flat.insert(flat.end(), missing[j].begin(), missing[j].end());
    }
    const Decoder::PackedRows rows = dec.packed_rows(lens, 0);
    std::vector<std::array<int64_t, 3>> at_rows;
    for (size_t d = 0; d < lens.size(); ++d) at_rows.push_back({0, rows.first[d], lens[d]});
    detail::DocumentSplit split(std::move(at_rows), dec.config().n_layer);
    at::Tensor h = dec.embed(
        detail::upload_ints(flat, at::kLong, dec.device()).view({1, static_cast<int64_t>(flat.size())}));
    for (int64_t l = 0; l < dec.config().n_layer; ++l) {
      std::pair<at::Tensor, at::Tensor> kv;
      h = dec.layer_packed(l, h, rows, at::Tensor(), at::Tensor(), varlen, &kv);
      split.add(l, kv.first, kv.second);
    }
    std::vector<DocumentKV> kvs = split.take();
    for (size_t d = 0; d < batch.size(); ++d) keep(batch[d], std::move(kvs[d]));
  }
  for (size_t i = 0; i < n; ++i)
    if (source[i] >= 0) out[i] = made[static_cast<size_t>(source[i])];
  return out;
}

COMB_INLINE std::unique_ptr<DocumentWork> Documents::begin(const std::vector<int32_t>& tokens, const std::string& tenant,
                                                          Cache kind) const {
  COMB_CHECK(!tokens.empty(), "an empty document has no cache");
  auto work = std::make_unique<DocumentWork>();
  work->decoder = kind == Cache::decoder;
  work->key = work->decoder ? decoder_key(tokens, tenant) : key(tokens, tenant);
  if (store_ && store_->get(work->key)) return nullptr;
  work->tokens = tokens;
  return work;
}

COMB_INLINE bool Documents::advance(DocumentWork& w, int64_t max_tokens, const PieceForward& forward) const {
  c10::InferenceMode guard;
  const int64_t n = static_cast<int64_t>(w.tokens.size());
  COMB_CHECK(w.done < n, "Documents::advance: the document is complete");
  const int64_t from = w.done, to = std::min(n, from + std::max<int64_t>(max_tokens, 1));
  const Decoder& dec = model_.decoder();
  COMB_CHECK(!forward || w.decoder, "Documents::advance: only a decoder-K/V piece takes a caller's forward");
  if (!w.decoder) {
    const Plugin& plugin = this->plugin();
    if (!plugin.encoder_is_base()) {  // not resumable: the whole document now
      w.done = n;
      return put(w.key, plugin.encode(dec, w.tokens)) != nullptr;
    }
    if (!w.cache) w.cache.emplace(plugin.begin_encoding(dec, w.tokens, *model_.encoder_prefix_states()));
    plugin.encode_piece(dec, w.tokens, from, to, *w.cache, w.keys, w.values);
    w.done = to;
    if (to < n) return false;
    put(w.key, Plugin::finish_encoding(w.keys, w.values, n));
  } else {
    std::optional<DocumentKV> kv = decoder_piece(w.tokens, from, to, w.cache, forward);
    w.done = to;
    if (!kv) return false;
    if (store_) store_->put(w.key, *kv);
  }
  w.cache.reset();
  w.keys.clear();
  w.values.clear();
  return true;
}

COMB_INLINE std::unique_ptr<DocumentReads> Documents::paged_reads(LinkedDocuments& l) const {
  const Plugin& plugin = this->plugin();
  if (!plugin.config().joint_attention) return std::make_unique<DocumentReads>(DocumentReads::residual(plugin, l));
  if (l.anchor > 0 || plugin.config().consecutive_documents) {
    std::vector<JointKV> blocks;
    {
      std::lock_guard<std::mutex> lock(l.joined->mutex);
      blocks = l.joined->blocks;
    }
    l.joined = std::make_shared<LinkedDocuments::Joined>();  // the float32 copy below is what decoding reads
    for (auto& j : blocks) {
      j.keys = j.keys.to(at::kFloat).contiguous();
      j.values = j.values.to(at::kFloat).contiguous();
    }
    return std::make_unique<DocumentReads>(DocumentReads::joined(plugin, std::move(blocks), /*paged=*/true));
  }
  l.joined = std::make_shared<LinkedDocuments::Joined>();  // not read by decoding
  std::vector<std::vector<at::Tensor>> keys = std::move(l.keys), values = std::move(l.values);
  std::vector<std::vector<at::Tensor>> key_scales = std::move(l.key_scales), value_scales = std::move(l.value_scales);
  l.keys.clear(), l.values.clear(), l.key_scales.clear(), l.value_scales.clear();
  dequantize_linked(keys, values, key_scales, value_scales);  // int8 ones linked as stored
  for (auto& block : keys)
    for (auto& t : block) t = t.to(at::kFloat).contiguous();
  for (auto& block : values)
    for (auto& t : block) t = t.to(at::kFloat).contiguous();
  return std::make_unique<DocumentReads>(DocumentReads::segmented(plugin, std::move(keys), std::move(values)));
}

COMB_INLINE bool Documents::pin(const CacheKey& key) const {
  if (!store_) return false;
  std::lock_guard<std::mutex> lock(pins_mutex_);
  int& n = pins_[{key.high, key.low}];
  if (n == 0 && !store_->pin(key)) {  // not in a memory tier (no host tier, or too small): nothing to hold
    pins_.erase({key.high, key.low});
    return false;
  }
  ++n;
  return true;
}

COMB_INLINE void Documents::unpin(const CacheKey& key) const {
  if (!store_) return;
  std::lock_guard<std::mutex> lock(pins_mutex_);
  auto it = pins_.find({key.high, key.low});
  if (it != pins_.end() && --it->second == 0) {
    store_->unpin(key);
    pins_.erase(it);
  }
}

COMB_INLINE at::Tensor Documents::get_with_prompt(const std::vector<std::vector<int32_t>>& documents,
                                                  const std::string& tenant, std::vector<bool>* from_cache,
                                                  const at::Tensor& tokens, KVCache& cache, int64_t anchor,
                                                  LinkedDocuments& linked, LogitsMode mode) const {
  const Plugin& plugin = this->plugin();
  c10::InferenceMode guard;
  const Decoder& decoder = model_.decoder();
  if (!plugin.encodes_alongside(decoder) || tokens.size(0) != 1 || documents.empty()) {
    linked = link(get(documents, tenant, from_cache), anchor);
    return at::Tensor();
  }
  COMB_CHECK(!plugin.config().documents_after_prefix || anchor > 0,
             "this plug-in reads its documents after the instruction prefix: anchor them at the prefix's length");
  // The store's entries; each document to encode once, however often it is linked.
  Lookup l = look_up(documents, tenant, from_cache);
  std::vector<std::shared_ptr<const DocumentKV>>& entries = l.entries;
  const std::vector<std::vector<int32_t>>& missing = l.missing;
  const std::vector<int64_t>& source = l.source;
  if (missing.empty()) {
    linked = link(entries, anchor);
    return at::Tensor();
  }
  const c10::ScalarType keep = kept_dtype();  // what a later request reads from the store
  const int64_t n_blocks = plugin.config().n_blocks();
  std::vector<DocumentKV> fresh(missing.size());
  for (size_t j = 0; j < missing.size(); ++j) {
    fresh[j].n_tokens = static_cast<int64_t>(missing[j].size());
    fresh[j].keys.resize(n_blocks);
    fresh[j].values.resize(n_blocks);
  }
  std::vector<JointKV> joined(n_blocks);
  auto join = [&](int64_t k, std::vector<at::Tensor> keys, std::vector<at::Tensor> values) -> const JointKV* {
    RECORD_FUNCTION("comb::join", std::vector<c10::IValue>());
    // The new documents' block-k K/V as they will be kept...
    for (size_t j = 0; j < missing.size(); ++j) {
      DocumentKV one;
      one.n_tokens = fresh[j].n_tokens;
      one.keys = {keys[j]};
      one.values = {values[j]};
      one = one.to(decoder.device(), keep == c10::ScalarType::Undefined ? keys[j].scalar_type() : keep);
      fresh[j].keys[k] = one.keys[0];
      fresh[j].values[k] = one.values[0];
      if (one.quantized()) {
        fresh[j].key_scales.resize(n_blocks);
        fresh[j].value_scales.resize(n_blocks);
        fresh[j].key_scales[k] = one.key_scales[0];
        fresh[j].value_scales[k] = one.value_scales[0];
      }
    }
    // ...and every linked document's, in the request's order, read as a later request reads them.
    std::vector<std::vector<at::Tensor>> ks(1), vs(1), kss(1), vss(1);
    for (size_t i = 0; i < documents.size(); ++i) {
      const DocumentKV& d = source[i] < 0 ? *entries[i] : fresh[source[i]];
      // int4 codes are read as int8 ones (DocumentKV::int8_block: int4 keys rotated back).
      auto [key, key_scale, value, value_scale] = d.int8_block(k);
      if (d.quantized() && key.device() == decoder.device()) {
        // as stored: the int8 codes and their scales
      } else if (d.quantized()) {
        key = key.to(decoder.device(), at::kFloat) * key_scale.to(decoder.device());
        value = value.to(decoder.device(), at::kFloat) * value_scale.to(decoder.device());
        key_scale = value_scale = at::Tensor();
      } else {
        key = key.to(decoder.device(), at::kFloat).contiguous();
        value = value.to(decoder.device(), at::kFloat).contiguous();
      }
      ks[0].push_back(key);
      vs[0].push_back(value);
      kss[0].push_back(key_scale);
      vss[0].push_back(value_scale);
    }
    auto one = plugin.joint_kv_direct(plugin.weights(), ks, vs, {static_cast<int64_t>(documents.size())}, anchor, kss,
                                      vss, k);
    COMB_CHECK(one.has_value(), "get_with_prompt: block {}'s documents could not be joined", k);
    joined[k] = std::move((*one)[0]);
    return &joined[k];
  };
  at::Tensor hidden = plugin.encode_alongside(decoder, missing, *model_.encoder_prefix_states(), tokens, cache, join);
  for (size_t j = 0; j < missing.size(); ++j) {
    auto kv = store_ ? store_->put(key(missing[j], tenant), fresh[j])
                     : std::make_shared<const DocumentKV>(std::move(fresh[j]));
    for (size_t i = 0; i < documents.size(); ++i)
      if (source[i] == static_cast<int64_t>(j)) entries[i] = kv;
  }
  linked = link(entries, anchor);
  {
    std::lock_guard<std::mutex> lock(linked.joined->mutex);  // decoding steps read these
    linked.joined->blocks = std::move(joined);
    linked.joined->plugin = plugin.fingerprint();
    linked.joined->anchor = anchor;
  }
  return decoder.logits(hidden, mode);
}

}  // namespace comb
