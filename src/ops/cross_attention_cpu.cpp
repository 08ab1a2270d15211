// comb::cross_attention on the CPU: one online softmax per (request, head, query) that walks the
// request's documents in place.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>

#include "comb/error.hpp"
#include "comb/ops.hpp"
#include "checks.hpp"

namespace comb::ops {

namespace {

at::Tensor cross_attention_cpu(const at::Tensor& q_in, at::TensorList keys_in, at::TensorList values_in,
                               c10::IntArrayRef doc_counts, double scale) {
  detail::check_cross_attention(q_in, keys_in, values_in, doc_counts);
  const int64_t batch = q_in.size(0), n = q_in.size(1), n_head = q_in.size(2), hd = q_in.size(3);
  at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({batch, n, n_head, hd}, q.options());
  if (keys_in.empty()) return out.to(q_in.scalar_type());
  std::vector<at::Tensor> keys, values;  // contiguous views (a copy only if a caller passed strided ones)
  for (size_t d = 0; d < keys_in.size(); ++d) {
    keys.push_back(keys_in[d].contiguous());
    values.push_back(values_in[d].contiguous());
  }
  std::vector<int64_t> first(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + doc_counts[b];
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys[0].scalar_type(), "comb_cross_attention_cpu", [&] {
    at::parallel_for(0, batch * n_head, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hd);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / n_head, h = item % n_head;
        for (int64_t t = 0; t < n; ++t) {
          const float* qv = q.data_ptr<float>() + ((b * n + t) * n_head + h) * hd;
          float running_max = -INFINITY, total = 0;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t d = first[b]; d < first[b + 1]; ++d) {
            const int64_t n_kv = keys[d].size(0), len = keys[d].size(1), kvh = h / (n_head / n_kv);
            const scalar_t* kp = keys[d].data_ptr<scalar_t>() + kvh * len * hd;
            const scalar_t* vp = values[d].data_ptr<scalar_t>() + kvh * len * hd;
            for (int64_t j = 0; j < len; ++j) {
              float s = 0;
              for (int64_t i = 0; i < hd; ++i) s += qv[i] * static_cast<float>(kp[j * hd + i]);
              s *= fscale;
              if (s > running_max) {  // rescale what was summed so far
                float shrink = std::exp(running_max - s);
                total *= shrink;
                for (auto& a : acc) a *= shrink;
                running_max = s;
              }
              float p = std::exp(s - running_max);
              total += p;
              for (int64_t i = 0; i < hd; ++i) acc[i] += p * static_cast<float>(vp[j * hd + i]);
            }
          }
          float* o = out.data_ptr<float>() + ((b * n + t) * n_head + h) * hd;
          if (total > 0)
            for (int64_t i = 0; i < hd; ++i) o[i] = acc[i] / total;
        }
      }
    });
  });
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
