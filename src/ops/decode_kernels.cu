// comb's fused decoder kernels on CUDA (declarations and the parameter block: decode_kernels.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "decode_kernels.hpp"

namespace comb::detail::cuda {

namespace {

__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ inline T from_float(float x);
template <>
__device__ inline __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// x rounded to T, as an ATen op on T tensors rounds its result.
template <typename T>
__device__ inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

template <typename T>
__device__ inline T* cache_of(const int64_t* params, int64_t slot) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(params[slot]));
}

// A CacheAt resolved on the device: from its parameter block, or its own fields.
template <typename T>
struct CacheView {
  int64_t position, capacity;
  T* keys;
  T* values;
};
template <typename T>
__device__ inline CacheView<T> resolve(const CacheAt& at) {
  if (at.params)
    return {at.params[kParamPosition], at.params[kParamCapacity], cache_of<T>(at.params, kParamCaches + at.layer),
            cache_of<T>(at.params, kParamCaches + at.n_layer + at.layer)};
  return {at.position, at.capacity, static_cast<T*>(at.keys), static_cast<T*>(at.values)};
}

// Whether row `row` is a graph bucket's padding (past the real rows its parameter block names):
// it neither writes the cache nor attends.
__device__ inline bool padding_row(const CacheAt& at, int64_t row) {
  return at.params && at.params[kParamRows] > 0 && row >= at.params[kParamRows];
}

// Row `row`'s position: its own in a pool, else the first row's plus row.
template <typename T>
__device__ inline int64_t row_position(const CacheAt& at, const CacheView<T>& cache, int64_t row) {
  return at.paged.table ? at.paged.positions[row] : cache.position + row;
}

// The element offset of KV head h's position p in row `row`'s cache: [n_head_kv, capacity,
// head_dim], or the block its table names in a pool [n_blocks, n_head_kv, block_tokens, head_dim].
__device__ inline int64_t kv_offset(const CacheAt& at, int64_t capacity, int64_t row, int64_t h, int64_t p,
                                    int64_t n_head_kv, int64_t head_dim) {
  if (!at.paged.table) return (h * capacity + p) * head_dim;
  const int64_t bt = at.paged.block_tokens;
  const int64_t block = at.paged.table[row * at.paged.max_blocks + p / bt];
  return ((block * n_head_kv + h) * bt + p % bt) * head_dim;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ inline float block_sum(float v) {
  __shared__ float warp_sums[32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float total = lane < n_warps ? warp_sums[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  __syncthreads();  // warp_sums may be reused by the caller's next call
  return total;
}

// ---- RMSNorm with the residual add --------------------------------------------------------------

template <typename T>
__global__ void add_rms_norm_kernel(T* residual, const T* delta, const T* weight, T* out, int64_t dim, float eps) {
  T* r = residual + blockIdx.x * dim;
  const T* d = delta ? delta + blockIdx.x * dim : nullptr;
  T* o = out + blockIdx.x * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = to_float(r[i]);
    if (d) {
      v = round_to<T>(v + to_float(d[i]));
      r[i] = from_float<T>(v);
    }
    sum += v * v;
  }
  sum = block_sum(sum);
  const float scale = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    o[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(r[i]) * scale));
}

// ---- RoPE and the cache append -----------------------------------------------------------------

// One thread per (row, head, i < head_dim / 2): queries and keys rotated (x * cos + rotate_half(x) *
// sin, each product and the sum rounded to T), values copied.
template <typename T>
__global__ void rope_store_kernel(const T* qkv, const T* cos, const T* sin, CacheAt at, T* q, int64_t n,
                                  int64_t n_head, int64_t n_head_kv, int64_t head_dim) {
  const int64_t half = head_dim / 2, heads = n_head + 2 * n_head_kv;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * heads * half) return;
  const int64_t i = idx % half, h = (idx / half) % heads, row = idx / (half * heads);
  if (padding_row(at, row)) return;
  const CacheView<T> cache = resolve<T>(at);
  const int64_t pos = row_position(at, cache, row), capacity = cache.capacity;
  const T* src = qkv + row * heads * head_dim + h * head_dim;
  const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
  if (h >= n_head + n_head_kv) {  // a value head: into the cache as it is
    T* v = cache.values + kv_offset(at, capacity, row, h - n_head - n_head_kv, pos, n_head_kv, head_dim);
    v[i] = src[i];
    v[i + half] = src[i + half];
    return;
  }
  const T* c = cos + pos * head_dim;
  const T* s = sin + pos * head_dim;
  const float y1 = round_to<T>(round_to<T>(x1 * to_float(c[i])) + round_to<T>(-x2 * to_float(s[i])));
  const float y2 = round_to<T>(round_to<T>(x2 * to_float(c[i + half])) + round_to<T>(x1 * to_float(s[i + half])));
  T* dst = h < n_head ? q + (row * n_head + h) * head_dim
                      : cache.keys + kv_offset(at, capacity, row, h - n_head, pos, n_head_kv, head_dim);
  dst[i] = from_float<T>(y1);
  dst[i + half] = from_float<T>(y2);
}

// One thread per (row, query or key head, i < head_dim / 2): rotated in place by the row's own
// cos and sin rows, each product and the sum rounded to T (as rope_store_kernel).
template <typename T>
__global__ void rope_rows_kernel(T* qkv, const T* cos, const T* sin, int64_t n, int64_t n_rotated, int64_t heads,
                                 int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * n_rotated * half) return;
  const int64_t i = idx % half, h = (idx / half) % n_rotated, row = idx / (half * n_rotated);
  T* x = qkv + (row * heads + h) * head_dim;
  const T* c = cos + row * head_dim;
  const T* s = sin + row * head_dim;
  const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
  const float y1 = round_to<T>(round_to<T>(x1 * to_float(c[i])) + round_to<T>(-x2 * to_float(s[i])));
  const float y2 = round_to<T>(round_to<T>(x2 * to_float(c[i + half])) + round_to<T>(x1 * to_float(s[i + half])));
  x[i] = from_float<T>(y1);
  x[i + half] = from_float<T>(y2);
}

// ---- Cached keys moved to another position ------------------------------------------------------

// One thread per (head, row, i < head_dim / 2): keys k [n_head_kv, n, head_dim] (row stride
// k_row, head stride k_head) rotated by the angle of `position` (cos, sin: that position's row)
// into the cache [n_head_kv, capacity, head_dim] at positions [position, position + n).
template <typename T>
__global__ void rotate_keys_kernel(const T* k, int64_t k_head, int64_t k_row, const T* cos, const T* sin, T* cache,
                                   int64_t capacity, int64_t position, int64_t n, int64_t n_head_kv,
                                   int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_head_kv * n * half) return;
  const int64_t i = idx % half, row = (idx / half) % n, h = idx / (half * n);
  const T* src = k + h * k_head + row * k_row;
  const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
  const float y1 = round_to<T>(round_to<T>(x1 * to_float(cos[i])) + round_to<T>(-x2 * to_float(sin[i])));
  const float y2 = round_to<T>(round_to<T>(x2 * to_float(cos[i + half])) + round_to<T>(x1 * to_float(sin[i + half])));
  T* dst = cache + (h * capacity + position + row) * head_dim;
  dst[i] = from_float<T>(y1);
  dst[i + half] = from_float<T>(y2);
}

// ---- One row times a matrix -----------------------------------------------------------------------

__device__ inline float2 to_float2(const __nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ inline float2 to_float2(const __half2 v) { return __half22float2(v); }
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
};
template <>
struct Pair<__half> {
  using type = __half2;
};

constexpr int kGemvWarps = 8;

// y [n] = w [n, k] x [k]: x staged in shared memory, each warp one row at a time, 16-byte loads of
// the weights (8 values a lane a step), float32 sums, one rounding to T. k a multiple of 8, w and x
// 16-byte aligned.
template <typename T>
__global__ void gemv_kernel(const T* __restrict__ w, const T* __restrict__ x, T* __restrict__ y, int64_t n,
                            int64_t k) {
  extern __shared__ uint4 staged[];
  using P = typename Pair<T>::type;
  const int64_t vectors = k / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) staged[v] = xv[v];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp; row < n;
       row += static_cast<int64_t>(gridDim.x) * kGemvWarps) {
    const uint4* wr = reinterpret_cast<const uint4*>(w + row * k);
    float acc = 0.0f;
#pragma unroll 4
    for (int64_t v = lane; v < vectors; v += 32) {
      const uint4 a = __ldg(wr + v), b = staged[v];
      const P* ap = reinterpret_cast<const P*>(&a);
      const P* bp = reinterpret_cast<const P*>(&b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 fa = to_float2(ap[i]), fb = to_float2(bp[i]);
        acc += fa.x * fb.x + fa.y * fb.y;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0) y[row] = from_float<T>(acc);
  }
}

// ---- SwiGLU's activation ------------------------------------------------------------------------

template <typename T>
__global__ void silu_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t n_ff) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * n_ff) return;
  const int64_t row = idx / n_ff, i = idx % n_ff;
  const float g = to_float(gate_up[row * 2 * n_ff + i]), u = to_float(gate_up[row * 2 * n_ff + n_ff + i]);
  out[idx] = from_float<T>(round_to<T>(g / (1.0f + expf(-g))) * u);
}

// ---- Attention of a few rows, split over the keys ------------------------------------------------

constexpr int kAttnWarps = 4;
constexpr int kMaxGroup = 8;  // query heads per KV head handled at once (more: in rounds)

// What rows read besides their causal context: a joined segment of keys and values [n_head_kv, m,
// head_dim] in the same softmax, each score plus bias[h]; rows at positions before `anchor` read none.
template <typename T>
struct Joined {
  const T* keys = nullptr;
  const T* values = nullptr;
  const float* bias = nullptr;
  int64_t m = 0, anchor = 0;
  const int64_t* params = nullptr;  // when set: the fields above read from it (RowsAttention::joined_params)
  int64_t row_stride = 0;           // row r's at params + r * row_stride
};
template <typename T>
__device__ inline Joined<T> resolve_joined(const Joined<T>& j, int64_t row) {
  if (!j.params) return j;
  const int64_t* p = j.params + row * j.row_stride;
  Joined<T> r;
  r.keys = reinterpret_cast<const T*>(p[0]);
  r.values = reinterpret_cast<const T*>(p[1]);
  r.bias = reinterpret_cast<const float*>(p[2]);
  r.m = r.keys ? p[3] : 0;
  r.anchor = p[4];
  return r;
}

// What the fused form of the rows kernel (rope_attention) reads and writes besides: the RoPE tables,
// one counter per (row, KV head) and the merged output.
template <typename T>
struct Fusion {
  const T* cos = nullptr;
  const T* sin = nullptr;
  int* counters = nullptr;
  T* out = nullptr;
};

// Element d = lane * E + e of a head of head_dim 32 E, x, turned as rope_store_kernel turns it
// (each product and the sum rounded to T): its partner d -+ head_dim / 2 lies in lane ^ 16. c, s:
// the position's rows of the tables. Every lane of the warp calls it (a shuffle).
template <typename T, int E>
__device__ inline float rotate_element(float x, int lane, int e, const T* c, const T* s) {
  const float partner = __shfl_xor_sync(0xffffffffu, x, 16);
  const int d = lane * E + e;
  const float sine = to_float(s[d]);
  return round_to<T>(round_to<T>(x * to_float(c[d])) + round_to<T>(lane < 16 ? -partner * sine : partner * sine));
}

// Splits (n_split of them, each (head_dim + 2) floats: output, log-sum-exp) merged into element d by
// their log-sum-exp. Read past the L1 cache: in the fused kernel other blocks wrote them.
__device__ inline float merge_splits(const float* p, int n_split, int head_dim, int d) {
  float top = -INFINITY;
  for (int s = 0; s < n_split; ++s) top = fmaxf(top, __ldcg(p + s * (head_dim + 2) + head_dim));
  float total = 0.0f, sum = 0.0f;
  for (int s = 0; s < n_split; ++s) {
    const float lse = __ldcg(p + s * (head_dim + 2) + head_dim);
    if (lse == -INFINITY) continue;
    const float f = expf(lse - top);
    total += f;
    sum += f * __ldcg(p + s * (head_dim + 2) + d);
  }
  return sum / total;
}

// Block (KV head, split, row): row r (at position at.position + r) reads the joined keys (when its
// position is past the anchor) followed by its context [0, position], as one sequence split into
// n_split ranges. The range's keys are shared by the block's warps, every query head of the group
// scored against each key once it is loaded; the warps' partial softmaxes are merged in shared
// memory and written as (output, log-sum-exp) per query head.
// kFused (rope_attention): q is the rows' qkv product, not yet turned. The block turns its queries
// itself; the keys of positions this launch computes (the first row's onward; in a pool the row's
// own) come from qkv, turned, instead of the cache, and split 0's block writes its row's key and
// value there. The last block of a (row, KV head) to finish merges the splits into fused.out. Every
// value is rounded where rope_store and the merge kernel round it, so the output equals theirs bit
// for bit.
template <typename T, int E, bool kFused>
__global__ void rows_attention_kernel(const T* q, CacheAt at, Joined<T> joined_at, Fusion<T> fused, float* partial,
                                      int n_split, int n_head, int n_head_kv) {
  constexpr int HD = 32 * E;
  __shared__ float merge[kAttnWarps][kMaxGroup][HD + 2];
  const int kvh = blockIdx.x, split = blockIdx.y, row = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (padding_row(at, row)) return;  // (the whole block: no barrier is left waiting)
  const CacheView<T> cache = resolve<T>(at);
  const Joined<T> joined = resolve_joined(joined_at, row);
  const int64_t position = row_position(at, cache, row), capacity = cache.capacity;
  const int64_t m = joined.m > 0 && position >= joined.anchor ? joined.m : 0;
  const T* joined_keys = joined.keys + kvh * joined.m * HD;
  const T* joined_values = joined.values + kvh * joined.m * HD;
  const int64_t len = m + position + 1;
  const int64_t chunk = (len + n_split - 1) / n_split;
  const int64_t begin = split * chunk, end = begin + chunk < len ? begin + chunk : len;
  const int group = n_head / n_head_kv;
  const float scale = rsqrtf(static_cast<float>(HD));
  // kFused: the qkv rows' width and the first position whose key this launch computes.
  const int64_t heads = n_head + 2 * n_head_kv;
  const int64_t first_new = at.paged.table ? position : cache.position;
  if constexpr (kFused) {
    if (split == 0 && warp == 0) {  // the row's key (turned) and value into the cache
      const T* src = q + (row * heads + n_head + kvh) * HD;
      const int64_t off = kv_offset(at, capacity, row, kvh, position, n_head_kv, HD);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        const float k = rotate_element<T, E>(to_float(src[d]), lane, e, fused.cos + position * HD,
                                             fused.sin + position * HD);
        cache.keys[off + d] = from_float<T>(k);
        cache.values[off + d] = src[n_head_kv * HD + d];
      }
    }
  }
  for (int g0 = 0; g0 < group; g0 += kMaxGroup) {
    const int gn = group - g0 < kMaxGroup ? group - g0 : kMaxGroup;
    float qr[kMaxGroup][E], acc[kMaxGroup][E], mx[kMaxGroup], l[kMaxGroup], bias[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      mx[g] = -INFINITY, l[g] = 0.0f;
      bias[g] = g < gn && joined.bias ? joined.bias[kvh * group + g0 + g] : 0.0f;
      const int64_t head = kvh * group + g0 + g;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        acc[g][e] = 0.0f;
        if constexpr (kFused) {  // every lane shuffles, the heads past the group's with zeros
          const float x = g < gn ? to_float(q[(row * heads + head) * HD + lane * E + e]) : 0.0f;
          qr[g][e] = rotate_element<T, E>(x, lane, e, fused.cos + position * HD, fused.sin + position * HD) * scale;
        } else {
          qr[g][e] = g < gn ? to_float(q[(static_cast<int64_t>(row) * n_head + head) * HD + lane * E + e]) * scale
                            : 0.0f;
        }
      }
    }
    for (int64_t j = begin + warp; j < end; j += kAttnWarps) {
      const bool from_joined = j < m;
      float k[E], v[E];
      if (kFused && !from_joined && j - m >= first_new) {  // computed by this launch: from qkv (the warp alike)
        const int64_t p = j - m;
        const T* src = q + ((at.paged.table ? row : p - cache.position) * heads + n_head + kvh) * HD;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          k[e] = rotate_element<T, E>(to_float(src[lane * E + e]), lane, e, fused.cos + p * HD, fused.sin + p * HD);
          v[e] = to_float(src[n_head_kv * HD + lane * E + e]);
        }
      } else {
        const int64_t at_j = from_joined ? 0 : kv_offset(at, capacity, row, kvh, j - m, n_head_kv, HD);
        const T* kp = from_joined ? joined_keys + j * HD : cache.keys + at_j;
        const T* vp = from_joined ? joined_values + j * HD : cache.values + at_j;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          k[e] = to_float(kp[lane * E + e]);
          v[e] = to_float(vp[lane * E + e]);
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= gn) break;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) s += qr[g][e] * k[e];
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (from_joined) s += bias[g];
        const float m_new = fmaxf(mx[g], s);
        const float shrink = expf(mx[g] - m_new), p = expf(s - m_new);
        l[g] = l[g] * shrink + p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * shrink + p * v[e];
        mx[g] = m_new;
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= gn) break;
#pragma unroll
      for (int e = 0; e < E; ++e) merge[warp][g][lane * E + e] = acc[g][e];
      if (lane == 0) merge[warp][g][HD] = mx[g], merge[warp][g][HD + 1] = l[g];
    }
    __syncthreads();
    for (int t = threadIdx.x; t < gn * HD; t += blockDim.x) {
      const int g = t / HD, d = t % HD;
      float top = -INFINITY;
      for (int w = 0; w < kAttnWarps; ++w) top = fmaxf(top, merge[w][g][HD]);
      float total = 0.0f, sum = 0.0f;
      if (top != -INFINITY)
        for (int w = 0; w < kAttnWarps; ++w) {
          const float f = expf(merge[w][g][HD] - top);
          total += f * merge[w][g][HD + 1];
          sum += f * merge[w][g][d];
        }
      float* out = partial +
                   ((static_cast<int64_t>(row) * n_head + kvh * group + g0 + g) * n_split + split) * (HD + 2);
      out[d] = total > 0.0f ? sum / total : 0.0f;
      if (d == 0) out[HD] = total > 0.0f ? top + logf(total) : -INFINITY;
    }
    __syncthreads();
  }
  if constexpr (kFused) {
    // The last of the (row, KV head)'s n_split blocks to get here merges them (each block's
    // partials made visible before it counts itself), then sets the counter back to 0.
    __shared__ bool last;
    __syncthreads();  // every thread's partials written
    if (threadIdx.x == 0) {
      int* counter = fused.counters + static_cast<int64_t>(row) * n_head_kv + kvh;
      __threadfence();  // the block's partials visible before it counts itself
      last = atomicAdd(counter, 1) == n_split - 1;
      if (last) {
        *counter = 0;
        __threadfence();  // the other blocks' partials seen before the merge reads them
      }
    }
    __syncthreads();
    if (!last) return;
    for (int t = threadIdx.x; t < group * HD; t += blockDim.x) {
      const int64_t rh = static_cast<int64_t>(row) * n_head + kvh * group + t / HD;
      fused.out[rh * HD + t % HD] = from_float<T>(merge_splits(partial + rh * n_split * (HD + 2), n_split, HD, t % HD));
    }
  }
}

// Block (row, head): its splits merged by their log-sum-exp, one thread per output element.
template <typename T>
__global__ void merge_splits_kernel(const float* partial, T* out, int n_split, int head_dim) {
  const int64_t rh = blockIdx.x;
  const int d = threadIdx.x;
  if (d >= head_dim) return;
  out[rh * head_dim + d] = from_float<T>(merge_splits(partial + rh * n_split * (head_dim + 2), n_split, head_dim, d));
}

template <typename T, int E>
cudaError_t launch_attention(const RowsAttention& a, const FusedRope* rope, cudaStream_t stream) {
  Joined<T> joined;
  joined.keys = static_cast<const T*>(a.joined_keys);
  joined.values = static_cast<const T*>(a.joined_values);
  joined.bias = a.joined_bias;
  joined.m = a.joined_keys ? a.n_joined : 0;
  joined.anchor = a.anchor;
  joined.params = a.joined_params;
  joined.row_stride = a.joined_row_stride;
  const dim3 grid(a.n_head_kv, a.n_split, a.n_rows);
  if (rope) {
    Fusion<T> fused;
    fused.cos = static_cast<const T*>(rope->cos), fused.sin = static_cast<const T*>(rope->sin);
    fused.counters = rope->counters, fused.out = static_cast<T*>(a.out);
    rows_attention_kernel<T, E, true><<<grid, kAttnWarps * 32, 0, stream>>>(
        static_cast<const T*>(a.q), a.cache, joined, fused, a.partial, static_cast<int>(a.n_split),
        static_cast<int>(a.n_head), static_cast<int>(a.n_head_kv));
    return cudaGetLastError();
  }
  rows_attention_kernel<T, E, false><<<grid, kAttnWarps * 32, 0, stream>>>(
      static_cast<const T*>(a.q), a.cache, joined, Fusion<T>{}, a.partial, static_cast<int>(a.n_split),
      static_cast<int>(a.n_head), static_cast<int>(a.n_head_kv));
  merge_splits_kernel<T><<<a.n_rows * a.n_head, 32 * E, 0, stream>>>(a.partial, static_cast<T*>(a.out),
                                                                    static_cast<int>(a.n_split), 32 * E);
  return cudaGetLastError();
}

template <typename T>
cudaError_t attention_by_width(const RowsAttention& a, const FusedRope* rope, cudaStream_t stream) {
  switch (a.head_dim) {
    case 32: return launch_attention<T, 1>(a, rope, stream);
    case 64: return launch_attention<T, 2>(a, rope, stream);
    case 128: return launch_attention<T, 4>(a, rope, stream);
    case 256: return launch_attention<T, 8>(a, rope, stream);
    default: return cudaErrorInvalidValue;
  }
}

int64_t blocks_for(int64_t n, int threads) { return (n + threads - 1) / threads; }

// ---- Linked documents joined for a joint-attention layer ------------------------------------------

// A source value as float32: an int8 code times its scale, float32, or Half.
template <typename T>
__device__ inline float join_load(JoinSource source, const void* data, int64_t at, const void* scales,
                                  int64_t scale_at) {
  switch (source) {
    case JoinSource::int8:
      return static_cast<float>(static_cast<const int8_t*>(data)[at]) *
             __half2float(static_cast<const __half*>(scales)[scale_at]);
    case JoinSource::f32: return static_cast<const float*>(data)[at];
    default: return to_float(static_cast<const T*>(data)[at]);
  }
}

// ---- int8 K/V as the CPU keeps them ---------------------------------------------------------------

// A source value as float32 (float32 or T).
template <typename T>
__device__ inline float quant_load(JoinSource source, const void* data, int64_t at) {
  return source == JoinSource::f32 ? static_cast<const float*>(data)[at] : to_float(static_cast<const T*>(data)[at]);
}

// The float16 scale of a largest magnitude (document_kv.ipp's int8_scale) and a code.
__device__ inline __half quant_scale(float amax) {
  const float s = amax / 127.0f;
  return __float2half_rn(s > 0.0f ? fminf(fmaxf(s, 6.103515625e-05f), 65504.0f) : 1.0f);
}
__device__ inline int8_t quant_code(float x, float scale) {
  return static_cast<int8_t>(fminf(127.0f, fmaxf(-127.0f, rintf(__fdiv_rn(x, scale)))));
}

constexpr int kQuantWarps = 8;

// Block (kQuantWarps rows, piece): a warp per row of head_dim values: value rows, then key rows
// where the piece's keys are scaled per row.
template <typename T>
__global__ void quantize_rows_kernel(const QuantPiece* pieces, int64_t n_head_kv, int64_t head_dim) {
  const QuantPiece p = pieces[blockIdx.y];
  const int64_t rows = n_head_kv * p.len;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kQuantWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= 2 * rows || (r >= rows && p.keys_per_channel)) return;
  const bool key = r >= rows;
  const int64_t row = key ? r - rows : r;
  const void* src = key ? p.keys : p.values;
  int8_t* codes = (key ? p.key_codes : p.value_codes) + row * head_dim;
  __half* scale = static_cast<__half*>(key ? p.key_scales : p.value_scales) + row;
  float amax = 0.0f;
  for (int64_t j = lane; j < head_dim; j += 32) amax = fmaxf(amax, fabsf(quant_load<T>(p.source, src, row * head_dim + j)));
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const __half h = quant_scale(amax);
  const float sf = __half2float(h);
  if (lane == 0) *scale = h;
  for (int64_t j = lane; j < head_dim; j += 32) codes[j] = quant_code(quant_load<T>(p.source, src, row * head_dim + j), sf);
}

// Block (range of (head, channel) pairs, piece): keys scaled per channel over the piece's tokens.
template <typename T>
__global__ void quantize_channels_kernel(const QuantPiece* pieces, int64_t n_head_kv, int64_t head_dim) {
  const QuantPiece p = pieces[blockIdx.y];
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!p.keys_per_channel || idx >= n_head_kv * head_dim) return;
  const int64_t h = idx / head_dim, j = idx % head_dim;
  const int64_t base = h * p.len * head_dim + j;
  float amax = 0.0f;
  for (int64_t t = 0; t < p.len; ++t) amax = fmaxf(amax, fabsf(quant_load<T>(p.source, p.keys, base + t * head_dim)));
  const __half h16 = quant_scale(amax);
  const float sf = __half2float(h16);
  static_cast<__half*>(p.key_scales)[idx] = h16;
  for (int64_t t = 0; t < p.len; ++t)
    p.key_codes[base + t * head_dim] = quant_code(quant_load<T>(p.source, p.keys, base + t * head_dim), sf);
}

// Block (range of a piece's (head, token, channel) elements, piece): one key and one value element
// copied per thread (consecutive threads: consecutive channels, read and written contiguously).
template <typename E>
__global__ void split_documents_kernel(const SplitPiece* pieces, int64_t n_head_kv, int64_t head_dim) {
  const SplitPiece p = pieces[blockIdx.y];
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_head_kv * p.len * head_dim) return;
  const int64_t j = idx % head_dim, t = (idx / head_dim) % p.len, h = idx / (head_dim * p.len);
  const int64_t to = h * p.out_head_stride + t * p.out_row_stride + j;
  static_cast<E*>(p.out_keys)[to] = static_cast<const E*>(p.keys)[h * p.key_head_stride + t * p.key_row_stride + j];
  static_cast<E*>(p.out_values)[to] =
      static_cast<const E*>(p.values)[h * p.value_head_stride + t * p.value_row_stride + j];
}

// Block (range of a piece's (head, token, i < head_dim / 2) triples, piece): one key pair rotated
// and one value pair copied per thread.
template <typename T>
__global__ void join_documents_kernel(const JoinPiece* pieces, int64_t n_head_kv, int64_t head_dim, const float* cos,
                                      const float* sin) {
  const JoinPiece p = pieces[blockIdx.y];
  const int64_t half = head_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_head_kv * p.len * half) return;
  const int64_t i = idx % half, t = (idx / half) % p.len, h = idx / (half * p.len);
  const int64_t src = (h * p.len + t) * head_dim;
  const int64_t dst = ((p.row * n_head_kv + h) * p.m + p.offset + t) * head_dim;
  const int64_t ks1 = p.keys_per_channel ? h * head_dim + i : h * p.len + t;
  const int64_t ks2 = p.keys_per_channel ? ks1 + half : ks1;
  const float k1 = join_load<T>(p.source, p.keys, src + i, p.key_scales, ks1);
  const float k2 = join_load<T>(p.source, p.keys, src + i + half, p.key_scales, ks2);
  const float v1 = join_load<T>(p.source, p.values, src + i, p.value_scales, h * p.len + t);
  const float v2 = join_load<T>(p.source, p.values, src + i + half, p.value_scales, h * p.len + t);
  // R(angle) by the rotate-half rule; cos(-a) = cos(a), sin(-a) = -sin(a).
  const int64_t a = p.angle < 0 ? -p.angle : p.angle;
  const float sign = p.angle < 0 ? -1.0f : 1.0f;
  const float c1 = cos[a * head_dim + i], c2 = cos[a * head_dim + i + half];
  const float s1 = sign * sin[a * head_dim + i], s2 = sign * sin[a * head_dim + i + half];
  T* ok = static_cast<T*>(p.out_keys) + dst;
  T* ov = static_cast<T*>(p.out_values) + dst;
  ok[i] = from_float<T>(k1 * c1 - k2 * s1);
  ok[i + half] = from_float<T>(k2 * c2 + k1 * s2);
  ov[i] = from_float<T>(v1);
  ov[i + half] = from_float<T>(v2);
}

}  // namespace

cudaError_t quantize_int8(Half type, const QuantPiece* pieces, int64_t n_pieces, int64_t longest, int64_t n_head_kv,
                          int64_t head_dim, cudaStream_t stream) {
  if (n_pieces > 65535) return cudaErrorInvalidValue;
  if (n_pieces == 0 || longest == 0 || n_head_kv == 0 || head_dim == 0) return cudaSuccess;
  const int threads = kQuantWarps * 32;
  const dim3 rows(static_cast<unsigned>(blocks_for(2 * n_head_kv * longest, kQuantWarps)),
                  static_cast<unsigned>(n_pieces));
  const dim3 channels(static_cast<unsigned>(blocks_for(n_head_kv * head_dim, threads)), static_cast<unsigned>(n_pieces));
  if (type == Half::bf16) {
    quantize_rows_kernel<__nv_bfloat16><<<rows, threads, 0, stream>>>(pieces, n_head_kv, head_dim);
    quantize_channels_kernel<__nv_bfloat16><<<channels, threads, 0, stream>>>(pieces, n_head_kv, head_dim);
  } else {
    quantize_rows_kernel<__half><<<rows, threads, 0, stream>>>(pieces, n_head_kv, head_dim);
    quantize_channels_kernel<__half><<<channels, threads, 0, stream>>>(pieces, n_head_kv, head_dim);
  }
  return cudaGetLastError();
}

cudaError_t split_documents(int elem_bytes, const SplitPiece* pieces, int64_t n_pieces, int64_t longest,
                            int64_t n_head_kv, int64_t head_dim, cudaStream_t stream) {
  if (n_pieces > 65535 || (elem_bytes != 2 && elem_bytes != 4)) return cudaErrorInvalidValue;
  const int64_t total = n_head_kv * longest * head_dim;
  if (n_pieces == 0 || total == 0) return cudaSuccess;
  const int threads = 256;
  const dim3 grid(static_cast<unsigned>(blocks_for(total, threads)), static_cast<unsigned>(n_pieces));
  if (elem_bytes == 2)
    split_documents_kernel<uint16_t><<<grid, threads, 0, stream>>>(pieces, n_head_kv, head_dim);
  else
    split_documents_kernel<uint32_t><<<grid, threads, 0, stream>>>(pieces, n_head_kv, head_dim);
  return cudaGetLastError();
}

cudaError_t join_documents(Half type, const JoinPiece* pieces, int64_t n_pieces, int64_t longest, int64_t n_head_kv,
                           int64_t head_dim, const float* cos, const float* sin, cudaStream_t stream) {
  if (n_pieces > 65535 || head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int64_t total = n_head_kv * longest * (head_dim / 2);
  if (n_pieces == 0 || total == 0) return cudaSuccess;
  const int threads = 256;
  const dim3 grid(static_cast<unsigned>(blocks_for(total, threads)), static_cast<unsigned>(n_pieces));
  if (type == Half::bf16)
    join_documents_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(pieces, n_head_kv, head_dim, cos, sin);
  else
    join_documents_kernel<__half><<<grid, threads, 0, stream>>>(pieces, n_head_kv, head_dim, cos, sin);
  return cudaGetLastError();
}

cudaError_t add_rms_norm(Half type, void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                         int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = dim >= 4096 ? 1024 : dim >= 1024 ? 512 : 256;
  if (type == Half::bf16)
    add_rms_norm_kernel<<<rows, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(residual),
                                                      static_cast<const __nv_bfloat16*>(delta),
                                                      static_cast<const __nv_bfloat16*>(weight),
                                                      static_cast<__nv_bfloat16*>(out), dim, eps);
  else
    add_rms_norm_kernel<<<rows, threads, 0, stream>>>(static_cast<__half*>(residual), static_cast<const __half*>(delta),
                                                      static_cast<const __half*>(weight), static_cast<__half*>(out),
                                                      dim, eps);
  return cudaGetLastError();
}

cudaError_t rope_store(Half type, const void* qkv, const void* cos, const void* sin, const CacheAt& at, void* q,
                       int64_t n, int64_t n_head, int64_t n_head_kv, int64_t head_dim, cudaStream_t stream) {
  const int64_t total = n * (n_head + 2 * n_head_kv) * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  if (type == Half::bf16)
    rope_store_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(qkv), static_cast<const __nv_bfloat16*>(cos),
        static_cast<const __nv_bfloat16*>(sin), at, static_cast<__nv_bfloat16*>(q), n, n_head,
        n_head_kv, head_dim);
  else
    rope_store_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<const __half*>(qkv), static_cast<const __half*>(cos), static_cast<const __half*>(sin), at,
        static_cast<__half*>(q), n, n_head, n_head_kv, head_dim);
  return cudaGetLastError();
}

cudaError_t rope_rows(Half type, void* qkv, const void* cos, const void* sin, int64_t n, int64_t n_head,
                      int64_t n_head_kv, int64_t head_dim, cudaStream_t stream) {
  const int64_t n_rotated = n_head + n_head_kv, heads = n_head + 2 * n_head_kv;
  const int64_t total = n * n_rotated * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  if (type == Half::bf16)
    rope_rows_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(qkv), static_cast<const __nv_bfloat16*>(cos),
        static_cast<const __nv_bfloat16*>(sin), n, n_rotated, heads, head_dim);
  else
    rope_rows_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<__half*>(qkv), static_cast<const __half*>(cos), static_cast<const __half*>(sin), n, n_rotated,
        heads, head_dim);
  return cudaGetLastError();
}

cudaError_t rotate_keys(Half type, const void* k, int64_t k_head, int64_t k_row, const void* cos, const void* sin,
                        void* cache, int64_t capacity, int64_t position, int64_t n, int64_t n_head_kv,
                        int64_t head_dim, cudaStream_t stream) {
  const int64_t total = n_head_kv * n * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  if (type == Half::bf16)
    rotate_keys_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(k), k_head, k_row, static_cast<const __nv_bfloat16*>(cos),
        static_cast<const __nv_bfloat16*>(sin), static_cast<__nv_bfloat16*>(cache), capacity, position, n, n_head_kv,
        head_dim);
  else
    rotate_keys_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<const __half*>(k), k_head, k_row, static_cast<const __half*>(cos), static_cast<const __half*>(sin),
        static_cast<__half*>(cache), capacity, position, n, n_head_kv, head_dim);
  return cudaGetLastError();
}

cudaError_t gemv(Half type, const void* w, const void* x, void* y, int64_t n, int64_t k, int max_blocks,
                 cudaStream_t stream) {
  if (k % 8 != 0 || reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      k * 2 > kGemvMaxShared)
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kGemvWarps - 1) / kGemvWarps, max_blocks);
  const size_t shared = static_cast<size_t>(k) * 2;
  if (type == Half::bf16)
    gemv_kernel<<<blocks, kGemvWarps * 32, shared, stream>>>(static_cast<const __nv_bfloat16*>(w),
                                                              static_cast<const __nv_bfloat16*>(x),
                                                              static_cast<__nv_bfloat16*>(y), n, k);
  else
    gemv_kernel<<<blocks, kGemvWarps * 32, shared, stream>>>(static_cast<const __half*>(w), static_cast<const __half*>(x),
                                                              static_cast<__half*>(y), n, k);
  return cudaGetLastError();
}

cudaError_t silu_mul(Half type, const void* gate_up, void* out, int64_t rows, int64_t n_ff, cudaStream_t stream) {
  const int64_t total = rows * n_ff;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  if (type == Half::bf16)
    silu_mul_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(gate_up), static_cast<__nv_bfloat16*>(out), rows, n_ff);
  else
    silu_mul_kernel<<<blocks_for(total, threads), threads, 0, stream>>>(static_cast<const __half*>(gate_up),
                                                                        static_cast<__half*>(out), rows, n_ff);
  return cudaGetLastError();
}

namespace {
bool attention_shape_ok(const RowsAttention& a) {
  return a.n_split >= 1 && a.n_rows >= 1 && a.n_head_kv >= 1 && a.n_head % a.n_head_kv == 0 && a.n_split <= 65535 &&
         a.n_rows <= 65535;
}
}  // namespace

cudaError_t rows_attention(Half type, const RowsAttention& a, cudaStream_t stream) {
  if (!attention_shape_ok(a)) return cudaErrorInvalidValue;
  return type == Half::bf16 ? attention_by_width<__nv_bfloat16>(a, nullptr, stream)
                            : attention_by_width<__half>(a, nullptr, stream);
}

cudaError_t rope_attention(Half type, const RowsAttention& a, const FusedRope& rope, cudaStream_t stream) {
  if (!attention_shape_ok(a) || !a.q || !a.out || !rope.cos || !rope.sin || !rope.counters || a.cache.paged.table)
    return cudaErrorInvalidValue;
  return type == Half::bf16 ? attention_by_width<__nv_bfloat16>(a, &rope, stream)
                            : attention_by_width<__half>(a, &rope, stream);
}

}  // namespace comb::detail::cuda
