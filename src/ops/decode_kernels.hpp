#pragma once
// The CUDA kernels of comb's fused decoder ops: raw device pointers and sizes, no LibTorch.
// Every kernel takes half-precision rows (float16 or bfloat16, `Half` below), accumulates in
// float32 and rounds where the ATen composition it replaces rounds, so that each matches that
// composition up to the order of its sums (tests/test_cuda_ops.cpp).
//
// Decoding kernels find their position and their layer's cache through a CacheAt: inside a captured
// CUDA graph, a parameter block on the device, so that one graph serves every position and every
// cache:
//   params[0] = position of the first row, params[1] = the caches' capacity, params[2] = the rows
//   that are real (0: every row; the rows past them, a graph bucket's padding, neither write the
//   cache nor attend),
//   params[3 + l] = address of layer l's keys, params[3 + n_layer + l] = its values, each
//   [n_head_kv, capacity, head_dim] (one sequence);
// outside one, the same values as kernel arguments (no copy to the device before the launch).
#include <cuda_runtime_api.h>

#include <cstdint>

namespace comb::detail::cuda {

enum class Half { f16, bf16 };

// Offsets in the parameter block.
constexpr int64_t kParamPosition = 0, kParamCapacity = 1, kParamRows = 2, kParamCaches = 3;

// Rows of several sequences whose K/V lie in a block pool (the server's decoding step): row r is at
// position positions[r], and position p of its sequence lies in block table[r * max_blocks + p /
// block_tokens] at offset p % block_tokens of the pool [n_blocks, n_head_kv, block_tokens,
// head_dim]. table and positions in device memory.
struct PagedAt {
  const int32_t* table = nullptr;
  const int64_t* positions = nullptr;
  int64_t max_blocks = 0, block_tokens = 0;
};

// Layer `layer`'s cache and the first row's position: read from `params` on the device when it is
// not null, else the fields below. With paged.table set: keys and values are the pool's, each row
// at its own position in its own blocks (params, position and capacity unused).
struct CacheAt {
  const int64_t* params = nullptr;
  int64_t layer = 0, n_layer = 1;
  int64_t position = 0, capacity = 0;
  void* keys = nullptr;
  void* values = nullptr;
  PagedAt paged;
};

// residual [rows, dim] += delta (when delta is not null, rounded to Half), then
// out = weight * round(residual * rsqrt(mean(residual^2) + eps)) (Hugging Face's RMSNorm).
cudaError_t add_rms_norm(Half type, void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                         int64_t dim, float eps, cudaStream_t stream);

// Rows qkv [n, (n_head + 2 n_head_kv) * head_dim] at positions at.position + i (paged: each row's
// own): the rotate-half RoPE (cos, sin [n_ctx, head_dim]) on queries and keys; queries to q [n,
// n_head, head_dim], keys and values into the cache `at` names, at their positions.
cudaError_t rope_store(Half type, const void* qkv, const void* cos, const void* sin, const CacheAt& at, void* q,
                       int64_t n, int64_t n_head, int64_t n_head_kv, int64_t head_dim, cudaStream_t stream);

// Rows qkv [n, (n_head + 2 n_head_kv) * head_dim], in place: each row's query and key heads turned
// by its own angle (cos, sin [n, head_dim], row r for row r; rope_store's rounding), value heads
// left as they are (the packed encoder's rows, each at its position in its own document).
cudaError_t rope_rows(Half type, void* qkv, const void* cos, const void* sin, int64_t n, int64_t n_head,
                      int64_t n_head_kv, int64_t head_dim, cudaStream_t stream);

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

// Attention of n_rows rows q [n_rows, n_head, head_dim] at positions cache.position + r over the
// cache `cache` names, causal (row r reads positions [0, params[0] + r]; paged: each row its own
// sequence's [0, positions[r]], through its block table), grouped-query heads, scale
// 1/sqrt(head_dim); out [n_rows, n_head, head_dim]. With joined keys and values [n_head_kv,
// n_joined, head_dim] (COMB's documents), rows at positions >= anchor also read them in the same
// softmax, each of their scores plus joined_bias[h] (float32 [n_head], or null). Each row's keys
// are split into `n_split` ranges attended apart (partial: float32 [n_rows, n_head, n_split,
// head_dim + 2] of scratch) and merged by their log-sum-exp. head_dim 32, 64, 128 or 256.
// Inside a captured graph the joined keys may be named by joined_params instead (device memory,
// read at replay): [keys, values, bias (0: none), n_joined (0: none), anchor], kJoinedParams values,
// the addresses as int64; the five fields before it are then unused. Row r reads those at
// joined_params + r * joined_row_stride (0: every row the same; kJoinedParams: each row its own,
// the paged step's rows of several requests).
constexpr int64_t kJoinedParams = 5;
struct RowsAttention {
  const void* q = nullptr;
  CacheAt cache;
  const void* joined_keys = nullptr;
  const void* joined_values = nullptr;
  const float* joined_bias = nullptr;
  int64_t n_joined = 0, anchor = 0;
  const int64_t* joined_params = nullptr;
  int64_t joined_row_stride = 0;
  void* out = nullptr;
  float* partial = nullptr;
  int64_t n_rows = 1, n_split = 1, n_head = 0, n_head_kv = 0, head_dim = 0;
};
cudaError_t rows_attention(Half type, const RowsAttention& args, cudaStream_t stream);

// rope_store and rows_attention in one launch: args.q names the rows' qkv product [n_rows, (n_head +
// 2 n_head_kv) * head_dim], not yet turned (cos, sin: rope_store's tables). Each block turns its
// queries; the rows' keys (turned) and values are written into the cache, and a row reads the keys
// of this launch's rows (its own and the rows before it; in a pool its own) from qkv instead; the
// splits are merged by the last block of each (row, KV head) to finish, through counters (int32
// [n_rows, n_head_kv] in device memory, all 0 before the launch and after it). args.out and the
// cache equal rope_store's then rows_attention's bit for bit. One sequence's cache only (a pool's
// rows may be one sequence's consecutive positions, whose keys this form would read from the cache
// while another block writes them): with args.cache.paged.table set, cudaErrorInvalidValue.
struct FusedRope {
  const void* cos = nullptr;
  const void* sin = nullptr;
  int* counters = nullptr;
};
cudaError_t rope_attention(Half type, const RowsAttention& args, const FusedRope& rope, cudaStream_t stream);

// One document's K/V of one cross block placed in the joined tensors a joint-attention layer reads
// (Plugin::joint_kv on a GPU): keys rotated by `angle` (a RoPE turn; negative turns back), values
// copied, both rounded once to Half. Sources [n_head_kv, len, head_dim], contiguous: int8 codes
// times their float16 scales (keys per channel [n_head_kv, 1, head_dim] or per row [n_head_kv,
// len, 1], values per row), float32, or Half. Out [rows, n_head_kv, m, head_dim], contiguous: the
// piece at row `row`, positions [offset, offset + len).
enum class JoinSource : int32_t { int8 = 0, f32 = 1, half = 2 };
struct JoinPiece {
  const void* keys = nullptr;
  const void* values = nullptr;
  const void* key_scales = nullptr;    // int8 only (float16)
  const void* value_scales = nullptr;  // int8 only (float16)
  void* out_keys = nullptr;
  void* out_values = nullptr;
  int64_t len = 0, m = 0, row = 0, offset = 0, angle = 0;
  JoinSource source = JoinSource::f32;
  int32_t keys_per_channel = 0;
};
// `pieces` (n_pieces of them, at most 65535) in device memory; cos, sin: float32 RoPE tables
// [n_ctx, head_dim] with |angle| < n_ctx; longest: the longest piece's len.
cudaError_t join_documents(Half type, const JoinPiece* pieces, int64_t n_pieces, int64_t longest, int64_t n_head_kv,
                           int64_t head_dim, const float* cos, const float* sin, cudaStream_t stream);

// One document's K/V of one block in int8 as the CPU keeps them (document_kv.ipp): a float16
// scale of amax / 127 (2^-14 to 65504; 1 where all are 0; NaN elements count for nothing in amax
// and are coded -127) per value row, and per key channel over
// the tokens where 2 len >= head_dim (keys_per_channel), else per key row; codes x / scale rounded
// half to even, clamped to [-127, 127]. The same IEEE operations in the same order, so the codes
// and scales equal the CPU's bit for bit. Sources [n_head_kv, len, head_dim] contiguous, float32
// (JoinSource::f32) or Half (JoinSource::half); codes the same shape; key scales [n_head_kv, 1,
// head_dim] or [n_head_kv, len, 1], value scales [n_head_kv, len, 1].
struct QuantPiece {
  const void* keys = nullptr;
  const void* values = nullptr;
  int8_t* key_codes = nullptr;
  int8_t* value_codes = nullptr;
  void* key_scales = nullptr;    // float16
  void* value_scales = nullptr;  // float16
  int64_t len = 0;
  JoinSource source = JoinSource::half;
  int32_t keys_per_channel = 0;
};
// `pieces` (at most 65535) in device memory; longest: the longest piece's len.
cudaError_t quantize_int8(Half type, const QuantPiece* pieces, int64_t n_pieces, int64_t longest, int64_t n_head_kv,
                          int64_t head_dim, cudaStream_t stream);

// Rows of K/V copied: element (h, t, j), t < len, of the keys at keys[h * key_head_stride + t *
// key_row_stride + j] (values likewise) to out_keys[h * out_head_stride + t * out_row_stride + j]
// (and out_values). One document's rows of one block cut out of a batch's (out [n_head_kv, len,
// head_dim] contiguous: out_head_stride len * head_dim, out_row_stride head_dim), or a packed
// sequence's keys laid out for the variable-length attention (out [keys, n_head_kv, head_dim]:
// out_head_stride head_dim, out_row_stride n_head_kv * head_dim). Elements of elem_bytes, 2 or 4 (a
// copy: any dtype of that size); strides in elements.
struct SplitPiece {
  const void* keys = nullptr;
  const void* values = nullptr;
  void* out_keys = nullptr;
  void* out_values = nullptr;
  int64_t len = 0, key_head_stride = 0, key_row_stride = 0, value_head_stride = 0, value_row_stride = 0;
  int64_t out_head_stride = 0, out_row_stride = 0;
};
// `pieces` (at most 65535) in device memory; longest: the longest piece's len.
cudaError_t split_documents(int elem_bytes, const SplitPiece* pieces, int64_t n_pieces, int64_t longest,
                            int64_t n_head_kv, int64_t head_dim, cudaStream_t stream);

}  // namespace comb::detail::cuda
