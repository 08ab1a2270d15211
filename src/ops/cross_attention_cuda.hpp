#pragma once
// The CUDA kernel of comb::cross_attention: raw device pointers and sizes, no LibTorch.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace comb::detail::cuda {

enum class KVType { f32, f16, bf16 };

// q [batch, n, n_head, head_dim] (fp32), out likewise; keys[d], values[d] point to document d's
// [n_head_kv, lens[d], head_dim] (device arrays of pointers); request b reads documents
// [first_doc[b], first_doc[b + 1]). sinks: null, or [n_head] logits of a zero-valued extra key.
// head_dim <= 128.
cudaError_t cross_attention(const float* q, const void* const* keys, const void* const* values, const int64_t* lens,
                            const int64_t* first_doc, const float* sinks, KVType kv_type, int64_t batch, int64_t n, int64_t n_head,
                            int64_t n_head_kv, int64_t head_dim, float scale, float* out, cudaStream_t stream);

}  // namespace comb::detail::cuda
