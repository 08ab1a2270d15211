#pragma once
// Argument checks of comb::cross_attention, shared by its backends.
#include <ATen/core/Tensor.h>

#include "comb/error.hpp"

namespace comb::ops::detail {

inline void check_cross_attention(const at::Tensor& q, at::TensorList keys, at::TensorList values,
                                  c10::IntArrayRef doc_counts, const std::optional<at::Tensor>& sinks = {}) {
  COMB_CHECK(q.dim() == 4, "cross_attention: q should be [batch, n, n_head, head_dim], found {} dims", q.dim());
  COMB_CHECK(static_cast<int64_t>(doc_counts.size()) == q.size(0),
             "cross_attention: {} document counts for a batch of {}", doc_counts.size(), q.size(0));
  COMB_CHECK(keys.size() == values.size(), "cross_attention: {} key tensors but {} value tensors", keys.size(),
             values.size());
  int64_t total = 0;
  for (int64_t c : doc_counts) {
    COMB_CHECK(c >= 0, "cross_attention: negative document count {}", c);
    total += c;
  }
  COMB_CHECK(total == static_cast<int64_t>(keys.size()), "cross_attention: document counts add up to {}, but {} given",
             total, keys.size());
  if (sinks && sinks->defined())
    COMB_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(2) && sinks->device() == q.device(),
               "cross_attention: sinks should be [{}] (one per query head) on {}, found {} on {}", q.size(2),
               q.device().str(), fmt::join(sinks->sizes(), "x"), sinks->device().str());
  const int64_t head_dim = q.size(3);
  for (size_t d = 0; d < keys.size(); ++d) {
    const auto& k = keys[d];
    const auto& v = values[d];
    COMB_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == head_dim && k.size(1) > 0,
               "cross_attention: document {} keys {} and values {} should both be [n_head_kv, len>0, {}]", d,
               fmt::join(k.sizes(), "x"), fmt::join(v.sizes(), "x"), head_dim);
    COMB_CHECK(q.size(2) % k.size(0) == 0 && k.size(0) == keys[0].size(0),
               "cross_attention: {} query heads need one kv-head count dividing them, found {} (document {})",
               q.size(2), k.size(0), d);
    COMB_CHECK(k.scalar_type() == keys[0].scalar_type() && v.scalar_type() == keys[0].scalar_type(),
               "cross_attention: documents must share one dtype");
    COMB_CHECK(k.device() == q.device() && v.device() == q.device(),
               "cross_attention: document {} is on {}, the queries on {}", d, k.device().str(), q.device().str());
  }
}

}  // namespace comb::ops::detail
