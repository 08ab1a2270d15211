// Attention probabilities for measurement (inspect.hpp).
// Compiled into libcomb (src/inspect.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"

#include <cmath>

#include "comb/error.hpp"
#include "comb/inspect.hpp"
#include "comb/weights.hpp"

namespace comb {

COMB_INLINE at::Tensor joint_attention_probs(const at::Tensor& q, const at::Tensor& keys, int64_t start,
                                             const JointKV* joint) {
  COMB_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.size(0) == q.size(0) && keys.size(3) == q.size(3) &&
                 keys.size(1) > 0 && q.size(1) % keys.size(1) == 0,
             "attention probabilities: queries [{}] and keys [{}] should be [batch, n_head, n, d] and [batch, "
             "n_head_kv, start + n, d] with n_head a multiple of n_head_kv",
             fmt::join(q.sizes(), ", "), fmt::join(keys.sizes(), ", "));
  const int64_t batch = q.size(0), n_head = q.size(1), n = q.size(2), d = q.size(3), n_self = keys.size(2);
  COMB_CHECK(n_self == start + n, "attention probabilities: {} context keys for {} earlier and {} new positions", n_self,
             start, n);
  const int64_t groups = n_head / keys.size(1);
  const double scale = 1.0 / std::sqrt(double(d));
  const at::Tensor qf = q.to(at::kFloat);
  // Query head h reads KV head h / groups (joint_attention's grouping).
  auto scores = [&](const at::Tensor& k) {
    return at::matmul(qf, k.to(at::kFloat).repeat_interleave(groups, 1).transpose(-1, -2)) * scale;
  };
  const at::Tensor positions = at::arange(start, start + n, q.options().dtype(at::kLong));
  at::Tensor own = scores(keys).masked_fill(visible_keys(positions, n_self).logical_not().view({1, 1, n, n_self}),
                                            -INFINITY);
  if (!joint) return at::softmax(own, -1);
  const at::Tensor& jk = joint->keys;
  COMB_CHECK(jk.dim() == 4 && jk.size(0) == batch && jk.size(1) == keys.size(1) && jk.size(3) == d,
             "attention probabilities: joined keys [{}] should be [{}, {}, m, {}]", fmt::join(jk.sizes(), ", "), batch,
             keys.size(1), d);
  const int64_t m = jk.size(2);
  at::Tensor docs = scores(jk);  // [batch, n_head, n, m]
  if (joint->bias.defined()) docs = docs + joint->bias.to(at::kFloat).view({1, n_head, 1, 1});
  if (joint->valid.defined())
    docs = docs.masked_fill(joint->valid.logical_not().view({batch, 1, 1, m}), -INFINITY);
  if (joint->anchor > start)  // positions before the anchor read no document
    docs = docs.masked_fill((positions < joint->anchor).view({1, 1, n, 1}), -INFINITY);
  return at::softmax(at::cat({docs, own}, -1), -1);
}

COMB_INLINE RowAttention row_attention(const Decoder& base, const at::Tensor& tokens, const LayerReads* reads) {
  const ModelConfig& c = base.config();
  COMB_CHECK(tokens.dim() == 2 && tokens.size(0) == 1 && tokens.size(1) > 0,
             "row_attention: expected tokens [1, n > 0], found [{}]", fmt::join(tokens.sizes(), ", "));
  const int64_t n = tokens.size(1), row = n - 1;
  COMB_CHECK(n <= c.n_ctx, "row_attention: {} tokens; the context holds {}", n, c.n_ctx);
  // The rows before the last through Decoder::forward, then the last one layer by layer as
  // forward() runs it; each layer's keys as that layer cached them.
  KVCache cache = base.make_cache(1, n);
  if (row > 0) base.forward(tokens.narrow(1, 0, row), cache, LogitsMode::last, reads);
  RowAttention out;
  at::Tensor x = base.embed(tokens.narrow(1, row, 1));
  const at::Tensor cos = base.rope_cos().narrow(0, row, 1), sin = base.rope_sin().narrow(0, row, 1);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const LayerWeights& l = base.weights().layers[i];
    const at::Tensor in = reads ? reads->before(i, x, row) : x;
    const JointKV* joint = reads ? reads->joint(i) : nullptr;
    x = base.layer(i, in, cache, joint);
    // The row's query as the layer computes it (with the generic ops), against the cached keys.
    at::Tensor q = split_qkv(project(l, Proj::qkv, comb::rms_norm(in, l.attn_norm, c.rms_eps)), c)[0];
    out.probs.push_back(
        joint_attention_probs(apply_rope(q, cos, sin), cache.keys(i).narrow(2, 0, n), row, joint)[0].select(1, 0));
    out.joined.push_back(joint ? joint->keys.size(2) : 0);
  }
  cache.advance(1);
  out.logits = base.logits(x, LogitsMode::last);
  return out;
}

}  // namespace comb
