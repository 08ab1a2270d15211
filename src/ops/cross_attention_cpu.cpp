// comb::cross_attention on the CPU: per request, its documents' K/V side by side and one SDPA call
// (GEMM-based, grouped heads). The same ATen code is the op's differentiable path on every device.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "comb/error.hpp"
#include "comb/ops.hpp"
#include "checks.hpp"

namespace comb::ops {

namespace {

using Schema = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, c10::IntArrayRef, double,
                          const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<Schema>& handle() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("comb::cross_attention", "").typed<Schema>();
  return op;
}

// The op in ATen calls: differentiable in q, keys, values and sinks. Computes in float32 (keys and
// values of any floating dtype) and returns q's dtype.
at::Tensor cross_attention_aten(const at::Tensor& q_in, at::TensorList keys_in, at::TensorList values_in,
                                c10::IntArrayRef doc_counts, double scale, const std::optional<at::Tensor>& sinks) {
  detail::check_cross_attention(q_in, keys_in, values_in, doc_counts, sinks);
  const int64_t batch = q_in.size(0), n_head = q_in.size(2), hd = q_in.size(3);
  at::Tensor q = q_in.to(at::kFloat);
  // NOTE: a request's documents are concatenated (a temporary copy of one block's K/V for the
  // request) so that one GEMM-based attention call scores every query against every document
  // token; walking the documents in place with a scalar online softmax was several times slower
  // (docs/benchmarks.md). A sink is one more key, of zeros, whose score is the sink's logit (a
  // float mask adds it), with a value of zeros.
  std::vector<at::Tensor> rows;
  rows.reserve(batch);
  int64_t first = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = doc_counts[b];
    if (count == 0) {  // a request without documents reads nothing
      rows.push_back(at::zeros({q.size(1), n_head, hd}, q.options()));
      continue;
    }
    at::TensorList k = keys_in.slice(first, count), v = values_in.slice(first, count);
    first += count;
    at::Tensor keys = (count == 1 ? k[0] : at::cat(k, 1)).to(at::kFloat).unsqueeze(0);  // [1, n_kv, len, hd]
    at::Tensor values = (count == 1 ? v[0] : at::cat(v, 1)).to(at::kFloat).unsqueeze(0);
    std::optional<at::Tensor> mask;
    if (sinks && sinks->defined()) {
      const int64_t len = keys.size(2);
      keys = at::cat({keys, at::zeros({1, keys.size(1), 1, hd}, keys.options())}, 2);
      values = at::cat({values, at::zeros({1, values.size(1), 1, hd}, values.options())}, 2);
      mask = at::cat({at::zeros({n_head, len}, q.options()), sinks->to(at::kFloat).view({n_head, 1})}, 1)
                 .view({1, n_head, 1, len + 1});
    }
    at::Tensor qb = q[b].transpose(0, 1).unsqueeze(0);  // [1, n_head, n, hd]
    at::Tensor o = at::scaled_dot_product_attention(qb, keys, values, mask, 0.0, false, scale,
                                                    /*enable_gqa=*/keys.size(1) != qb.size(1));
    rows.push_back(o[0].transpose(0, 1));
  }
  return at::stack(rows, 0).to(q_in.scalar_type());
}

bool needs_grad(const at::Tensor& q, at::TensorList keys, at::TensorList values,
                const std::optional<at::Tensor>& sinks) {
  if (!c10::GradMode::is_enabled()) return false;
  if (q.requires_grad() || (sinks && sinks->defined() && sinks->requires_grad())) return true;
  for (const auto& t : keys)
    if (t.requires_grad()) return true;
  for (const auto& t : values)
    if (t.requires_grad()) return true;
  return false;
}

// The Autograd kernel: without gradients, the backend's kernel (CPU or CUDA); with them, the ATen
// path, whose backward LibTorch derives.
at::Tensor cross_attention_autograd(const at::Tensor& q, at::TensorList keys, at::TensorList values,
                                    c10::IntArrayRef doc_counts, double scale, const std::optional<at::Tensor>& sinks) {
  if (needs_grad(q, keys, values, sinks)) return cross_attention_aten(q, keys, values, doc_counts, scale, sinks);
  at::AutoDispatchBelowADInplaceOrView below;
  return handle().call(q, keys, values, doc_counts, scale, sinks);
}

}  // namespace

at::Tensor cross_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                           const std::vector<at::Tensor>& values, const std::vector<int64_t>& doc_counts, double scale,
                           const at::Tensor& sinks) {
  std::optional<at::Tensor> s;
  if (sinks.defined()) s = sinks;
  return handle().call(q, keys, values, doc_counts, scale, s);
}

}  // namespace comb::ops

// On the CPU the ATen path is the kernel.
TORCH_LIBRARY_IMPL(comb, CPU, m) { m.impl("cross_attention", &comb::ops::cross_attention_aten); }
TORCH_LIBRARY_IMPL(comb, Autograd, m) { m.impl("cross_attention", &comb::ops::cross_attention_autograd); }
