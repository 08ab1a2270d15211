#pragma once
// Fused fp32 CPU kernels for the decoder's small, latency-bound steps (decode and short chunks).
// Raw pointers and sizes only: no LibTorch here. Each kernel works on a range [begin, end) of
// independent items so that the caller can split the range across threads.
#include <cstdint>

namespace comb::detail::cpu {

// The instruction sets comb's kernels have paths for, narrowest first.
enum class Isa { scalar, avx2, avx512 };
// The widest this CPU runs: AVX-512F, else AVX2 with FMA, else scalar (portable loops).
Isa cpu_isa();
// What the kernels use: cpu_isa(), capped by the environment variable COMB_CPU_ISA (avx512, avx2 or
// scalar; read once, at the first call; a cap above the CPU's widest is that widest). An unknown
// value throws std::invalid_argument. Only comb's own kernels: oneDNN has ONEDNN_MAX_CPU_ISA and
// ATen ATEN_CPU_CAPABILITY (docs/building.md).
Isa kernel_isa();
const char* isa_name(Isa isa);
// "avx512", "avx2" or "scalar" as an Isa; anything else throws std::invalid_argument.
Isa parse_isa(const char* name);

// y[m, o] = sum_k x[m, k] * w[o, k] for rows o in [begin, end).
// x: [n_rows_x, k], w: [n_out, k] row-major, y: [n_rows_x, n_out]. Any n_rows_x: each result
// depends on its own row of x only (the same numbers whatever the other rows; batched decoding).
void gemv_rows(const float* x, int64_t n_rows_x, const float* w, int64_t k, float* y, int64_t n_out, int64_t begin,
               int64_t end);
// gemv_rows on a named instruction set (kernel_isa() for gemv_rows), which the CPU must have
// (else std::invalid_argument): the tests compare the paths. Each sums its products in its own
// order: AVX-512, 16 lanes of fused multiply-adds over k in order (the last chunk masked) and one
// horizontal sum; AVX2, 8 lanes likewise, a horizontal sum, then the last k % 8 products one by
// one; scalar (portable loops), 8 partial sums of rounded products over k in order, added
// pairwise, then the last k % 8 products one by one.
void gemv_rows_on(Isa isa, const float* x, int64_t n_rows_x, const float* w, int64_t k, float* y, int64_t n_out,
                  int64_t begin, int64_t end);

// gemv_rows over a matrix kept in groups of 32 weights along its rows (k a multiple of 32), each
// group dequantized as w = q * scale (+ min): a block of output rows at a time into a float buffer
// the tiles of gemv_rows then read. The dequantized weights are the float path's own (for a GGUF
// file's groups, whose products q * scale are exact in float32), so the results are gemv_rows's
// over them, bit for bit.
// Q8_0: q [n_out, k] int8, scale [n_out, k / 32].
void gemv_q8_rows(const float* x, int64_t n_rows_x, const int8_t* q, const float* scale, int64_t k, float* y,
                  int64_t n_out, int64_t begin, int64_t end);
// 4-bit groups: q [n_out, k / 2] uint8, a group's 32 weights in 16 bytes, byte j holding weight j
// in its low nibble and weight 16 + j in its high one; scale, min [n_out, k / 32].
void gemv_q4_rows(const float* x, int64_t n_rows_x, const uint8_t* q, const float* scale, const float* min, int64_t k,
                  float* y, int64_t n_out, int64_t begin, int64_t end);
// One row of such a matrix dequantized into w [k].
void dequantize_q8_row(const int8_t* q, const float* scale, int64_t k, float* w);
void dequantize_q4_row(const uint8_t* q, const float* scale, const float* min, int64_t k, float* w);

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight, for rows r in [begin, end). x, out: [rows, dim].
void rms_norm_rows(const float* x, const float* weight, float* out, int64_t dim, float eps, int64_t begin, int64_t end);

// out[r, j] = silu(in[r, j]) * in[r, n_ff + j] for rows r in [begin, end). in: [rows, 2 n_ff], out: [rows, n_ff].
void silu_mul_rows(const float* in, float* out, int64_t n_ff, int64_t begin, int64_t end);

// Shapes of one attention call (grouped-query heads, cache in [batch, n_head_kv, capacity, head_dim]).
struct AttentionShape {
  int64_t n_tokens;   // new tokens per sequence
  int64_t start;      // cached positions before them
  int64_t n_head, n_head_kv, head_dim, capacity;
};

// For tokens t in [begin, end) of a [batch * n_tokens] range, rotates q and k of qkv [.., q_dim + 2 kv_dim]
// (rotate-half RoPE with cos/sin rows [head_dim] at position start + i), writes q to q_out
// [batch * n_tokens, n_head, head_dim], and k, v into the caches at that position.
void rope_and_store(const float* qkv, const float* cos, const float* sin, const AttentionShape& s, float* q_out,
                    float* k_cache, float* v_cache, int64_t begin, int64_t end);

// Rows i in [0, n) of one head, x [n, head_dim] (row stride x_stride), rotated by a single
// cos/sin row [head_dim] (rotate-half RoPE) into y (row stride y_stride). RoPE composes, R(p + i) =
// R(p) R(i), so this moves keys computed at positions [0, n) to [p, p + n).
void rotate_rows(const float* x, int64_t x_stride, const float* cos, const float* sin, int64_t head_dim, int64_t n,
                 float* y, int64_t y_stride);

// Causal attention of q [batch * n_tokens, n_head, head_dim] over the caches, query i of a
// sequence seeing positions [0, start + i]. Items are (sequence, head) pairs in [begin, end);
// out: [batch * n_tokens, n_head * head_dim]. `scratch` holds start + n_tokens floats per call.
void attention_rows(const float* q, const float* k_cache, const float* v_cache, const AttentionShape& s, float* out,
                    float* scratch, int64_t begin, int64_t end);

// Shapes of decode attention over K/V kept in blocks of a pool: per layer, keys and values
// [n_blocks, n_head_kv, block_tokens, head_dim].
struct PagedShape {
  int64_t n_head, n_head_kv, head_dim, block_tokens;
};

// One decoding token's attention, heads h in [begin, end): q [n_head, head_dim] over the
// sequence's positions [0, n_keys), position p in block table[p / block_tokens] at row
// p % block_tokens. The same softmax also reads n_segments joined segments (a joint-attention
// plug-in's documents): keys joint_k[i], values joint_v[i] [n_head_kv, joint_n[i], head_dim],
// each score plus joint_bias[h] (joint_bias may be null: 0). out: [n_head, head_dim]; scratch:
// (sum of joint_n) + n_keys floats per call.
void paged_attention(const float* q, const float* k_pool, const float* v_pool, const int32_t* table, int64_t n_keys,
                     const float* const* joint_k, const float* const* joint_v, const int64_t* joint_n,
                     int64_t n_segments, const float* joint_bias, const PagedShape& s, float* out, float* scratch,
                     int64_t begin, int64_t end);

// The same for the n_head / n_head_kv query heads that share KV head `kvh`, every key and value
// read once for all of them; scratch: n_head / n_head_kv times (sum of joint_n + n_keys) floats.
// False (nothing done) where no such kernel fits the CPU and shapes: call paged_attention per head.
bool paged_attention_grouped(const float* q, const float* k_pool, const float* v_pool, const int32_t* table,
                             int64_t n_keys, const float* const* joint_k, const float* const* joint_v,
                             const int64_t* joint_n, int64_t n_segments, const float* joint_bias, const PagedShape& s,
                             float* out, float* scratch, int64_t kvh);

}  // namespace comb::detail::cpu
