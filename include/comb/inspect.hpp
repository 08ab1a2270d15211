#pragma once
// Where attention goes: the probabilities with which a prompt row reads its context and the
// documents linked beside it, layer by layer. For measurement (comb attention), not for answering:
// it repeats each layer's query and key projection with the generic tensor ops.
#include <ATen/ATen.h>

#include <vector>

#include "comb/decoder.hpp"

namespace comb {

// joint_attention()'s probabilities: queries q [batch, n_head, n, head_dim] at positions start ..
// start + n - 1 over the joined keys (joint->keys with its bias, valid and anchor) and the causal
// context keys [batch, n_head_kv, start + n, head_dim] in one softmax, float32 [batch, n_head, n,
// m + start + n]: the m joined keys first (0 where a row does not read them), then the context
// (0 after a row's own position). `joint` nullptr: the context alone, [batch, n_head, n, start + n].
at::Tensor joint_attention_probs(const at::Tensor& q, const at::Tensor& keys, int64_t start, const JointKV* joint);

// The last row of tokens [1, n] (reading `reads`, or nothing) as a prompt runs through
// Decoder::forward: the rows before it in one forward, then the row, whose query at each layer is
// scored against the keys that layer cached.
struct RowAttention {
  // Per layer: float32 [n_head, joined[layer] + n], the row's probabilities over that layer's joined
  // keys (none where the layer reads no documents) and then the context positions 0..n-1.
  std::vector<at::Tensor> probs;
  std::vector<int64_t> joined;
  at::Tensor logits;  // [1, 1, n_vocab]: the row's, as the forward computes them
};
RowAttention row_attention(const Decoder& base, const at::Tensor& tokens, const LayerReads* reads);

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/inspect.ipp"
#endif
