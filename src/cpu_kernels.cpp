// Fused fp32 CPU kernels (see include/comb/detail/cpu_kernels.hpp). AVX2+FMA where the CPU has
// it (chosen at run time), portable loops otherwise. No LibTorch here.
#include "comb/detail/cpu_kernels.hpp"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#define COMB_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace comb::detail::cpu {

namespace {

#if defined(__x86_64__)
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

COMB_AVX2 inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

COMB_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One weight row at a time, four independent accumulators; the row stays in L1 for the other x rows.
// NOTE: decode is bound by reading the weights once; this streams them at close to DRAM speed.
COMB_AVX2 void gemv_avx2(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n_out, int64_t begin,
                         int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    const float* row = w + o * k;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t i = 0;
      for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(row + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 8), _mm256_loadu_ps(row + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 16), _mm256_loadu_ps(row + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 24), _mm256_loadu_ps(row + i + 24), a3);
      }
      for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(row + i), a0);
      float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; i < k; ++i) sum += xr[i] * row[i];
      y[r * n_out + o] = sum;
    }
  }
}
#endif

#if defined(__x86_64__)
// exp(x) of 8 floats: x = n ln2 + r (|r| <= ln2 / 2), e^r by its degree-6 Taylor polynomial
// (relative error below 2e-7 on that range), 2^n from the exponent bits. Inputs below -87.3 give 0,
// as softmax wants of scores far under the maximum.
COMB_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 in two parts so that r keeps its low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// exp(scores[j] - max_score) in place over [0, n); returns their sum.
COMB_AVX2 float softmax_exp_avx2(float* scores, int64_t n, float max_score) {
  const __m256 m = _mm256_set1_ps(max_score);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    _mm256_storeu_ps(scores + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = hsum(sum8);
  for (; j < n; ++j) total += (scores[j] = std::exp(scores[j] - max_score));
  return total;
}

// softmax_mix with the exponentials eight at a time and the weighted sum eight dimensions at a time.
COMB_AVX2 void softmax_mix_avx2(float* scores, int64_t n, float max_score, const float* values, int64_t hd, float* out) {
  const float inv = 1.0f / softmax_exp_avx2(scores, n, max_score);
  int64_t d = 0;
  for (; d + 8 <= hd; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; ++k)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[k]), _mm256_loadu_ps(values + k * hd + d), acc);
    _mm256_storeu_ps(out + d, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
  }
  for (; d < hd; ++d) {
    float acc = 0;
    for (int64_t k = 0; k < n; ++k) acc += scores[k] * values[k * hd + d];
    out[d] = acc * inv;
  }
}

// acc[0, hd) += sum_k p[k] * values[k, 0 .. hd) (rows hd apart); hd a multiple of 8 up to 256.
COMB_AVX2 void mix_rows_avx2(const float* p, int64_t n, const float* values, int64_t hd, float* acc) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const int64_t w = std::min<int64_t>(64, hd - d0) / 8;
    __m256 a[8];
    for (int64_t i = 0; i < w; ++i) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
    for (int64_t k = 0; k < n; ++k) {
      const __m256 pk = _mm256_set1_ps(p[k]);
      const float* v = values + k * hd + d0;
      for (int64_t i = 0; i < w; ++i) a[i] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    for (int64_t i = 0; i < w; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
  }
}
#endif

#if defined(__x86_64__)
// Each group's 32 products are summed in a vector, scaled once, and added to the row's sum.
COMB_AVX2 void gemv_q8_avx2(const float* x, int64_t m, const int8_t* q, const float* scale, int64_t k, float* y,
                            int64_t n_out, int64_t begin, int64_t end) {
  const int64_t groups = k / 32;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* row = q + o * k;
    const float* s = scale + o * groups;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* qg = row + g * 32;
        const float* xg = xr + g * 32;
        __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
        __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16));
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
        p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), p);
        p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), p);
        p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), p);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), p, acc);
      }
      y[r * n_out + o] = hsum(acc);
    }
  }
}
#endif

float dot(const float* a, const float* b, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2()) return dot_avx2(a, b, n);
#endif
  float s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += p * x
inline void axpy(float p, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

// out[0, hd) = softmax(scores[0, n)) . values [n, hd] (rows hd apart); `max_score` is the scores'
// maximum, and the scores are overwritten by their exponentials.
void softmax_mix(float* scores, int64_t n, float max_score, const float* values, int64_t hd, float* out) {
#if defined(__x86_64__)
  if (has_avx2()) return softmax_mix_avx2(scores, n, max_score, values, hd, out);
#endif
  float total = 0;
  for (int64_t j = 0; j < n; ++j) total += (scores[j] = std::exp(scores[j] - max_score));
  std::fill(out, out + hd, 0.0f);
  for (int64_t j = 0; j < n; ++j) axpy(scores[j] / total, values + j * hd, out, hd);
}

float softmax_exp(float* scores, int64_t n, float max_score) {
#if defined(__x86_64__)
  if (has_avx2()) return softmax_exp_avx2(scores, n, max_score);
#endif
  float total = 0;
  for (int64_t j = 0; j < n; ++j) total += (scores[j] = std::exp(scores[j] - max_score));
  return total;
}

void mix_rows(const float* p, int64_t n, const float* values, int64_t hd, float* acc) {
#if defined(__x86_64__)
  if (has_avx2() && hd % 8 == 0) return mix_rows_avx2(p, n, values, hd, acc);
#endif
  for (int64_t k = 0; k < n; ++k) axpy(p[k], values + k * hd, acc, hd);
}

}  // namespace

void gemv_rows(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n_out, int64_t begin,
               int64_t end) {
#if defined(__x86_64__)
  if (has_avx2()) return gemv_avx2(x, m, w, k, y, n_out, begin, end);
#endif
  for (int64_t o = begin; o < end; ++o)
    for (int64_t r = 0; r < m; ++r) y[r * n_out + o] = dot(x + r * k, w + o * k, k);
}

void gemv_q8_rows(const float* x, int64_t m, const int8_t* q, const float* scale, int64_t k, float* y, int64_t n_out,
                  int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if (has_avx2()) return gemv_q8_avx2(x, m, q, scale, k, y, n_out, begin, end);
#endif
  const int64_t groups = k / 32;
  for (int64_t o = begin; o < end; ++o)
    for (int64_t r = 0; r < m; ++r) {
      float sum = 0;
      for (int64_t g = 0; g < groups; ++g) {
        float part = 0;
        for (int64_t j = 0; j < 32; ++j) part += x[r * k + g * 32 + j] * q[o * k + g * 32 + j];
        sum += scale[o * groups + g] * part;
      }
      y[r * n_out + o] = sum;
    }
}

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t dim, float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * dim;
    float ms = dot(xr, xr, dim) / static_cast<float>(dim);
    float scale = 1.0f / std::sqrt(ms + eps);
    float* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * scale * weight[i];
  }
}

void silu_mul_rows(const float* in, float* out, int64_t n_ff, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* g = in + r * 2 * n_ff;
    const float* u = g + n_ff;
    float* o = out + r * n_ff;
    for (int64_t j = 0; j < n_ff; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

void rope_and_store(const float* qkv, const float* cos_table, const float* sin_table, const AttentionShape& s,
                    float* q_out, float* k_cache, float* v_cache, int64_t begin, int64_t end) {
  const int64_t hd = s.head_dim, half = hd / 2, q_dim = s.n_head * hd, kv_dim = s.n_head_kv * hd;
  auto rotate = [&](const float* x, const float* c, const float* sn, float* y) {
    for (int64_t d = 0; d < half; ++d) {
      y[d] = x[d] * c[d] - x[d + half] * sn[d];
      y[d + half] = x[d + half] * c[d + half] + x[d] * sn[d + half];
    }
  };
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / s.n_tokens, i = t % s.n_tokens, pos = s.start + i;
    const float* row = qkv + t * (q_dim + 2 * kv_dim);
    const float* c = cos_table + pos * hd;
    const float* sn = sin_table + pos * hd;
    for (int64_t h = 0; h < s.n_head; ++h) rotate(row + h * hd, c, sn, q_out + t * q_dim + h * hd);
    for (int64_t h = 0; h < s.n_head_kv; ++h) {
      int64_t at = ((b * s.n_head_kv + h) * s.capacity + pos) * hd;
      rotate(row + q_dim + h * hd, c, sn, k_cache + at);
      std::copy(row + q_dim + kv_dim + h * hd, row + q_dim + kv_dim + (h + 1) * hd, v_cache + at);
    }
  }
}

void rotate_rows(const float* x, int64_t x_stride, const float* cos, const float* sin, int64_t head_dim, int64_t n,
                 float* y, int64_t y_stride) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * x_stride;
    float* yi = y + i * y_stride;
    for (int64_t d = 0; d < half; ++d) {
      const float a = xi[d], b = xi[d + half];  // read both before writing: y may be x
      yi[d] = a * cos[d] - b * sin[d];
      yi[d + half] = b * cos[d + half] + a * sin[d + half];
    }
  }
}

void attention_rows(const float* q, const float* k_cache, const float* v_cache, const AttentionShape& s, float* out,
                    float* scratch, int64_t begin, int64_t end) {
  const int64_t hd = s.head_dim, q_dim = s.n_head * hd, group = s.n_head / s.n_head_kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / s.n_head, h = item % s.n_head, kvh = h / group;
    const float* keys = k_cache + (b * s.n_head_kv + kvh) * s.capacity * hd;
    const float* values = v_cache + (b * s.n_head_kv + kvh) * s.capacity * hd;
    for (int64_t i = 0; i < s.n_tokens; ++i) {
      const int64_t t = b * s.n_tokens + i, n_keys = s.start + i + 1;
      const float* qv = q + t * q_dim + h * hd;
      float max_score = -INFINITY;
      for (int64_t j = 0; j < n_keys; ++j) {
        scratch[j] = dot(qv, keys + j * hd, hd) * scale;
        max_score = std::max(max_score, scratch[j]);
      }
      softmax_mix(scratch, n_keys, max_score, values, hd, out + t * q_dim + h * hd);
    }
  }
}

void paged_attention(const float* q, const float* k_pool, const float* v_pool, const int32_t* table, int64_t n_keys,
                     const float* const* joint_k, const float* const* joint_v, const int64_t* joint_n,
                     int64_t n_segments, const float* joint_bias, const PagedShape& s, float* out, float* scratch,
                     int64_t begin, int64_t end) {
  const int64_t hd = s.head_dim, bt = s.block_tokens, group = s.n_head / s.n_head_kv;
  const int64_t block_stride = s.n_head_kv * bt * hd;  // one block of the pool, all KV heads
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t n_joint = 0;
  for (int64_t i = 0; i < n_segments; ++i) n_joint += joint_n[i];
  for (int64_t h = begin; h < end; ++h) {
    const int64_t kvh = h / group;
    const float* qh = q + h * hd;
    const float bias = joint_bias ? joint_bias[h] : 0.0f;
    float max_score = -INFINITY;
    float* sc = scratch;
    for (int64_t i = 0; i < n_segments; ++i) {
      const float* jk = joint_k[i] + kvh * joint_n[i] * hd;
      for (int64_t j = 0; j < joint_n[i]; ++j) {
        sc[j] = dot(qh, jk + j * hd, hd) * scale + bias;
        max_score = std::max(max_score, sc[j]);
      }
      sc += joint_n[i];
    }
    float* own = scratch + n_joint;
    for (int64_t p0 = 0; p0 < n_keys; p0 += bt) {
      const float* kb = k_pool + int64_t(table[p0 / bt]) * block_stride + kvh * bt * hd;
      const int64_t len = std::min(bt, n_keys - p0);
      for (int64_t j = 0; j < len; ++j) {
        own[p0 + j] = dot(qh, kb + j * hd, hd) * scale;
        max_score = std::max(max_score, own[p0 + j]);
      }
    }
    const float inv = 1.0f / softmax_exp(scratch, n_joint + n_keys, max_score);
    float* o = out + h * hd;
    std::fill(o, o + hd, 0.0f);
    sc = scratch;
    for (int64_t i = 0; i < n_segments; ++i) {
      mix_rows(sc, joint_n[i], joint_v[i] + kvh * joint_n[i] * hd, hd, o);
      sc += joint_n[i];
    }
    for (int64_t p0 = 0; p0 < n_keys; p0 += bt) {
      const float* vb = v_pool + int64_t(table[p0 / bt]) * block_stride + kvh * bt * hd;
      mix_rows(own + p0, std::min(bt, n_keys - p0), vb, hd, o);
    }
    for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
  }
}

}  // namespace comb::detail::cpu
