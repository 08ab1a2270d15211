// comb::cross_attention on CUDA: checks, pointer tables, and the launch on the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.hpp"
#include "cross_attention_cuda.hpp"

namespace comb::ops {

namespace {

at::Tensor cross_attention_cuda(const at::Tensor& q_in, at::TensorList keys_in, at::TensorList values_in,
                                c10::IntArrayRef doc_counts, double scale, const std::optional<at::Tensor>& sinks) {
  detail::check_cross_attention(q_in, keys_in, values_in, doc_counts, sinks);
  COMB_CHECK(q_in.size(3) <= 128, "cross_attention on CUDA supports head_dim up to 128, found {}", q_in.size(3));
  c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t batch = q_in.size(0), n = q_in.size(1), n_head = q_in.size(2), hd = q_in.size(3);
  at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({batch, n, n_head, hd}, q.options());
  if (keys_in.empty()) return out.to(q_in.scalar_type());
  std::vector<at::Tensor> keys, values;  // contiguous (copies only for strided inputs), alive until the launch
  std::vector<int64_t> key_ptrs, value_ptrs, lens, first(batch + 1, 0);
  for (size_t d = 0; d < keys_in.size(); ++d) {
    keys.push_back(keys_in[d].contiguous());
    values.push_back(values_in[d].contiguous());
    key_ptrs.push_back(reinterpret_cast<int64_t>(keys.back().data_ptr()));
    value_ptrs.push_back(reinterpret_cast<int64_t>(values.back().data_ptr()));
    lens.push_back(keys.back().size(1));
  }
  for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + doc_counts[b];
  auto table = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(q.device()); };
  at::Tensor k_table = table(key_ptrs), v_table = table(value_ptrs), len_table = table(lens), first_table = table(first);
  at::Tensor sink_table;  // float32 [n_head], or none
  if (sinks && sinks->defined()) sink_table = sinks->to(at::kFloat).contiguous();
  const auto type = keys[0].scalar_type();
  COMB_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16,
             "cross_attention on CUDA reads float32, float16 or bfloat16 documents, found {}", c10::toString(type));
  auto kv_type = type == at::kFloat ? comb::detail::cuda::KVType::f32
                 : type == at::kHalf ? comb::detail::cuda::KVType::f16
                                     : comb::detail::cuda::KVType::bf16;
  cudaError_t err = comb::detail::cuda::cross_attention(
      q.data_ptr<float>(), reinterpret_cast<const void* const*>(k_table.data_ptr<int64_t>()),
      reinterpret_cast<const void* const*>(v_table.data_ptr<int64_t>()), len_table.data_ptr<int64_t>(),
      first_table.data_ptr<int64_t>(),
      sink_table.defined() ? sink_table.data_ptr<float>() : nullptr, kv_type, batch, n, n_head, keys[0].size(0), hd, static_cast<float>(scale),
      out.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  COMB_CHECK(err == cudaSuccess, "cross_attention CUDA launch failed: {}", cudaGetErrorString(err));
  return out.to(q_in.scalar_type());
}

}  // namespace

}  // namespace comb::ops

TORCH_LIBRARY_IMPL(comb, CUDA, m) { m.impl("cross_attention", &comb::ops::cross_attention_cuda); }
