#pragma once
// The CUDA kernels of comb's fused decoder ops: raw device pointers and sizes, no LibTorch.
// Every kernel takes half-precision rows (float16 or bfloat16, `Half` below), accumulates in
// float32 and rounds where the ATen composition it replaces rounds, so that each matches that
// composition up to the order of its sums (tests/test_cuda_ops.cpp).
//
// Decoding kernels read their position and their layer's cache through a parameter block on the
// device, so that one captured CUDA graph serves every position and every cache:
//   params[0] = position of the first row, params[1] = the caches' capacity, params[2] = the token,
//   params[3 + l] = address of layer l's keys, params[3 + n_layer + l] = its values, each
//   [n_head_kv, capacity, head_dim] (one sequence).
#include <cuda_runtime_api.h>

#include <cstdint>

namespace comb::detail::cuda {

enum class Half { f16, bf16 };

// Offsets in the parameter block.
constexpr int64_t kParamPosition = 0, kParamCapacity = 1, kParamToken = 2, kParamCaches = 3;

// residual [rows, dim] += delta (when delta is not null, rounded to Half), then
// out = weight * round(residual * rsqrt(mean(residual^2) + eps)) (Hugging Face's RMSNorm).
cudaError_t add_rms_norm(Half type, void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                         int64_t dim, float eps, cudaStream_t stream);

// Rows qkv [n, (n_head + 2 n_head_kv) * head_dim] at positions params[0] + i: the rotate-half RoPE
// (cos, sin [n_ctx, head_dim]) on queries and keys; queries to q [n, n_head, head_dim], keys and
// values into layer `layer`'s cache at their positions.
cudaError_t rope_store(Half type, const void* qkv, const void* cos, const void* sin, const int64_t* params,
                       int64_t layer, int64_t n_layer, void* q, int64_t n, int64_t n_head, int64_t n_head_kv,
                       int64_t head_dim, cudaStream_t stream);

// Keys k [n_head_kv, n, head_dim] computed at positions [0, n) (strides k_head and k_row, the last
// dimension contiguous) moved to [position, position + n) of a cache [n_head_kv, capacity,
// head_dim]: rotated by position's angle (cos, sin: its rows of the tables, [head_dim]), as
// apply_rope rounds (R(position + i) = R(position) R(i)).
cudaError_t rotate_keys(Half type, const void* k, int64_t k_head, int64_t k_row, const void* cos, const void* sin,
                        void* cache, int64_t capacity, int64_t position, int64_t n, int64_t n_head_kv,
                        int64_t head_dim, cudaStream_t stream);

// y [n] = w [n, k] x [k] (float32 sums, one rounding): for one row, the weights read once at
// nearly the memory's rate. k a multiple of 8 and at most kGemvMaxShared / 2, w and x 16-byte
// aligned (else cudaErrorInvalidValue, nothing launched); at most max_blocks blocks of 8 warps.
constexpr int64_t kGemvMaxShared = 48 * 1024;
cudaError_t gemv(Half type, const void* w, const void* x, void* y, int64_t n, int64_t k, int max_blocks,
                 cudaStream_t stream);

// out [rows, n_ff] = silu(gate_up[:, :n_ff]) * gate_up[:, n_ff:], each step rounded to Half.
cudaError_t silu_mul(Half type, const void* gate_up, void* out, int64_t rows, int64_t n_ff, cudaStream_t stream);

// Attention of n_rows rows q [n_rows, n_head, head_dim] at positions params[0] + r over layer
// `layer`'s cache, causal (row r reads positions [0, params[0] + r]), grouped-query heads, scale
// 1/sqrt(head_dim); out [n_rows, n_head, head_dim]. With joined keys and values [n_head_kv,
// n_joined, head_dim] (COMB's documents), rows at positions >= anchor also read them in the same
// softmax, each of their scores plus joined_bias[h] (float32 [n_head], or null). Each row's keys
// are split into `n_split` ranges attended apart (partial: float32 [n_rows, n_head, n_split,
// head_dim + 2] of scratch) and merged by their log-sum-exp. head_dim 32, 64, 128 or 256.
struct RowsAttention {
  const void* q = nullptr;
  const int64_t* params = nullptr;
  int64_t layer = 0, n_layer = 1;
  const void* joined_keys = nullptr;
  const void* joined_values = nullptr;
  const float* joined_bias = nullptr;
  int64_t n_joined = 0, anchor = 0;
  void* out = nullptr;
  float* partial = nullptr;
  int64_t n_rows = 1, n_split = 1, n_head = 0, n_head_kv = 0, head_dim = 0;
};
cudaError_t rows_attention(Half type, const RowsAttention& args, cudaStream_t stream);

}  // namespace comb::detail::cuda
