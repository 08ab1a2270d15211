// comb::cross_attention on the CPU: per request, its documents' K/V side by side and one SDPA call
// (GEMM-based, grouped heads).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "comb/error.hpp"
#include "comb/ops.hpp"
#include "checks.hpp"

namespace comb::ops {

namespace {

at::Tensor cross_attention_cpu(const at::Tensor& q_in, at::TensorList keys_in, at::TensorList values_in,
                               c10::IntArrayRef doc_counts, double scale) {
  detail::check_cross_attention(q_in, keys_in, values_in, doc_counts);
  const int64_t batch = q_in.size(0);
  at::Tensor q = q_in.to(at::kFloat);
  at::Tensor out = at::zeros(q.sizes(), q.options());  // a request without documents reads nothing
  // NOTE: a request's documents are concatenated (a temporary copy of one block's K/V for the
  // request) so that one GEMM-based attention call scores every query against every document
  // token; walking the documents in place with a scalar online softmax was several times slower
  // (docs/benchmarks.md).
  int64_t first = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = doc_counts[b];
    if (count == 0) continue;
    at::TensorList k = keys_in.slice(first, count), v = values_in.slice(first, count);
    first += count;
    at::Tensor keys = (count == 1 ? k[0] : at::cat(k, 1)).to(at::kFloat).unsqueeze(0);      // [1, n_kv, len, hd]
    at::Tensor values = (count == 1 ? v[0] : at::cat(v, 1)).to(at::kFloat).unsqueeze(0);
    at::Tensor qb = q[b].transpose(0, 1).unsqueeze(0);  // [1, n_head, n, hd]
    at::Tensor o = at::scaled_dot_product_attention(qb, keys, values, {}, 0.0, false, scale,
                                                    /*enable_gqa=*/keys.size(1) != qb.size(1));
    out[b].copy_(o[0].transpose(0, 1));
  }
  return out.to(q_in.scalar_type());
}

}  // namespace

at::Tensor cross_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts,
                           double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("comb::cross_attention", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, c10::IntArrayRef, double)>();
  return op.call(q, keys, values, doc_counts, scale);
}

}  // namespace comb::ops

TORCH_LIBRARY_IMPL(comb, CPU, m) { m.impl("cross_attention", &comb::ops::cross_attention_cpu); }
