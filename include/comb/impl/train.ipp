// comb train: examples, the differentiable forward of the plug-in on a frozen decoder, the loop.
// Compiled into libcomb (src/train.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "comb/detail/json.hpp"
#include "comb/error.hpp"
#include "comb/log.hpp"
#include "comb/prompt.hpp"
#include "comb/safetensors.hpp"
#include "comb/train.hpp"

namespace fs = std::filesystem;

namespace comb {

// ================================================================================================
// Examples
// ================================================================================================

namespace detail::train {  // this file's own helpers
COMB_INLINE std::string uuid(std::mt19937_64& rng) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) s += '-';
    s += hex[rng() % 16];
  }
  return s;
}

COMB_INLINE int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // [lo, hi]
  return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
}
}  // namespace detail::train

COMB_INLINE std::shared_ptr<const std::vector<int32_t>> TrainData::document(const QaDocument& d) const {
  auto t = qa_documents(model_, {d}).front();  // as every prompt holds it
  if (static_cast<int64_t>(t.size()) > options_.max_document_tokens) t.resize(options_.max_document_tokens);
  return std::make_shared<const std::vector<int32_t>>(std::move(t));
}

COMB_INLINE TrainData::TrainData(const Model& model, const TrainDataOptions& options) : model_(model), options_(options) {
  COMB_CHECK(options.min_documents >= 1 && options.max_documents >= options.min_documents,
             "documents per example: need 1 <= min ({}) <= max ({})", options.min_documents, options.max_documents);
  COMB_CHECK(options.max_document_tokens > 0, "--max-document-tokens must be > 0, found {}",
             options.max_document_tokens);
  COMB_CHECK(options.kv_share >= 0 && options.needle_share >= 0 && options.kv_share + options.needle_share <= 1,
             "generated shares must be >= 0 and sum to at most 1 (kv {}, needle {})", options.kv_share,
             options.needle_share);
  prefix_ = qa_prefix(model);
  if (auto eot = model.tokenizer().find_token(model.chat_template().end_of_turn())) end_of_turn_ = {*eot};
  else if (auto eos = model.tokenizer().eos_id()) end_of_turn_ = {*eos};
  std::set<std::string> held;
  for (const auto& [file, n] : options.holdout)
    for (const auto& item : read_qa_items(file, n)) held.insert(item.id);
  std::unordered_map<std::string, std::shared_ptr<const std::vector<int32_t>>> seen;  // documents repeat across items
  for (const auto& file : options.files) {
    auto items = read_qa_items(file);
    int64_t kept = 0;
    for (const auto& item : items) {
      if (held.count(item.id)) {
        ++n_held_out_;
        continue;
      }
      if (item.gold_index < 0 || item.answers.empty()) continue;  // nothing to learn without the answer's document
      Item it;
      for (const auto& d : item.documents) {
        std::string key = d.title + '\x01' + d.text;
        auto found = seen.find(key);
        if (found == seen.end()) found = seen.emplace(key, document(d)).first;
        it.documents.push_back(found->second);
      }
      it.gold = item.gold_index;
      it.suffix = qa_suffix(model, item.question);
      it.answer = model.tokenizer().encode(item.answers.front(), false);
      it.answer.insert(it.answer.end(), end_of_turn_.begin(), end_of_turn_.end());
      items_.push_back(std::move(it));
      ++kept;
    }
    log(LogLevel::info, "train data: {}: {} items, {} kept ({} held out or without a gold document)", file, items.size(), kept,
             items.size() - kept);
  }
  if (!options.essays_dir.empty()) {
    paragraphs_ = essay_paragraphs(options.essays_dir, 80, "train");
    log(LogLevel::info, "train data: {} filler paragraphs from the essays' train split", paragraphs_.size());
  }
  COMB_CHECK(!items_.empty() || options.kv_share > 0 || (options.needle_share > 0 && !paragraphs_.empty()),
             "no training examples: give --data files or generated shares");
}

COMB_INLINE TrainExample TrainData::finish(std::vector<std::shared_ptr<const std::vector<int32_t>>> documents, int64_t gold,
                               std::vector<int32_t> suffix, std::vector<int32_t> answer,
                               std::mt19937_64& rng) const {
  // A random subset (the answer's document always in it) in a random order.
  const int64_t n = static_cast<int64_t>(documents.size());
  int64_t k = detail::train::uniform(rng, std::min(options_.min_documents, n), std::min(options_.max_documents, n));
  std::vector<int64_t> others;
  for (int64_t i = 0; i < n; ++i)
    if (i != gold) others.push_back(i);
  std::shuffle(others.begin(), others.end(), rng);
  std::vector<int64_t> chosen(others.begin(), others.begin() + std::min<int64_t>(k - 1, others.size()));
  chosen.push_back(gold);
  std::shuffle(chosen.begin(), chosen.end(), rng);
  TrainExample e;
  for (int64_t i : chosen) e.documents.push_back(documents[i]);
  e.prefix = prefix_;
  e.suffix = std::move(suffix);
  e.answer = std::move(answer);
  return e;
}

COMB_INLINE TrainExample TrainData::generated_kv(std::mt19937_64& rng) const {
  // As kv-75: documents of 5 pairs of UUIDs as JSON objects, a key to look up.
  const int64_t n_docs =
      detail::train::uniform(rng, 2, std::max<int64_t>(2, std::min<int64_t>(15, options_.max_documents)));
  const int64_t gold = detail::train::uniform(rng, 0, n_docs - 1), slot = detail::train::uniform(rng, 0, 4);
  std::string key, value;
  std::vector<std::shared_ptr<const std::vector<int32_t>>> docs;
  for (int64_t d = 0; d < n_docs; ++d) {
    std::string text = "{";
    for (int p = 0; p < 5; ++p) {
      std::string k = detail::train::uuid(rng), v = detail::train::uuid(rng);
      if (d == gold && p == slot) key = k, value = v;
      text += fmt::format("{}\"{}\": \"{}\"", p ? ", " : "", k, v);
    }
    docs.push_back(document({"", text + "}"}));
  }
  std::string question = "Extract the value corresponding to the key \"" + key + "\" from the JSON objects above.";
  std::vector<int32_t> answer = model_.tokenizer().encode(value, false);
  answer.insert(answer.end(), end_of_turn_.begin(), end_of_turn_.end());
  return finish(std::move(docs), gold, qa_suffix(model_, question), std::move(answer), rng);
}

COMB_INLINE TrainExample TrainData::generated_needle(std::mt19937_64& rng) const {
  // A fact hidden in one of several filler paragraphs (needle_item, qa.hpp), over the essays'
  // train split and with train keys, so `comb make-data --kind needle --split test` stays unseen.
  const int64_t n_docs = detail::train::uniform(rng, 2, std::max<int64_t>(2, options_.max_documents));
  QaItem item = needle_item(paragraphs_, n_docs, false, rng);
  std::vector<std::shared_ptr<const std::vector<int32_t>>> docs;
  for (const auto& d : item.documents) docs.push_back(document(d));
  std::vector<int32_t> answer = model_.tokenizer().encode(item.answers.front(), false);
  answer.insert(answer.end(), end_of_turn_.begin(), end_of_turn_.end());
  return finish(std::move(docs), item.gold_index, qa_suffix(model_, item.question), std::move(answer), rng);
}

COMB_INLINE TrainExample TrainData::sample(std::mt19937_64& rng) const {
  double u = std::uniform_real_distribution<double>(0, 1)(rng);
  double needle = paragraphs_.empty() ? 0 : options_.needle_share;
  double kv = items_.empty() ? 1 - needle : options_.kv_share;
  if (u < kv) return generated_kv(rng);
  if (u < kv + needle) return generated_needle(rng);
  const Item& it = items_[rng() % items_.size()];
  return finish(it.documents, it.gold, it.suffix, it.answer, rng);
}

// ================================================================================================
// Batches and the differentiable forward
// ================================================================================================

COMB_INLINE TrainBatch make_train_batch(const std::vector<TrainExample>& examples, c10::Device device) {
  COMB_CHECK(!examples.empty(), "a training batch needs at least one example");
  int64_t n_docs = 0, max_len = 1, max_tokens = 1;
  for (const auto& e : examples) {
    COMB_CHECK(!e.documents.empty(), "a training example needs at least one document");
    COMB_CHECK(!e.answer.empty(), "a training example needs an answer");
    n_docs += e.documents.size();
    for (const auto& d : e.documents) {
      COMB_CHECK(!d->empty(), "a training document is empty");
      max_len = std::max<int64_t>(max_len, d->size());
    }
    max_tokens = std::max<int64_t>(max_tokens, e.prefix.size() + e.suffix.size() + e.answer.size());
  }
  const int64_t batch = examples.size();
  std::vector<int64_t> doc_tokens(n_docs * max_len, 0), tokens(batch * max_tokens, 0), rows, targets;
  std::vector<uint8_t> doc_mask(n_docs * max_len, 0);
  int64_t real = 0, d = 0;
  TrainBatch out;
  for (int64_t b = 0; b < batch; ++b) {
    const auto& e = examples[b];
    out.doc_counts.push_back(e.documents.size());
    for (const auto& doc : e.documents) {
      out.doc_lens.push_back(doc->size());
      out.documents.push_back(*doc);
      for (size_t t = 0; t < doc->size(); ++t) {
        doc_tokens[d * max_len + t] = (*doc)[t];
        doc_mask[d * max_len + t] = 1;
      }
      real += doc->size();
      ++d;
    }
    std::vector<int32_t> seq = e.prefix;
    seq.insert(seq.end(), e.suffix.begin(), e.suffix.end());
    const int64_t answer_at = seq.size();
    seq.insert(seq.end(), e.answer.begin(), e.answer.end());
    for (size_t t = 0; t < seq.size(); ++t) tokens[b * max_tokens + t] = seq[t];
    for (size_t j = 0; j < e.answer.size(); ++j) {
      rows.push_back(b * max_tokens + answer_at - 1 + j);  // the position whose next token is answer[j]
      targets.push_back(e.answer[j]);
    }
    real += seq.size() - 1;  // the last answer token is a target only
  }
  auto i64 = [&](std::vector<int64_t>& v, std::vector<int64_t> shape) {
    return at::from_blob(v.data(), shape, at::kLong).clone().to(device);
  };
  auto mask = [&](std::vector<uint8_t>& v, std::vector<int64_t> shape) {
    return at::from_blob(v.data(), shape, at::kByte).to(at::kBool).to(device);
  };
  out.doc_tokens = i64(doc_tokens, {n_docs, max_len});
  out.doc_mask = mask(doc_mask, {n_docs, max_len});
  out.tokens = i64(tokens, {batch, max_tokens});
  out.target_rows = i64(rows, {static_cast<int64_t>(rows.size())});
  out.targets = i64(targets, {static_cast<int64_t>(targets.size())});
  out.real_tokens = real;
  out.prefix_tokens = static_cast<int64_t>(examples[0].prefix.size());
  for (const auto& e : examples)
    if (static_cast<int64_t>(e.prefix.size()) != out.prefix_tokens) out.prefix_tokens = -1;
  return out;
}

namespace detail::train {  // this file's own helpers
// The decoder over tokens [batch, n] at positions 0..n-1 (Decoder::hidden, differentiable), reading
// `reads` (the documents) or nothing; the final-normed hidden state [batch, n, n_embd].
COMB_INLINE at::Tensor decoder_hidden(const Decoder& base, const at::Tensor& tokens, const LayerReads* reads) {
  COMB_CHECK(!base.weights().quantized(), "training differentiates through the decoder's float weights; load the "
             "model without --quantize (weights kept quantized have no gradient kernels)");
  return base.hidden(tokens, reads);
}

COMB_INLINE at::Tensor head_logits(const Decoder& base, const at::Tensor& hidden, const at::Tensor& rows) {
  at::Tensor h = hidden.reshape({-1, hidden.size(-1)}).index_select(0, rows);
  return at::linear(h, base.weights().output).to(at::kFloat);
}
}  // namespace detail::train

COMB_INLINE std::pair<at::Tensor, at::Tensor> read_as_stored(const at::Tensor& keys, const at::Tensor& values,
                                                             c10::ScalarType dtype) {
  DocumentKV one;
  {
    c10::AutoGradMode no_grad(false);
    one.n_tokens = keys.size(1);
    one.keys = {keys.detach()};
    one.values = {values.detach()};
    one = one.to(keys.device(), dtype).to(keys.device(), at::kFloat);
  }
  at::Tensor k = one.keys[0].to(keys.scalar_type()), v = one.values[0].to(values.scalar_type());
  // The stored numbers exactly (x - x is 0), the gradient of the identity. keys + (k - keys) would
  // round where k is far from keys relative to them: rotated int4 keys move small elements by up
  // to a row's error.
  return {k + (keys - keys.detach()), v + (values - values.detach())};
}

COMB_INLINE bool train_encodes_as_inference(const Decoder& base, const Plugin& plugin, const PluginWeights& weights) {
  // On the CPU only: the GPU's training keeps the padded batch it was measured with.
  return plugin.encoder_is_base() && !weights.tok_embd.defined() && base.device().is_cpu();
}

COMB_INLINE TrainDocumentKV train_document_kv(const Decoder& base, const Plugin& plugin, const PluginWeights& pw,
                                              const TrainBatch& batch, bool as_inference) {
  const int64_t n_blocks = plugin.config().n_blocks();
  TrainDocumentKV out{std::vector<std::vector<at::Tensor>>(n_blocks), std::vector<std::vector<at::Tensor>>(n_blocks)};
  if (as_inference) {
    COMB_CHECK(batch.documents.size() == batch.doc_lens.size(),
               "train_document_kv: the batch holds {} documents' tokens for {} rows", batch.documents.size(),
               batch.doc_lens.size());
    std::vector<DocumentKV> docs = plugin.encode_trainable(base, pw, batch.documents);
    for (int64_t k = 0; k < n_blocks; ++k)
      for (auto& d : docs) {
        out.keys[k].push_back(std::move(d.keys[k]));
        out.values[k].push_back(std::move(d.values[k]));
      }
    return out;
  }
  auto [keys, values] = plugin.encode_batch(base, pw, batch.doc_tokens, batch.doc_mask);
  for (int64_t k = 0; k < n_blocks; ++k)
    for (size_t d = 0; d < batch.doc_lens.size(); ++d) {
      out.keys[k].push_back(keys[k][d].narrow(1, 0, batch.doc_lens[d]));
      out.values[k].push_back(values[k][d].narrow(1, 0, batch.doc_lens[d]));
    }
  return out;
}

COMB_INLINE at::Tensor plugin_train_logits(const Decoder& base, const Plugin& plugin, const PluginWeights& pw,
                               const TrainBatch& batch, c10::ScalarType documents_as) {
  // The inference code itself: every document encoded alone (on the CPU with an encoder of the
  // base's own layers, encode_many's batches and kernels, Plugin::encode_trainable; else
  // Plugin::encode_batch's one padded batch), each example's documents read through
  // Plugin::cross_block (comb::cross_attention, differentiable), with `pw` in place of the plug-in's
  // own weights.
  TrainDocumentKV kv = train_document_kv(base, plugin, pw, batch, train_encodes_as_inference(base, plugin, pw));
  std::vector<std::vector<at::Tensor>>& doc_keys = kv.keys;
  std::vector<std::vector<at::Tensor>>& doc_values = kv.values;
  if (documents_as != c10::ScalarType::Undefined)
    for (size_t k = 0; k < doc_keys.size(); ++k)
      for (size_t d = 0; d < doc_keys[k].size(); ++d)
        std::tie(doc_keys[k][d], doc_values[k][d]) = read_as_stored(doc_keys[k][d], doc_values[k][d], documents_as);
  if (plugin.config().joint_attention) {
    // Documents after the prefix: the anchor is the prefix's length, the same in every example.
    int64_t anchor = 0;
    if (plugin.config().documents_after_prefix) {
      COMB_CHECK(batch.prefix_tokens >= 0,
                 "a plug-in with documents after the prefix trains on examples whose prefixes have one length");
      anchor = batch.prefix_tokens;
    }
    DocumentReads reads =
        DocumentReads::joined(plugin, plugin.joint_kv(pw, doc_keys, doc_values, batch.doc_counts, anchor));
    return detail::train::head_logits(base, detail::train::decoder_hidden(base, batch.tokens, &reads),
                                      batch.target_rows);
  }
  DocumentReads reads = DocumentReads::residual(plugin, pw, std::move(doc_keys), std::move(doc_values), batch.doc_counts);
  return detail::train::head_logits(base, detail::train::decoder_hidden(base, batch.tokens, &reads), batch.target_rows);
}

COMB_INLINE at::Tensor full_context_logits(const Decoder& base, const std::vector<TrainExample>& examples, c10::Device device) {
  c10::AutoGradMode no_grad(false);
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int64_t> answer_at;
  int64_t max_n = 1;
  for (const auto& e : examples) {
    std::vector<int32_t> s = e.prefix;
    for (const auto& d : e.documents) s.insert(s.end(), d->begin(), d->end());
    s.insert(s.end(), e.suffix.begin(), e.suffix.end());
    answer_at.push_back(s.size());
    s.insert(s.end(), e.answer.begin(), e.answer.end());
    max_n = std::max<int64_t>(max_n, s.size());
    seqs.push_back(std::move(s));
  }
  std::vector<int64_t> tokens(examples.size() * max_n, 0), rows;
  for (size_t b = 0; b < seqs.size(); ++b) {
    for (size_t t = 0; t < seqs[b].size(); ++t) tokens[b * max_n + t] = seqs[b][t];
    for (size_t j = 0; j < examples[b].answer.size(); ++j) rows.push_back(b * max_n + answer_at[b] - 1 + j);
  }
  at::Tensor t = at::from_blob(tokens.data(), {static_cast<int64_t>(seqs.size()), max_n}, at::kLong).clone().to(device);
  at::Tensor r = at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).clone().to(device);
  return detail::train::head_logits(base, detail::train::decoder_hidden(base, t, nullptr), r);
}

// ================================================================================================
// Self-distillation: teacher answers and their file
// ================================================================================================

namespace detail::train {  // this file's own helpers
COMB_INLINE std::vector<int32_t> full_prompt(const TrainExample& e) {
  std::vector<int32_t> s = e.prefix;
  for (const auto& d : e.documents) s.insert(s.end(), d->begin(), d->end());
  s.insert(s.end(), e.suffix.begin(), e.suffix.end());
  return s;
}
}  // namespace detail::train

namespace detail::train {  // this file's own helpers
// The top-k log-probabilities of the decoder at every answer token of `with` (answers set), in one
// teacher-forced forward, into answers[i] (one per example, in order).
COMB_INLINE void add_top_k(const Decoder& base, const std::vector<TrainExample>& with, int64_t top_k,
                           const std::vector<TeacherAnswer*>& answers) {
  at::Tensor lp = at::log_softmax(full_context_logits(base, with, base.device()), -1);
  const int64_t k = std::min<int64_t>(top_k, lp.size(-1));
  auto [values, ids] = lp.topk(k, -1);
  values = values.to(at::kCPU, at::kFloat).contiguous();
  ids = ids.to(at::kCPU, at::kInt).contiguous();
  const float* v = values.data_ptr<float>();
  const int32_t* id = ids.data_ptr<int32_t>();
  int64_t row = 0;
  for (size_t i = 0; i < with.size(); ++i)
    for (size_t j = 0; j < with[i].answer.size(); ++j, ++row) {
      answers[i]->top_ids.emplace_back(id + row * k, id + (row + 1) * k);
      answers[i]->top_logprobs.emplace_back(v + row * k, v + (row + 1) * k);
    }
}
}  // namespace detail::train

COMB_INLINE TeacherAnswer teacher_answer(const Model& model, const TrainExample& example, int64_t max_tokens, int64_t top_k) {
  COMB_CHECK(max_tokens >= 1 && top_k >= 1, "a teacher answer needs max tokens >= 1 and top-k >= 1 (found {}, {})",
             max_tokens, top_k);
  c10::AutoGradMode no_grad(false);
  GenerateOptions g;
  g.max_tokens = max_tokens;
  GenerationResult r = model.generate(detail::train::full_prompt(example), g);  // no documents: the bare decoder
  TeacherAnswer t;
  t.answer = r.tokens;
  if (r.stop_reason == "stop_token") {
    const ChatTemplate& tmpl = model.chat_template();
    if (auto eot = model.tokenizer().find_token(tmpl.end_of_turn())) t.answer.push_back(*eot);
    else if (auto eos = model.tokenizer().eos_id()) t.answer.push_back(*eos);
  }
  if (t.answer.empty()) return t;  // the decoder ended at once and has no end-of-turn token
  TrainExample with = example;
  with.answer = t.answer;
  detail::train::add_top_k(model.decoder(), {with}, top_k, {&t});
  return t;
}

COMB_INLINE std::vector<TeacherAnswer> teacher_answers(const Model& model, const std::vector<TrainExample>& examples,
                                                      int64_t max_tokens, int64_t top_k) {
  COMB_CHECK(max_tokens >= 1 && top_k >= 1, "teacher answers need max tokens >= 1 and top-k >= 1 (found {}, {})",
             max_tokens, top_k);
  c10::AutoGradMode no_grad(false);
  const Decoder& base = model.decoder();
  const auto device = base.device();
  // The stops of Model::generate; an answer that stopped ends with the end of turn (else end of
  // text), as teacher_answer writes it.
  std::vector<int64_t> stops;
  std::optional<int32_t> ending;
  if (auto eos = model.tokenizer().eos_id()) stops.push_back(*eos), ending = *eos;
  if (auto eot = model.tokenizer().find_token(model.chat_template().end_of_turn())) stops.push_back(*eot), ending = *eot;
  const size_t n = examples.size();
  std::vector<std::vector<int32_t>> seqs(n);
  std::vector<TeacherAnswer> out(n);
  std::vector<size_t> open;
  for (size_t i = 0; i < n; ++i) {
    seqs[i] = detail::train::full_prompt(examples[i]);
    COMB_CHECK(static_cast<int64_t>(seqs[i].size()) + max_tokens <= base.config().n_ctx,
               "a teacher prompt of {} tokens and {} answer tokens exceed the context ({})", seqs[i].size(), max_tokens,
               base.config().n_ctx);
    open.push_back(i);
  }
  for (int64_t step = 0; step < max_tokens && !open.empty(); ++step) {
    int64_t width = 1;
    for (size_t i : open) width = std::max<int64_t>(width, seqs[i].size());
    std::vector<int64_t> tokens(open.size() * width, 0), rows;
    for (size_t b = 0; b < open.size(); ++b) {
      const auto& s = seqs[open[b]];
      std::copy(s.begin(), s.end(), tokens.begin() + b * width);  // padding after: causal, never read
      rows.push_back(b * width + static_cast<int64_t>(s.size()) - 1);
    }
    at::Tensor t = at::from_blob(tokens.data(), {static_cast<int64_t>(open.size()), width}, at::kLong).clone().to(device);
    at::Tensor r = at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).clone().to(device);
    at::Tensor next =
        detail::train::head_logits(base, detail::train::decoder_hidden(base, t, nullptr), r).argmax(-1).to(at::kCPU);
    const int64_t* nx = next.data_ptr<int64_t>();
    std::vector<size_t> still;
    for (size_t b = 0; b < open.size(); ++b) {
      const size_t i = open[b];
      const int32_t token = static_cast<int32_t>(nx[b]);
      if (std::find(stops.begin(), stops.end(), nx[b]) != stops.end()) {
        if (ending) out[i].answer.push_back(*ending);
        continue;
      }
      out[i].answer.push_back(token);
      seqs[i].push_back(token);
      if (static_cast<int64_t>(out[i].answer.size()) < max_tokens) still.push_back(i);
    }
    open = std::move(still);
  }
  // The top-k at every answer token, all examples in one teacher-forced forward.
  std::vector<TrainExample> with;
  std::vector<size_t> which;
  for (size_t i = 0; i < n; ++i)
    if (!out[i].answer.empty()) {
      with.push_back(examples[i]);
      with.back().answer = out[i].answer;
      which.push_back(i);
    }
  if (with.empty()) return out;
  std::vector<TeacherAnswer*> answers;
  for (size_t i : which) answers.push_back(&out[i]);
  detail::train::add_top_k(base, with, top_k, answers);
  return out;
}

COMB_INLINE std::string TeacherCache::key(const TrainExample& e) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  auto part = [&](const std::vector<int32_t>& v) {
    const uint64_t n = v.size();  // lengths too, so that moving a token across a boundary changes the key
    XXH3_128bits_update(st, &n, sizeof n);
    XXH3_128bits_update(st, v.data(), v.size() * sizeof(int32_t));
  };
  part(e.prefix);
  for (const auto& d : e.documents) part(*d);
  part(e.suffix);
  XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

COMB_INLINE TeacherCache::TeacherCache(std::string path, std::string base_fingerprint, int64_t max_tokens, int64_t top_k)
    : path_(std::move(path)), base_(std::move(base_fingerprint)), max_tokens_(max_tokens), top_k_(top_k) {
  COMB_CHECK(max_tokens >= 1 && top_k >= 1, "teacher answers need max tokens >= 1 and top-k >= 1 (found {}, {})",
             max_tokens, top_k);
  const nlohmann::json header = {{"format", "comb-teacher"}, {"version", 1}, {"base", base_},
                                 {"max_tokens", max_tokens_}, {"top_k", top_k_}};
  if (!fs::exists(path_) || fs::file_size(path_) == 0) {
    if (fs::path(path_).has_parent_path()) fs::create_directories(fs::path(path_).parent_path());
    std::ofstream out(path_, std::ios::trunc);
    out << header.dump() << "\n";
    COMB_CHECK(out.good(), "cannot write the teacher file '{}'", path_);
    return;
  }
  std::ifstream in(path_);
  COMB_CHECK(in.good(), "cannot read the teacher file '{}'", path_);
  std::string line;
  std::getline(in, line);
  nlohmann::json h = detail::parse_json(line, fmt::format("'{}' line 1", path_), /*invalid_ok=*/true);
  COMB_CHECK(!h.is_discarded() && h.is_object() && h.value("format", "") == "comb-teacher",
             "'{}' line 1: expected a comb-teacher header, found '{}'", path_, line.substr(0, 80));
  for (const char* field : {"base", "max_tokens", "top_k"})
    COMB_CHECK(h.contains(field) && h[field] == header[field],
               "'{}' holds teacher answers with {} {}, this run needs {}: name another file (--teacher)", path_,
               field, h.contains(field) ? h[field].dump() : "(none)", header[field].dump());
  int64_t line_no = 1, dropped = 0;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  // The last line may lack its newline when a run was stopped while writing it.
  for (size_t i = 0; i < lines.size(); ++i) {
    ++line_no;
    if (lines[i].empty()) continue;
    nlohmann::json j = detail::parse_json(lines[i], fmt::format("'{}' line {}", path_, line_no), /*invalid_ok=*/true);
    if (j.is_discarded() && i + 1 == lines.size()) {
      ++dropped;
      break;
    }
    auto where = [&] { return fmt::format("'{}' line {}", path_, line_no); };
    COMB_CHECK(!j.is_discarded() && j.is_object(), "{}: not a JSON object", where());
    COMB_CHECK(j.contains("key") && j["key"].is_string() && j.contains("answer") && j["answer"].is_array() &&
                   j.contains("top_ids") && j["top_ids"].is_array() && j.contains("top_logprobs") &&
                   j["top_logprobs"].is_array(),
               "{}: expected key, answer, top_ids and top_logprobs", where());
    TeacherAnswer t;
    try {
      t.answer = j["answer"].get<std::vector<int32_t>>();
      t.top_ids = j["top_ids"].get<std::vector<std::vector<int32_t>>>();
      t.top_logprobs = j["top_logprobs"].get<std::vector<std::vector<float>>>();
    } catch (const nlohmann::json::exception&) {
      throw Error(fmt::format("{}: answer and top_ids hold token ids, top_logprobs numbers", where()));
    }
    COMB_CHECK(t.top_ids.size() == t.answer.size() && t.top_logprobs.size() == t.answer.size(),
               "{}: {} answer tokens but {} top_ids and {} top_logprobs rows", where(), t.answer.size(),
               t.top_ids.size(), t.top_logprobs.size());
    for (size_t r = 0; r < t.top_ids.size(); ++r)
      COMB_CHECK(!t.top_ids[r].empty() && t.top_ids[r].size() == t.top_logprobs[r].size() &&
                     static_cast<int64_t>(t.top_ids[r].size()) == top_k_,
                 "{}: row {} has {} ids and {} log-probabilities (expected {} of each)", where(), r,
                 t.top_ids[r].size(), t.top_logprobs[r].size(), top_k_);
    entries_[j["key"].get<std::string>()] = std::move(t);
  }
  if (dropped) {
    log(LogLevel::warning, "teacher file '{}': dropped a last line cut short (an interrupted run)", path_);
    // Rewrite without it, so that new lines do not follow a broken one.
    std::string tmp = path_ + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << h.dump() << "\n";
      for (size_t i = 0; i + 1 < lines.size(); ++i)
        if (!lines[i].empty()) out << lines[i] << "\n";
      COMB_CHECK(out.good(), "cannot write '{}'", tmp);
    }
    fs::rename(tmp, path_);
  }
}

COMB_INLINE const TeacherAnswer* TeacherCache::find(const std::string& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second;
}

COMB_INLINE const TeacherAnswer& TeacherCache::add(const std::string& key, TeacherAnswer answer) {
  nlohmann::json j = {{"key", key}, {"answer", answer.answer}, {"top_ids", answer.top_ids},
                      {"top_logprobs", answer.top_logprobs}};
  std::ofstream out(path_, std::ios::app);
  out << j.dump() << "\n";
  out.flush();
  COMB_CHECK(out.good(), "cannot append to the teacher file '{}'", path_);
  return entries_[key] = std::move(answer);
}

COMB_INLINE at::Tensor top_k_kl(const at::Tensor& student_logits, const at::Tensor& top_ids, const at::Tensor& top_logprobs) {
  COMB_CHECK(student_logits.dim() == 2 && top_ids.dim() == 2 && top_ids.sizes() == top_logprobs.sizes() &&
                 top_ids.size(0) == student_logits.size(0),
             "top_k_kl: expected logits [m, vocab] and top ids/log-probabilities [m, k], found [{}], [{}] and [{}]",
             fmt::join(student_logits.sizes(), ", "), fmt::join(top_ids.sizes(), ", "),
             fmt::join(top_logprobs.sizes(), ", "));
  at::Tensor lq = at::log_softmax(student_logits.to(at::kFloat), -1).gather(1, top_ids);  // [m, k]
  at::Tensor lp = top_logprobs.to(at::kFloat);
  at::Tensor p = lp.exp();
  // The rest of the vocabulary as one bucket: 1 - the top-k mass (kept above 1e-12).
  at::Tensor p_rest = (1 - p.sum(-1)).clamp_min(1e-12);
  at::Tensor q_rest = (1 - lq.exp().sum(-1)).clamp_min(1e-12);
  at::Tensor kl = (p * (lp - lq)).sum(-1) + p_rest * (p_rest.log() - q_rest.log());
  return kl.mean();
}

// ================================================================================================
// The loop
// ================================================================================================

COMB_INLINE std::vector<std::pair<std::string, at::Tensor*>> plugin_parameters(const PluginConfig& config, PluginWeights& w) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  auto add = [&](std::string name, at::Tensor* t) {
    if (t->defined()) out.emplace_back(std::move(name), t);  // a layout leaves some out
  };
  if (!config.encoder_from_base)
    for (size_t j = 0; j < w.encoder.size(); ++j) {
      auto& l = w.encoder[j];
      std::string p = fmt::format("encoder.{}.", j);
      for (auto [name, t] : {std::pair{"attn_norm", &l.attn_norm}, {"wqkv", &l.wqkv}, {"wo", &l.wo},
                             {"ffn_norm", &l.ffn_norm}, {"w_gate_up", &l.w_gate_up}, {"w_down", &l.w_down}})
        add(p + name, t);
    }
  for (size_t k = 0; k < w.wk.size(); ++k) {
    if (k < w.kv_norm.size()) add(fmt::format("kv_norm.{}", k), &w.kv_norm[k]);
    add(fmt::format("wk.{}", k), &w.wk[k]);
    add(fmt::format("wv.{}", k), &w.wv[k]);
  }
  for (size_t k = 0; k < w.cross.size(); ++k) {
    auto& b = w.cross[k];
    std::string p = fmt::format("cross.{}.", k);
    for (auto [name, t] : {std::pair{"attn_norm", &b.attn_norm}, {"wq", &b.wq}, {"q_norm", &b.q_norm},
                           {"k_norm", &b.k_norm}, {"wo", &b.wo}, {"attn_gate", &b.attn_gate}, {"sinks", &b.sinks},
                           {"ffn_norm", &b.ffn_norm}, {"w_gate_up", &b.w_gate_up}, {"w_down", &b.w_down},
                           {"mlp_gate", &b.mlp_gate}, {"doc_bias", &b.doc_bias}})
      add(p + name, t);
  }
  return out;
}

namespace detail::train {  // this file's own helpers
COMB_INLINE double lr_at(const TrainOptions& o, int64_t step) {  // step: 0-based optimizer step
  if (step < o.warmup_steps) return o.lr * (step + 1) / o.warmup_steps;
  double span = std::max<int64_t>(1, o.steps - o.warmup_steps);
  double progress = std::min(1.0, (step - o.warmup_steps) / span);
  return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}
// A step-keyed CSV log written anew with `header` and the rows of the steps up to `step` it already
// held (what a run resumed at `step` keeps; step 0: none). A row whose step does not parse is dropped.
COMB_INLINE std::ofstream open_step_log(const fs::path& path, const std::string& header, int64_t step) {
  std::vector<std::string> kept;
  if (step > 0) {
    std::ifstream in(path);
    std::string line;
    if (std::getline(in, line))
      while (std::getline(in, line)) {
        int64_t at = 0;
        const char* end = line.data() + line.size();
        auto [ptr, ec] = std::from_chars(line.data(), end, at);
        if (ec == std::errc() && ptr != end && *ptr == ',' && at <= step) kept.push_back(line);
      }
  }
  std::ofstream out(path, std::ios::trunc);
  COMB_CHECK(out.good(), "cannot write '{}'", path.string());
  out << header << "\n";
  for (const auto& r : kept) out << r << "\n";
  out.flush();
  return out;
}
}  // namespace detail::train

namespace detail::train {  // this file's own helpers

// ---- Optimizer and checkpoint -----------------------------------------------------------------

// AdamW over the plug-in's float32 masters (plugin_parameters()), its moments kept beside the
// checkpoint: `dir`/checkpoint.safetensors (the plug-in) and `dir`/optimizer.safetensors (m, v and
// the step), written so that the two agree whenever both exist.
struct Optimizer {
  static constexpr double b1 = 0.9, b2 = 0.95, eps = 1e-8;
  fs::path ckpt, optim;
  std::vector<std::pair<std::string, at::Tensor*>> params;
  std::vector<at::Tensor> m, v;

  explicit Optimizer(const std::string& dir)
      : ckpt(fs::path(dir) / "checkpoint.safetensors"), optim(fs::path(dir) / "optimizer.safetensors") {}

  // The step to start from: the checkpoint's (and `plugin` replaced by it) when `resume` finds one, else 0.
  int64_t resume(bool resume, Plugin& plugin, const Decoder& base) {
    params = plugin_parameters(plugin.config(), plugin.mutable_weights());
    if (!resume || !fs::exists(ckpt) || !fs::exists(optim)) return 0;
    Plugin saved = Plugin::load(ckpt.string(), base);
    COMB_CHECK(saved.config().cross_layers == plugin.config().cross_layers,
               "'{}' holds a plug-in with cross blocks before layers [{}], not [{}]: use another --dir", ckpt.string(),
               fmt::join(saved.config().cross_layers, ", "), fmt::join(plugin.config().cross_layers, ", "));
    plugin = saved;
    params = plugin_parameters(plugin.config(), plugin.mutable_weights());
    SafetensorsFile f(optim.string());
    auto it = f.metadata().find("step");
    COMB_CHECK(it != f.metadata().end(), "'{}' has no 'step' metadata", optim.string());
    const int64_t step = std::stoll(it->second);
    WeightReader r(f, at::kFloat, base.device());
    for (auto& [name, p] : params) {
      m.push_back(r.get("m." + name, p->sizes().vec()));
      v.push_back(r.get("v." + name, p->sizes().vec()));
    }
    r.finish(fmt::format("'{}' does not match the plug-in", optim.string()));
    return step;
  }

  // The masters made float32 on `device` and taking gradients; fresh moments where none were read.
  void start(c10::Device device) {
    for (auto& [name, p] : params) {
      at::Tensor t = p->detach().to(device, at::kFloat).clone();
      t.set_requires_grad(true);
      *p = t;
    }
    if (m.empty())
      for (auto& [name, p] : params) {
        m.push_back(at::zeros_like(*p).detach());
        v.push_back(at::zeros_like(*p).detach());
      }
  }

  // One update from the accumulated gradients (0-based optimizer step `step`): the global norm,
  // clipping, AdamW (no decay on vectors, the gates' own learning rate). Returns the norm.
  double update(const TrainOptions& o, int64_t step) {
    c10::AutoGradMode no_grad(false);
    std::vector<at::Tensor> sq;
    for (auto& [name, p] : params)
      if (p->grad().defined()) sq.push_back(p->grad().pow(2).sum());
    const double norm = sq.empty() ? 0.0 : std::sqrt(at::stack(sq).sum().item<double>());
    double clip_scale = (o.clip > 0 && norm > o.clip) ? o.clip / (norm + 1e-6) : 1.0;
    const double lr = lr_at(o, step);
    const double bc1 = 1 - std::pow(b1, step + 1), bc2 = 1 - std::pow(b2, step + 1);
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& p = *params[i].second;
      if (!p.grad().defined()) continue;
      at::Tensor g = p.grad();
      if (clip_scale != 1.0) g = g * clip_scale;
      const bool is_gate = params[i].first.find("gate") != std::string::npos && p.dim() == 1 && p.numel() == 1;
      const bool decay = p.dim() >= 2;
      const double plr = lr * (is_gate ? o.gate_lr_scale : 1.0);
      m[i].mul_(b1).add_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      if (decay && o.weight_decay > 0) p.data().mul_(1 - plr * o.weight_decay);
      p.data().addcdiv_(m[i] / bc1, (v[i] / bc2).sqrt_().add_(eps), -plr);
      p.mutable_grad().reset();
    }
    return norm;
  }

  // The plug-in and the moments after `at_step` steps, written whole or not at all.
  void save(Plugin& plugin, int64_t at_step, uint64_t seed) {
    plugin.refresh_fingerprint();
    fs::path tmp = ckpt;
    tmp += ".tmp";
    plugin.save(tmp.string());  // written whole or not at all, then renamed after the optimizer state
    std::vector<std::pair<std::string, at::Tensor>> state;
    for (size_t i = 0; i < params.size(); ++i) {
      state.emplace_back("m." + params[i].first, m[i]);
      state.emplace_back("v." + params[i].first, v[i]);
    }
    save_safetensors(optim.string(), state, {{"format", "pt"}, {"step", std::to_string(at_step)}, {"seed", std::to_string(seed)}});
    fs::rename(tmp, ckpt);  // the checkpoint last: it and the optimizer state agree when both exist
  }
};

// ---- Data: a micro-batch's examples and their targets --------------------------------------------

// The examples of (seed, step, micro-batch), fixed: a resumed run sees what it would have. With a
// teacher, each example's target becomes the decoder's own answer (computed once, then from the
// file); an example the decoder answers with nothing at all teaches nothing and is left out, and
// `taught` receives each kept example's answer.
COMB_INLINE std::vector<TrainExample> micro_batch(const Model& model, const TrainData& data, const TrainOptions& o,
                                                  int64_t step, int64_t micro, TeacherCache* teacher,
                                                  bool batched_teacher, std::vector<const TeacherAnswer*>& taught,
                                                  TrainResult& result) {
  std::mt19937_64 rng(o.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) * 1000003ull + micro);
  std::vector<TrainExample> examples;
  for (int64_t i = 0; i < o.batch_size; ++i) examples.push_back(data.sample(rng));
  taught.clear();
  if (!teacher) return examples;
  std::vector<TrainExample> kept;
  if (batched_teacher) {  // the answers the file lacks, computed together first
    std::vector<TrainExample> missing;
    std::vector<std::string> keys;
    for (const auto& e : examples) {
      std::string key = TeacherCache::key(e);
      if (!teacher->find(key) && std::find(keys.begin(), keys.end(), key) == keys.end()) {
        missing.push_back(e);
        keys.push_back(std::move(key));
      }
    }
    if (!missing.empty()) {
      std::vector<TeacherAnswer> got = teacher_answers(model, missing, o.teacher_tokens, o.teacher_top_k);
      for (size_t i = 0; i < got.size(); ++i) teacher->add(keys[i], std::move(got[i]));
      result.teacher_computed += static_cast<int64_t>(got.size());
      result.teacher_reused -= static_cast<int64_t>(got.size());  // found below, computed here
    }
  }
  for (auto& e : examples) {
    const std::string key = TeacherCache::key(e);
    const TeacherAnswer* t = teacher->find(key);
    if (!t) {
      t = &teacher->add(key, teacher_answer(model, e, o.teacher_tokens, o.teacher_top_k));
      ++result.teacher_computed;
    } else {
      ++result.teacher_reused;
    }
    if (t->answer.empty()) continue;
    e.answer = t->answer;
    kept.push_back(std::move(e));
    taught.push_back(t);
  }
  return kept;
}

// ---- The objective ----------------------------------------------------------------------------

// One micro-batch's loss: cross-entropy of the targets, plus kl_weight times the KL divergence to
// the teacher (its stored top-k, or with gold targets the full-context distribution), and with
// reading_check the cross-entropy of the same targets with each example reading the next one's
// documents (no gradient: what reading buys).
struct MicroLoss {
  at::Tensor loss, ce;
  double kl = 0, ce_swapped = 0;
  bool swapped = false;  // ce_swapped was measured
  int64_t real_tokens = 0;
};
COMB_INLINE MicroLoss micro_loss(const Decoder& base, Plugin& plugin, const std::vector<TrainExample>& examples,
                                 const std::vector<const TeacherAnswer*>& taught, bool teacher, const TrainOptions& o,
                                 c10::Device device) {
  MicroLoss out;
  TrainBatch batch = make_train_batch(examples, device);
  at::Tensor logits = plugin_train_logits(base, plugin, plugin.weights(), batch, o.document_dtype);
  out.ce = at::cross_entropy_loss(logits, batch.targets);
  out.loss = out.ce;
  out.real_tokens = batch.real_tokens;
  if (o.kl_weight > 0 && teacher) {
    // The stored top-k of the teacher at each of its own answer tokens (rows in batch order).
    std::vector<int64_t> ids;
    std::vector<float> lps;
    for (const TeacherAnswer* t : taught)
      for (size_t r = 0; r < t->answer.size(); ++r) {
        ids.insert(ids.end(), t->top_ids[r].begin(), t->top_ids[r].end());
        lps.insert(lps.end(), t->top_logprobs[r].begin(), t->top_logprobs[r].end());
      }
    const int64_t rows = logits.size(0), k = o.teacher_top_k;
    at::Tensor top_ids = at::from_blob(ids.data(), {rows, k}, at::kLong).clone().to(device);
    at::Tensor top_lp = at::from_blob(lps.data(), {rows, k}, at::kFloat).clone().to(device);
    at::Tensor kl = top_k_kl(logits, top_ids, top_lp);
    out.loss = out.loss + o.kl_weight * kl;
    out.kl = kl.item<double>();
  } else if (o.kl_weight > 0) {
    at::Tensor full = at::log_softmax(full_context_logits(base, examples, device), -1);
    at::Tensor kl = at::kl_div(at::log_softmax(logits, -1), full, at::Reduction::None, /*log_target=*/true)
                        .sum(-1)
                        .mean();
    out.loss = out.loss + o.kl_weight * kl;
    out.kl = kl.item<double>();
  }
  if (o.reading_check && examples.size() >= 2) {
    c10::AutoGradMode no_grad(false);
    std::vector<TrainExample> swapped = examples;
    for (size_t i = 0; i < swapped.size(); ++i) swapped[i].documents = examples[(i + 1) % examples.size()].documents;
    TrainBatch sb = make_train_batch(swapped, device);
    at::Tensor sl = plugin_train_logits(base, plugin, plugin.weights(), sb, o.document_dtype);
    out.ce_swapped = at::cross_entropy_loss(sl, sb.targets).item<double>();
    out.swapped = true;
  }
  return out;
}

// ---- Progress: the loss log and the dev log ---------------------------------------------------

// Sums over the steps since the last log line.
struct Window {
  double loss = 0, ce = 0, kl = 0, tokens = 0, swapped = 0;
  int64_t steps = 0, swapped_steps = 0;
  std::chrono::steady_clock::time_point t0;
};

// Writes the window's line to `csv` (and on_progress), then starts a new window.
COMB_INLINE void log_window(Window& w, const Plugin& plugin, const TrainOptions& o, int64_t step, int64_t first,
                            double norm, std::chrono::steady_clock::time_point t0, std::ofstream& csv,
                            TrainResult& result) {
  auto now = std::chrono::steady_clock::now();
  double secs = std::chrono::duration<double>(now - w.t0).count();
  double tps = w.tokens / std::max(secs, 1e-9);
  // Joint blocks have no gates: their column is NaN.
  double attn_gate = plugin.config().joint_attention ? std::nan("") : 0.0, mlp_gate = 0;
  for (const auto& b : plugin.weights().cross) {
    if (b.attn_gate.defined()) attn_gate += std::tanh(b.attn_gate.item<double>());
    if (b.mlp_gate.defined()) mlp_gate += std::tanh(b.mlp_gate.item<double>());
  }
  attn_gate /= plugin.weights().cross.size();
  mlp_gate /= plugin.weights().cross.size();
  result.last_loss = w.loss / w.steps;
  const double ce_swapped = w.swapped_steps ? w.swapped / w.swapped_steps : std::nan("");
  csv << fmt::format("{},{:.5f},{:.5f},{:.5f},{:.3e},{:.4f},{:.0f},{:.4f},{:.4f},{:.5f}\n", step + 1, result.last_loss,
                     w.ce / w.steps, w.kl / w.steps, lr_at(o, step), norm, tps, attn_gate, mlp_gate, ce_swapped);
  csv.flush();
  if (o.on_progress) {
    TrainProgress pr;
    pr.step = step + 1;
    pr.steps = o.steps;
    pr.loss = result.last_loss;
    pr.lr = lr_at(o, step);
    pr.grad_norm = norm;
    pr.tokens_per_s = tps;
    pr.attn_gate = attn_gate;
    pr.mlp_gate = mlp_gate;
    pr.ce = w.ce / w.steps;
    pr.ce_swapped = ce_swapped;
    pr.elapsed_s = std::chrono::duration<double>(now - t0).count();
    pr.eta_s = pr.elapsed_s / (step + 1 - first) * (o.steps - step - 1);
    o.on_progress(pr);
  }
  w = Window{};
  w.t0 = now;
}

// The dev check on a detached copy of the plug-in, one line of `dev_csv`.
COMB_INLINE void dev_check(const Plugin& plugin, const TrainOptions& o, int64_t at_step, std::ofstream& dev_csv,
                           TrainResult& result) {
  auto started = std::chrono::steady_clock::now();
  Plugin snapshot = plugin;  // tensors shared; detached below in the copy only
  {
    at::NoGradGuard no_grad;
    for (auto& [name, p] : plugin_parameters(snapshot.config(), snapshot.mutable_weights())) *p = p->detach();
    snapshot.refresh_fingerprint();
  }
  const DevCheck d = o.dev_check(snapshot);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  dev_csv << fmt::format("{},{:.5f},{},{:.1f}\n", at_step, d.accuracy, d.items, secs);
  dev_csv.flush();
  result.dev_accuracy = d.accuracy;
}
}  // namespace detail::train

// ---- The loop ---------------------------------------------------------------------------------

COMB_INLINE TrainResult train_plugin(const Model& model, Plugin& plugin, const TrainData& data, const TrainOptions& o) {
  COMB_CHECK(o.steps > 0 && o.batch_size > 0 && o.accumulation > 0,
             "steps ({}), batch ({}) and accumulation ({}) must be > 0", o.steps, o.batch_size, o.accumulation);
  COMB_CHECK(o.lr > 0 && o.warmup_steps >= 0 && o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1,
             "need lr > 0, warmup >= 0 and min lr ratio in [0, 1] (found {}, {}, {})", o.lr, o.warmup_steps,
             o.min_lr_ratio);
  COMB_CHECK(o.targets == "gold" || o.targets == "teacher",
             "targets must be gold (the items' answers) or teacher (the decoder's own full-context answers), found '{}'",
             o.targets);
  COMB_CHECK(!o.dir.empty(), "training needs a directory for its checkpoints and loss log (--dir)");
  const Decoder& base = model.decoder();
  const c10::Device device = base.device();
  fs::create_directories(o.dir);
  TrainResult result;
  detail::train::Optimizer opt(o.dir);
  int64_t step = opt.resume(o.resume, plugin, base);
  if (step > 0) {
    result.resumed_from = step;
    log(LogLevel::info, "train: resuming from step {} ({})", step, opt.ckpt.string());
  }
  COMB_CHECK(o.open_gates >= 0 && o.open_gates < 1, "open gates must be in [0, 1), found {}", o.open_gates);
  if (step == 0 && o.open_gates > 0)
    // Closed gates pass no gradient to the blocks' weights; opened a little, they learn from the start.
    for (auto& b : plugin.mutable_weights().cross)
      if (b.attn_gate.defined()) b.attn_gate = at::full_like(b.attn_gate, std::atanh(o.open_gates));
  // fp32 masters that take gradients; the forward casts them to the decoder's dtype.
  opt.start(device);
  // Loss log: keep rows of steps already done (a resumed run rewrites the rest).
  std::ofstream csv = detail::train::open_step_log(
      fs::path(o.dir) / "loss.csv", "step,loss,ce,kl,lr,grad_norm,tokens_per_s,attn_gate_mean,mlp_gate_mean,ce_swapped",
      step);
  // The dev log, kept the same way; opened only when there is a dev check.
  COMB_CHECK(o.dev_every >= 0, "dev checks every {} steps: expected >= 0 (0: none)", o.dev_every);
  const bool dev_checks = o.dev_check && o.dev_every > 0;
  std::ofstream dev_csv;
  if (dev_checks)
    dev_csv = detail::train::open_step_log(fs::path(o.dir) / "dev.csv", "step,accuracy,items,seconds", step);

  std::unique_ptr<TeacherCache> teacher;
  const bool batched_teacher = o.teacher_batched < 0 ? !device.is_cpu() : o.teacher_batched > 0;
  if (o.targets == "teacher") {
    const std::string path = o.teacher_file.empty() ? (fs::path(o.dir) / "teacher.jsonl").string() : o.teacher_file;
    teacher = std::make_unique<TeacherCache>(path, base_fingerprint(base), o.teacher_tokens, o.teacher_top_k);
    log(LogLevel::info, "train: targets are the decoder's own answers with the documents in context; {} kept in '{}'",
        teacher->size(), path);
  }

  auto t0 = std::chrono::steady_clock::now();
  detail::train::Window window;
  window.t0 = t0;
  const int64_t first = step;
  std::vector<const TeacherAnswer*> taught;
  for (; step < o.steps; ++step) {
    double step_loss = 0, step_ce = 0, step_kl = 0, step_swapped = 0;
    int64_t swapped_micro = 0;
    for (int64_t micro = 0; micro < o.accumulation; ++micro) {
      std::vector<TrainExample> examples = detail::train::micro_batch(model, data, o, step, micro, teacher.get(),
                                                                      batched_teacher, taught, result);
      if (examples.empty()) continue;
      detail::train::MicroLoss l = detail::train::micro_loss(base, plugin, examples, taught, teacher != nullptr, o, device);
      step_kl += l.kl / o.accumulation;
      if (l.swapped) {
        step_swapped += l.ce_swapped / o.accumulation;
        ++swapped_micro;
      }
      (l.loss / o.accumulation).backward();
      step_loss += l.loss.item<double>() / o.accumulation;
      step_ce += l.ce.item<double>() / o.accumulation;
      window.tokens += l.real_tokens;
    }
    COMB_CHECK(std::isfinite(step_loss), "training diverged at step {} (loss {}); the last checkpoint is in '{}'",
               step, step_loss, o.dir);
    const double norm = opt.update(o, step);
    window.loss += step_loss;
    window.ce += step_ce;
    window.kl += step_kl;
    if (swapped_micro == o.accumulation) {
      window.swapped += step_swapped;
      ++window.swapped_steps;
    }
    ++window.steps;
    const bool last = step + 1 == o.steps;
    if ((step + 1) % o.log_every == 0 || last) detail::train::log_window(window, plugin, o, step, first, norm, t0, csv, result);
    if ((step + 1) % o.save_every == 0 || last) opt.save(plugin, step + 1, o.seed);
    if (dev_checks && ((step + 1) % o.dev_every == 0 || last)) detail::train::dev_check(plugin, o, step + 1, dev_csv, result);
  }
  for (auto& [name, p] : opt.params) *p = p->detach();
  plugin.refresh_fingerprint();
  result.steps = step;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace comb
