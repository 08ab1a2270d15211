// The Llama weight table: every checkpoint tensor's name, shape and slot; reading them (float, or kept quantized), the fingerprint of the base, and the Hugging Face names to save them under.
// Compiled into libcomb (src/weights.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <xxhash.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "comb/error.hpp"
#include "comb/detail/hash.hpp"
#include "comb/weights.hpp"

namespace comb {

namespace detail::weights {  // this file's own helpers

enum class Dim { vocab, embd, ff, q, kv, half_head };
enum class Slot { tok_embd, output_norm, output, rope_freqs, attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down };

struct WeightSpec {
  const char* gguf;  // "{}" stands for the layer index
  const char* hf;
  Slot slot;
  std::vector<Dim> shape;
  bool per_layer;
  bool required;
};

// NOTE: one table for both layouts. GGUF's attn_q/attn_k rows are un-permuted on load (below).
COMB_INLINE const std::vector<WeightSpec>& llama_table() {
  static const std::vector<WeightSpec> table = {
      {"token_embd.weight", "model.embed_tokens.weight", Slot::tok_embd, {Dim::vocab, Dim::embd}, false, true},
      {"output_norm.weight", "model.norm.weight", Slot::output_norm, {Dim::embd}, false, true},
      {"output.weight", "lm_head.weight", Slot::output, {Dim::vocab, Dim::embd}, false, false},
      {"rope_freqs.weight", "", Slot::rope_freqs, {Dim::half_head}, false, false},
      {"blk.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight", Slot::attn_norm, {Dim::embd}, true, true},
      {"blk.{}.attn_q.weight", "model.layers.{}.self_attn.q_proj.weight", Slot::wq, {Dim::q, Dim::embd}, true, true},
      {"blk.{}.attn_k.weight", "model.layers.{}.self_attn.k_proj.weight", Slot::wk, {Dim::kv, Dim::embd}, true, true},
      {"blk.{}.attn_v.weight", "model.layers.{}.self_attn.v_proj.weight", Slot::wv, {Dim::kv, Dim::embd}, true, true},
      {"blk.{}.attn_output.weight", "model.layers.{}.self_attn.o_proj.weight", Slot::wo, {Dim::embd, Dim::q}, true, true},
      {"blk.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight", Slot::ffn_norm, {Dim::embd}, true,
       true},
      {"blk.{}.ffn_gate.weight", "model.layers.{}.mlp.gate_proj.weight", Slot::w_gate, {Dim::ff, Dim::embd}, true, true},
      {"blk.{}.ffn_up.weight", "model.layers.{}.mlp.up_proj.weight", Slot::w_up, {Dim::ff, Dim::embd}, true, true},
      {"blk.{}.ffn_down.weight", "model.layers.{}.mlp.down_proj.weight", Slot::w_down, {Dim::embd, Dim::ff}, true, true},
  };
  return table;
}

COMB_INLINE int64_t dim_size(Dim d, const ModelConfig& c) {
  switch (d) {
    case Dim::vocab: return c.n_vocab;
    case Dim::embd: return c.n_embd;
    case Dim::ff: return c.n_ff;
    case Dim::q: return c.q_dim();
    case Dim::kv: return c.kv_dim();
    case Dim::half_head: return c.head_dim / 2;
  }
  return 0;
}

COMB_INLINE std::string name_for(const char* pattern, int64_t layer) {
  std::string s = pattern;
  size_t at = s.find("{}");
  if (at != std::string::npos) s.replace(at, 2, std::to_string(layer));
  return s;
}

// GGUF converters interleave the two rotary halves of each head; restore rotate-half order.
COMB_INLINE at::Tensor unpermute_heads(const at::Tensor& w, int64_t n_heads) {
  int64_t rows = w.size(0), cols = w.size(1);
  return w.reshape({n_heads, rows / n_heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
}

}  // namespace detail::weights

COMB_INLINE LlamaWeights load_llama_weights(const TensorSource& source, const ModelConfig& config, c10::ScalarType dtype,
                                c10::Device device, const std::string& hf_prefix, bool keep_quantized) {
  COMB_CHECK(!keep_quantized || (device.is_cpu() && dtype == at::kFloat),
             "weights kept quantized run on the CPU in float32 only (asked: {} {})", device.str(), c10::toString(dtype));
  using Slot = detail::weights::Slot;  // the helper enum, named once for this function
  struct Found {
    const detail::weights::WeightSpec* spec;
    int64_t layer;
    std::string name;
    bool gguf_layout;
  };
  std::vector<Found> found;
  std::vector<std::string> problems;
  for (const auto& spec : detail::weights::llama_table()) {
    for (int64_t layer = 0; layer < (spec.per_layer ? config.n_layer : 1); ++layer) {
      std::string gguf = detail::weights::name_for(spec.gguf, layer),
                  hf = spec.hf[0] ? hf_prefix + detail::weights::name_for(spec.hf, layer) : "";
      const TensorInfo* info = source.find(gguf);
      bool gguf_layout = info != nullptr;
      if (!info && !hf.empty()) info = source.find(hf);
      if (!info) {
        if (spec.required) problems.push_back(fmt::format("missing '{}'", hf.empty() ? gguf : hf));
        continue;
      }
      std::vector<int64_t> want;
      for (detail::weights::Dim d : spec.shape) want.push_back(detail::weights::dim_size(d, config));
      if (info->shape != want) {
        problems.push_back(fmt::format("'{}' has shape [{}], expected [{}]", info->name, fmt::join(info->shape, ", "),
                                       fmt::join(want, ", ")));
        continue;
      }
      found.push_back({&spec, layer, info->name, gguf_layout});
    }
  }
  COMB_CHECK(problems.empty(), "'{}': {} weight problem(s) for a {}-layer llama (n_embd {}, n_ff {}, {} heads, {} kv "
             "heads, vocab {}):\n  {}",
             source.where(), problems.size(), config.n_layer, config.n_embd, config.n_ff, config.n_head,
             config.n_head_kv, config.n_vocab, fmt::join(problems, "\n  "));

  LlamaWeights w;
  w.layers.resize(config.n_layer);
  std::vector<at::Tensor> wq(config.n_layer), wk(config.n_layer), wv(config.n_layer), wg(config.n_layer),
      wu(config.n_layer);
  // Kept quantized: a layer whose seven matrices are all stored in groups, q|k|v of one kind and
  // gate|up of one kind; the embedding and the head each on their own.
  auto grouped_type = [&](const std::string& name) {
    const std::string& t = source.find(name)->dtype;
    return t == "Q4_0" ? 40 : t == "Q4_1" ? 41 : t == "Q8_0" ? 8 : 0;
  };
  auto is_matrix = [](Slot s) {
    return s == Slot::wq || s == Slot::wk || s == Slot::wv || s == Slot::wo || s == Slot::w_gate || s == Slot::w_up ||
           s == Slot::w_down;
  };
  std::vector<std::map<Slot, int>> kinds(config.n_layer);
  std::map<Slot, int> head_kinds;
  if (keep_quantized)
    for (const auto& f : found) {
      if (is_matrix(f.spec->slot)) kinds[f.layer][f.spec->slot] = grouped_type(f.name);
      if (f.spec->slot == Slot::tok_embd || f.spec->slot == Slot::output) head_kinds[f.spec->slot] = grouped_type(f.name);
    }
  std::vector<bool> layer_quantized(config.n_layer, false);
  // Every matrix is whole groups of 32 wide.
  const bool shapes_fit = config.n_embd % 32 == 0 && config.q_dim() % 32 == 0 && config.n_ff % 32 == 0;
  for (int64_t i = 0; keep_quantized && shapes_fit && i < config.n_layer; ++i) {
    auto& k = kinds[i];
    bool all = k.size() == 7;
    for (const auto& [slot, kind] : k) all = all && kind != 0;
    layer_quantized[i] = all && k[Slot::wq] == k[Slot::wk] && k[Slot::wk] == k[Slot::wv] && k[Slot::w_gate] == k[Slot::w_up];
  }
  std::vector<std::map<Slot, GroupedWeights>> grouped(config.n_layer);
  // Kept quantized: each layer is packed as soon as its seven matrices are read (layer by layer, so
  // the unpacked integers of one layer at most are held), and the fingerprint of the float load is
  // hashed from exact dequantizations, the embedding in chunks of rows.
  if (keep_quantized)
    std::stable_sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.layer < b.layer; });
  // The checkpoint's own values of layer 0's q|k|v and of the embedding, where the groups hold them
  // (as stored, not quantized on load), for the fingerprint.
  at::Tensor wqkv0_exact;
  std::optional<GroupedWeights> tok_grouped;
  // A tensor as the float load reads it: converted to `dt`, q and k rows in rotate-half order.
  auto read_dense = [&](const Found& f, c10::ScalarType dt) {
    at::Tensor t = source.load(f.name, dt);
    if (f.gguf_layout && f.spec->slot == Slot::wq) t = detail::weights::unpermute_heads(t, config.n_head);
    if (f.gguf_layout && f.spec->slot == Slot::wk) t = detail::weights::unpermute_heads(t, config.n_head_kv);
    return t;
  };
  auto pack_layer = [&](int64_t i) {
    auto& g = grouped[i];
    GroupedWeights qkv = GroupedWeights::cat({g[Slot::wq], g[Slot::wk], g[Slot::wv]});
    if (i == 0 && qkv.as_stored) wqkv0_exact = qkv.dequantize();
    auto q = std::make_shared<QuantizedLayer>();
    q->wqkv = QuantizedMatrix::from(qkv);
    q->wo = QuantizedMatrix::from(g[Slot::wo]);
    q->w_gate_up = QuantizedMatrix::from(GroupedWeights::cat({g[Slot::w_gate], g[Slot::w_up]}));
    q->w_down = QuantizedMatrix::from(g[Slot::w_down]);
    w.layers[i].quantized = std::move(q);
    g.clear();
  };
  for (const auto& f : found) {
    const bool head = f.spec->slot == Slot::tok_embd || f.spec->slot == Slot::output;
    if ((is_matrix(f.spec->slot) && layer_quantized[f.layer]) || (head && head_kinds[f.spec->slot] != 0)) {
      try {
        GroupedWeights g = *source.load_grouped(f.name);
        if (f.gguf_layout && (f.spec->slot == Slot::wq || f.spec->slot == Slot::wk)) {
          at::Tensor order =
              detail::weights::unpermute_heads(at::arange(g.rows(), at::kLong).unsqueeze(1),
                                               f.spec->slot == Slot::wq ? config.n_head : config.n_head_kv)
                  .squeeze(1);
          g = g.select_rows(order);
        }
        if (f.spec->slot == Slot::tok_embd) {
          w.tok_embd_q = std::make_shared<const QuantizedMatrix>(QuantizedMatrix::from(g));
          if (g.as_stored) tok_grouped = std::move(g);
        } else if (f.spec->slot == Slot::output) w.output_q = std::make_shared<const QuantizedMatrix>(QuantizedMatrix::from(g));
        else if ((grouped[f.layer][f.spec->slot] = std::move(g), grouped[f.layer].size() == 7)) pack_layer(f.layer);
      } catch (const Error& e) {
        problems.push_back(e.what());
      }
      continue;
    }
    at::Tensor t;
    try {
      t = read_dense(f, f.spec->slot == Slot::rope_freqs ? at::kFloat : dtype);
    } catch (const Error& e) {
      problems.push_back(e.what());
      continue;
    }
    t = t.to(device);
    auto& l = w.layers[f.layer];
    switch (f.spec->slot) {
      case Slot::tok_embd: w.tok_embd = t; break;
      case Slot::output_norm: w.output_norm = t; break;
      case Slot::output: w.output = t; break;
      case Slot::rope_freqs: w.rope_freqs = t; break;
      case Slot::attn_norm: l.attn_norm = t; break;
      case Slot::wq: wq[f.layer] = t; break;
      case Slot::wk: wk[f.layer] = t; break;
      case Slot::wv: wv[f.layer] = t; break;
      case Slot::wo: l.wo = t; break;
      case Slot::ffn_norm: l.ffn_norm = t; break;
      case Slot::w_gate: wg[f.layer] = t; break;
      case Slot::w_up: wu[f.layer] = t; break;
      case Slot::w_down: l.w_down = t; break;
    }
  }
  COMB_CHECK(problems.empty(), "'{}': cannot read {} weight(s):\n  {}", source.where(), problems.size(),
             fmt::join(problems, "\n  "));
  if (w.quantized()) {
    // The fingerprint of these weights loaded as floats: the same model, so its plug-ins apply.
    BaseFingerprint fp(config);
    // Weights quantized on load (--quantize int8|int4) are not the checkpoint's: the fingerprint
    // reads the checkpoint's floats instead.
    auto float_of = [&](Slot slot) {
      for (const auto& f : found)
        if (f.spec->slot == slot && f.layer == 0) return read_dense(f, at::kFloat);
      COMB_FAIL("'{}': no tensor for the fingerprint", source.where());
    };
    if (tok_grouped) {
      for (int64_t r = 0; r < tok_grouped->rows(); r += 4096) {
        const int64_t n = std::min<int64_t>(4096, tok_grouped->rows() - r);
        fp.add(tok_grouped->select_rows(at::arange(r, r + n, at::kLong)).dequantize());
      }
      tok_grouped.reset();
    } else {
      fp.add(w.tok_embd.defined() ? w.tok_embd : float_of(Slot::tok_embd));
    }
    fp.add(w.output_norm);
    fp.add(w.layers[0].attn_norm);
    if (wqkv0_exact.defined())
      fp.add(wqkv0_exact);
    else if (layer_quantized[0])
      fp.add(at::cat({float_of(Slot::wq), float_of(Slot::wk), float_of(Slot::wv)}, 0));
    else
      fp.add(at::cat({wq[0], wk[0], wv[0]}, 0));
    w.fingerprint = fp.finish();
  }
  for (int64_t i = 0; i < config.n_layer; ++i) {
    if (layer_quantized[i]) continue;  // packed as it was read
    w.layers[i].wqkv = at::cat({wq[i], wk[i], wv[i]}, 0);
    w.layers[i].w_gate_up = at::cat({wg[i], wu[i]}, 0);
  }
  if (!w.output.defined() && !w.output_q) {  // no head of its own: the embedding, kept quantized or not
    COMB_CHECK(config.tie_embeddings, "'{}': no output head ('lm_head.weight' / 'output.weight') and the config does "
               "not tie embeddings", source.where());
    if (w.tok_embd_q)
      w.output_q = w.tok_embd_q;
    else
      w.output = w.tok_embd;
  }
  return w;
}

COMB_INLINE at::Tensor WeightReader::get(const std::string& name, const std::vector<int64_t>& shape, bool required) {
  const TensorInfo* info = source_.find(name);
  if (!info) {
    if (required) problems_.push_back(fmt::format("missing '{}'", name));
    return {};
  }
  if (info->shape != shape) {
    problems_.push_back(
        fmt::format("'{}' has shape [{}], expected [{}]", name, fmt::join(info->shape, ", "), fmt::join(shape, ", ")));
    return {};
  }
  try {
    return source_.load(name, dtype_).to(device_);
  } catch (const Error& e) {
    problems_.push_back(e.what());
    return {};
  }
}

COMB_INLINE LayerWeights WeightReader::layer(const std::string& p, const ModelConfig& c) {
  LayerWeights l;
  const int64_t d = c.n_embd;
  l.attn_norm = get(p + "input_layernorm.weight", {d});
  at::Tensor wq = get(p + "self_attn.q_proj.weight", {c.q_dim(), d});
  at::Tensor wk = get(p + "self_attn.k_proj.weight", {c.kv_dim(), d});
  at::Tensor wv = get(p + "self_attn.v_proj.weight", {c.kv_dim(), d});
  l.wo = get(p + "self_attn.o_proj.weight", {d, c.q_dim()});
  l.ffn_norm = get(p + "post_attention_layernorm.weight", {d});
  at::Tensor wg = get(p + "mlp.gate_proj.weight", {c.n_ff, d});
  at::Tensor wu = get(p + "mlp.up_proj.weight", {c.n_ff, d});
  l.w_down = get(p + "mlp.down_proj.weight", {d, c.n_ff});
  if (wq.defined() && wk.defined() && wv.defined()) l.wqkv = at::cat({wq, wk, wv}, 0);
  if (wg.defined() && wu.defined()) l.w_gate_up = at::cat({wg, wu}, 0);
  return l;
}

COMB_INLINE void WeightReader::finish(const std::string& what) const {
  COMB_CHECK(problems_.empty(), "'{}': {} ({} problem(s)):\n  {}", source_.where(), what, problems_.size(),
             fmt::join(problems_, "\n  "));
}

COMB_INLINE const QuantizedMatrix& quantized_matrix(const QuantizedLayer& q, Proj p) {
  switch (p) {
    case Proj::qkv: return q.wqkv;
    case Proj::o: return q.wo;
    case Proj::gate_up: return q.w_gate_up;
    default: return q.w_down;
  }
}

namespace detail::weights {  // this file's own helpers
COMB_INLINE const at::Tensor& layer_matrix(const LayerWeights& l, Proj p) {
  switch (p) {
    case Proj::qkv: return l.wqkv;
    case Proj::o: return l.wo;
    case Proj::gate_up: return l.w_gate_up;
    default: return l.w_down;
  }
}
}  // namespace detail::weights

COMB_INLINE at::Tensor project(const LayerWeights& l, Proj p, const at::Tensor& x) {
  if (l.quantized) return quantized_matrix(*l.quantized, p).apply(x);
  return at::linear(x, detail::weights::layer_matrix(l, p));
}

COMB_INLINE at::Tensor dense_matrix(const LayerWeights& l, Proj p) {
  return l.quantized ? quantized_matrix(*l.quantized, p).dequantize() : detail::weights::layer_matrix(l, p);
}

COMB_INLINE int64_t LlamaWeights::bytes() const {
  int64_t n = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) n += t.numel() * t.element_size();
  };
  add(tok_embd), add(output_norm), add(rope_freqs);
  if (output.defined() && !(tok_embd.defined() && output.is_same(tok_embd))) add(output);
  if (tok_embd_q) n += tok_embd_q->bytes();
  if (output_q && output_q != tok_embd_q) n += output_q->bytes();
  for (const auto& l : layers) {
    for (const auto* t : {&l.attn_norm, &l.wqkv, &l.wo, &l.ffn_norm, &l.w_gate_up, &l.w_down}) add(*t);
    if (l.quantized) n += l.quantized->wqkv.bytes() + l.quantized->wo.bytes() + l.quantized->w_gate_up.bytes() +
                         l.quantized->w_down.bytes();
  }
  return n;
}

COMB_INLINE void append_llama_layer_hf_named(std::vector<std::pair<std::string, at::Tensor>>& out, const std::string& p,
                                 const LayerWeights& l, const ModelConfig& c) {
  auto qkv = dense_matrix(l, Proj::qkv).split_with_sizes({c.q_dim(), c.kv_dim(), c.kv_dim()}, 0);
  auto gu = dense_matrix(l, Proj::gate_up).split_with_sizes({c.n_ff, c.n_ff}, 0);
  out.emplace_back(p + "input_layernorm.weight", l.attn_norm);
  out.emplace_back(p + "self_attn.q_proj.weight", qkv[0]);
  out.emplace_back(p + "self_attn.k_proj.weight", qkv[1]);
  out.emplace_back(p + "self_attn.v_proj.weight", qkv[2]);
  out.emplace_back(p + "self_attn.o_proj.weight", dense_matrix(l, Proj::o));
  out.emplace_back(p + "post_attention_layernorm.weight", l.ffn_norm);
  out.emplace_back(p + "mlp.gate_proj.weight", gu[0]);
  out.emplace_back(p + "mlp.up_proj.weight", gu[1]);
  out.emplace_back(p + "mlp.down_proj.weight", dense_matrix(l, Proj::down));
}

COMB_INLINE std::vector<std::pair<std::string, at::Tensor>> llama_weights_hf_named(const LlamaWeights& w, const ModelConfig& c) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("model.embed_tokens.weight", w.tok_embd_q ? w.tok_embd_q->dequantize() : w.tok_embd);
  for (int64_t i = 0; i < c.n_layer; ++i) append_llama_layer_hf_named(out, fmt::format("model.layers.{}.", i), w.layers[i], c);
  out.emplace_back("model.norm.weight", w.output_norm);
  if (!c.tie_embeddings) out.emplace_back("lm_head.weight", w.output_q ? w.output_q->dequantize() : w.output);
  return out;
}

// ---- The base fingerprint ------------------------------------------------------------------

COMB_INLINE BaseFingerprint::BaseFingerprint(const ModelConfig& c) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  std::string dims = fmt::format("{} {} {} {} {} {} {} {} {}", c.architecture, c.n_vocab, c.n_embd, c.n_ff, c.n_layer,
                                 c.n_head, c.n_head_kv, c.head_dim, c.rope_theta);
  XXH3_128bits_update(state, dims.data(), dims.size());
  state_ = state;
}

COMB_INLINE BaseFingerprint::~BaseFingerprint() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

COMB_INLINE void BaseFingerprint::add(const at::Tensor& t) {
  detail::hash::hash_tensor(static_cast<XXH3_state_t*>(state_), t.to(at::kBFloat16));
}

COMB_INLINE std::string BaseFingerprint::finish() {
  return detail::hash::hex128(XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_)));
}


}  // namespace comb
