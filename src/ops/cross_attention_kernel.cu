// comb::cross_attention on CUDA: one warp per (request, query, head) row, an online softmax over
// the request's documents read in place; lanes split head_dim (up to 128: 4 values per lane).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "cross_attention_cuda.hpp"

namespace comb::detail::cuda {

namespace {

__device__ inline float load(const float* p) { return *p; }
__device__ inline float load(const __half* p) { return __half2float(*p); }
__device__ inline float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename KV>
__global__ void cross_attention_kernel(const float* __restrict__ q, const void* const* keys, const void* const* values,
                                       const int64_t* lens, const int64_t* first_doc, const float* sinks, int64_t rows, int64_t n,
                                       int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale,
                                       float* __restrict__ out) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t h = row % n_head, b = row / (n_head * n);
  const int64_t kvh = h / (n_head / n_head_kv);
  float qreg[4], acc[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) {
    int64_t d = lane + 32 * i;
    qreg[i] = d < head_dim ? q[row * head_dim + d] : 0.0f;
  }
  // A sink is a key of score sinks[h] and value 0: the softmax starts with it.
  float running_max = -INFINITY, total = 0.0f;
  if (sinks != nullptr && first_doc[b + 1] > first_doc[b]) running_max = sinks[h], total = 1.0f;
  for (int64_t doc = first_doc[b]; doc < first_doc[b + 1]; ++doc) {
    const int64_t len = lens[doc];
    const KV* kp = static_cast<const KV*>(keys[doc]) + kvh * len * head_dim;
    const KV* vp = static_cast<const KV*>(values[doc]) + kvh * len * head_dim;
    for (int64_t j = 0; j < len; ++j) {
      float part = 0.0f;
      for (int i = 0; i < 4; ++i) {
        int64_t d = lane + 32 * i;
        if (d < head_dim) part += qreg[i] * load(kp + j * head_dim + d);
      }
      for (int offset = 16; offset > 0; offset /= 2) part += __shfl_xor_sync(0xffffffffu, part, offset);
      const float s = part * scale;
      const float next_max = fmaxf(running_max, s);
      const float shrink = __expf(running_max - next_max), p = __expf(s - next_max);
      total = total * shrink + p;
      for (int i = 0; i < 4; ++i) {
        int64_t d = lane + 32 * i;
        acc[i] = acc[i] * shrink + (d < head_dim ? p * load(vp + j * head_dim + d) : 0.0f);
      }
      running_max = next_max;
    }
  }
  for (int i = 0; i < 4; ++i) {
    int64_t d = lane + 32 * i;
    if (d < head_dim) out[row * head_dim + d] = total > 0.0f ? acc[i] / total : 0.0f;
  }
}

}  // namespace

cudaError_t cross_attention(const float* q, const void* const* keys, const void* const* values, const int64_t* lens,
                            const int64_t* first_doc, const float* sinks, KVType kv_type, int64_t batch, int64_t n, int64_t n_head,
                            int64_t n_head_kv, int64_t head_dim, float scale, float* out, cudaStream_t stream) {
  if (head_dim > 128 || n_head_kv <= 0 || n_head % n_head_kv != 0) return cudaErrorInvalidValue;
  const int64_t rows = batch * n * n_head;
  if (rows == 0) return cudaSuccess;
  const int threads = 128;  // 4 warps, 4 rows per block
  const int64_t blocks = (rows * 32 + threads - 1) / threads;
  switch (kv_type) {
    case KVType::f32:
      cross_attention_kernel<float><<<blocks, threads, 0, stream>>>(q, keys, values, lens, first_doc, sinks, rows, n, n_head,
                                                                     n_head_kv, head_dim, scale, out);
      break;
    case KVType::f16:
      cross_attention_kernel<__half><<<blocks, threads, 0, stream>>>(q, keys, values, lens, first_doc, sinks, rows, n, n_head,
                                                                      n_head_kv, head_dim, scale, out);
      break;
    case KVType::bf16:
      cross_attention_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(q, keys, values, lens, first_doc, sinks, rows, n,
                                                                             n_head, n_head_kv, head_dim, scale, out);
      break;
  }
  return cudaGetLastError();
}

}  // namespace comb::detail::cuda
