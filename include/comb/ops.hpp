#pragma once
// comb's custom Torch ops (schemas in src/ops/library.cpp, one TORCH_LIBRARY(comb, m)).
#include <ATen/core/Tensor.h>

#include <vector>

namespace comb::ops {

// Cross-attention of decoder queries over the cached documents of each request. Not causal, no
// RoPE. The CUDA kernel reads each document in place (grouped-query heads by index); the CPU one
// concatenates a request's documents for one GEMM-based attention call.
//   q:          [batch, n, n_head, head_dim]
//   keys[d]:    [n_head_kv, len_d, head_dim]  (document d; any floating dtype)
//   values[d]:  [n_head_kv, len_d, head_dim]
//   doc_counts: [batch] documents of each request, in order in keys/values
//   sinks:      [n_head] float32 or undefined: a logit per head for "attend to nothing" (a key whose
//               score is sinks[h] and whose value is 0), so a head can give the documents little weight
// Returns [batch, n, n_head, head_dim] in q's dtype; a request with no document gets zeros.
// Differentiable: with gradients required, the op runs as ATen ops (the CPU path's math) on any device.
at::Tensor cross_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts, double scale,
                           const at::Tensor& sinks = {});

}  // namespace comb::ops
