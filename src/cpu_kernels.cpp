// Fused fp32 CPU kernels (see include/comb/detail/cpu_kernels.hpp). AVX-512 or AVX2+FMA where the
// CPU has it (chosen at run time, capped by COMB_CPU_ISA), portable loops otherwise. No LibTorch here.
#include "comb/detail/cpu_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define COMB_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace comb::detail::cpu {

Isa cpu_isa() {
#if defined(__x86_64__)
  static const Isa widest = __builtin_cpu_supports("avx512f")                                   ? Isa::avx512
                            : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::avx2
                                                                                               : Isa::scalar;
  return widest;
#else
  return Isa::scalar;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

Isa parse_isa(const char* name) {
  const std::string s = name ? name : "";
  for (Isa isa : {Isa::avx512, Isa::avx2, Isa::scalar})
    if (s == isa_name(isa)) return isa;
  throw std::invalid_argument("COMB_CPU_ISA: expected avx512, avx2 or scalar, found '" + s + "'");
}

Isa kernel_isa() {
  static const Isa chosen = [] {
    const char* cap = std::getenv("COMB_CPU_ISA");
    const Isa widest = cpu_isa();
    if (!cap || !*cap) return widest;
    return std::min(widest, parse_isa(cap));
  }();
  return chosen;
}

namespace {

#if defined(__x86_64__)
bool has_avx2() { return kernel_isa() >= Isa::avx2; }

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

// Dot products of R rows of x with O rows of w, one accumulator vector for each (row, output),
// k in order (the last chunk masked or finished in scalar), then one horizontal sum. Every result is
// computed the same way whatever the tile it falls in, so it depends on its own row and output only:
// a sequence's numbers do not depend on the rows decoded beside it (batched decoding). The tile
// shapes only change which loads are shared: O weight rows stay in registers or L1 while the rows
// of x go by.
template <int R, int O>
COMB_AVX2 void dot_tile_avx2(const float* x, int64_t k, const float* w, float* y, int64_t n_out) {
  __m256 acc[R][O];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[O];
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) wv[o] = _mm256_loadu_ps(w + o * k + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      float sum = hsum(acc[r][o]);
      for (int64_t j = i; j < k; ++j) sum += x[r * k + j] * w[o * k + j];
      y[r * n_out + o] = sum;
    }
}

#define COMB_AVX512 __attribute__((target("avx512f,avx2,fma")))
bool has_avx512() { return kernel_isa() == Isa::avx512; }

template <int R, int O>
COMB_AVX512 void dot_tile_avx512(const float* x, int64_t k, const float* w, float* y, int64_t n_out) {
  __m512 acc[R][O];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wv[O];
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) wv[o] = _mm512_loadu_ps(w + o * k + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * k + i);
#pragma GCC unroll 8
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  if (i < k) {  // the last chunk, masked
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1);
    __m512 wv[O];
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) wv[o] = _mm512_maskz_loadu_ps(mask, w + o * k + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * k + i);
#pragma GCC unroll 8
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) y[r * n_out + o] = _mm512_reduce_add_ps(acc[r][o]);
}

// Outputs in blocks of O (the rows of x two at a time, then one), the last outputs one by one:
// tile(rows, outputs, r, o) with the tile's shape as compile-time constants.
template <int O, class Tile>
inline void dot_tiles(int64_t m, int64_t begin, int64_t end, const Tile& tile) {
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  using four = std::integral_constant<int, 4>;
  using block = std::integral_constant<int, O>;
  using half = std::integral_constant<int, O / 2>;
  int64_t o = begin;
  for (; o + O <= end; o += O) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {  // four rows, the block's outputs in two halves (registers)
      tile(four{}, half{}, r, o);
      tile(four{}, half{}, r, o + O / 2);
    }
    for (; r + 2 <= m; r += 2) tile(two{}, block{}, r, o);
    for (; r < m; ++r) tile(one{}, block{}, r, o);
  }
  for (; o < end; ++o)
    for (int64_t r = 0; r < m; ++r) tile(one{}, one{}, r, o);
}

COMB_AVX2 void gemv_avx2(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n_out, int64_t begin,
                         int64_t end) {
  dot_tiles<4>(m, begin, end, [&](auto rows, auto outs, int64_t r, int64_t o) {
    dot_tile_avx2<decltype(rows)::value, decltype(outs)::value>(x + r * k, k, w + o * k, y + r * n_out + o, n_out);
  });
}

COMB_AVX512 void gemv_avx512(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n_out,
                             int64_t begin, int64_t end) {
  dot_tiles<8>(m, begin, end, [&](auto rows, auto outs, int64_t r, int64_t o) {
    dot_tile_avx512<decltype(rows)::value, decltype(outs)::value>(x + r * k, k, w + o * k, y + r * n_out + o, n_out);
  });
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
// Grouped weights multiplied without a buffer: each group's 32 weights of O output rows are
// dequantized into registers (weights(): the one dequantization of the AVX-512 path, which
// dequantize_row_avx512 stores) and used at once for R rows of x, with one accumulator per (row,
// output) and the chunks of 16 in order: gemv_rows's AVX-512 arithmetic over the same floats,
// hence its numbers.
// Q4: a group's 16 possible weights q * scale + min in one vector, then each nibble looks its weight up.
struct Q4Groups {
  const uint8_t* q;
  const float *scale, *min;
  int64_t k;
  COMB_AVX512 void weights(int64_t o, int64_t g, __m512& w0, __m512& w1) const {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t groups = k / 32;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + o * (k / 2) + 16 * g)));
    const __m512 table =
        _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scale[o * groups + g])), _mm512_set1_ps(min[o * groups + g]));
    w0 = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
};

struct Q8Groups {
  const int8_t* q;
  const float* scale;
  int64_t k;
  COMB_AVX512 void weights(int64_t o, int64_t g, __m512& w0, __m512& w1) const {
    const __m512 s = _mm512_set1_ps(scale[o * (k / 32) + g]);
    const int8_t* p = q + o * k + 32 * g;
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), s);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))), s);
  }
};

// Output row o of the grouped weights, dequantized into w [k].
template <class Groups>
COMB_AVX512 void dequantize_row_avx512(const Groups& wq, int64_t o, int64_t k, float* w) {
  for (int64_t g = 0; g < k / 32; ++g) {
    __m512 w0, w1;
    wq.weights(o, g, w0, w1);
    _mm512_storeu_ps(w + 32 * g, w0);
    _mm512_storeu_ps(w + 32 * g + 16, w1);
  }
}

template <int R, int O, class Groups>
COMB_AVX512 void grouped_tile_avx512(const float* x, int64_t k, const Groups& wq, int64_t o0, float* y, int64_t n_out) {
  __m512 acc[R][O];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / 32; ++g) {
    __m512 w0[O], w1[O];
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) wq.weights(o0 + o, g, w0[o], w1[o]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * k + 32 * g), x1 = _mm512_loadu_ps(x + r * k + 32 * g + 16);
#pragma GCC unroll 8
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_fmadd_ps(x0, w0[o], acc[r][o]);
#pragma GCC unroll 8
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_fmadd_ps(x1, w1[o], acc[r][o]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) y[r * n_out + o] = _mm512_reduce_add_ps(acc[r][o]);
}

// Outputs four at a time, the rows of x eight (as two tiles of two outputs: each group dequantized
// once for eight rows), four, two, then one at a time; the last outputs alone.
template <class Groups>
COMB_AVX512 void gemv_grouped_avx512(const float* x, int64_t m, int64_t k, const Groups& wq, float* y, int64_t n_out,
                                     int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) {
    int64_t r = 0;
    for (; r + 8 <= m; r += 8) {
      grouped_tile_avx512<8, 2>(x + r * k, k, wq, o, y + r * n_out + o, n_out);
      grouped_tile_avx512<8, 2>(x + r * k, k, wq, o + 2, y + r * n_out + o + 2, n_out);
    }
    for (; r + 4 <= m; r += 4) grouped_tile_avx512<4, 4>(x + r * k, k, wq, o, y + r * n_out + o, n_out);
    for (; r + 2 <= m; r += 2) grouped_tile_avx512<2, 4>(x + r * k, k, wq, o, y + r * n_out + o, n_out);
    for (; r < m; ++r) grouped_tile_avx512<1, 4>(x + r * k, k, wq, o, y + r * n_out + o, n_out);
  }
  for (; o < end; ++o)
    for (int64_t r = 0; r < m; ++r) grouped_tile_avx512<1, 1>(x + r * k, k, wq, o, y + r * n_out + o, n_out);
}

COMB_AVX2 void dequantize_q4_avx2(const uint8_t* q, const float* scale, const float* min, int64_t groups, float* w) {
  const __m256i low = _mm256_set1_epi32(15);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scale[g]), m = _mm256_set1_ps(min[g]);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * g + 8 * h)));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      _mm256_storeu_ps(w + 32 * g + 8 * h, _mm256_add_ps(_mm256_mul_ps(lo, s), m));
      _mm256_storeu_ps(w + 32 * g + 16 + 8 * h, _mm256_add_ps(_mm256_mul_ps(hi, s), m));
    }
  }
}
#endif

// The portable dot product: eight partial sums over k in order (lane j takes the products
// i = j mod 8, each rounded, then added: no fused multiply-add), added pairwise, then the last
// n % 8 products one by one. Plain loops, which the compiler vectorizes for any x86-64 (SSE2).
float dot_portable(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float dot(const float* a, const float* b, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2()) return dot_avx2(a, b, n);
#endif
  return dot_portable(a, b, n);
}

// y += p * x
inline void axpy(float p, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
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

// out[0, hd) = softmax(scores[0, n)) . values [n, hd] (rows hd apart); `max_score` is the scores'
// maximum, and the scores are overwritten by their exponentials.
void softmax_mix(float* scores, int64_t n, float max_score, const float* values, int64_t hd, float* out) {
  const float inv = 1.0f / softmax_exp(scores, n, max_score);
  std::fill(out, out + hd, 0.0f);
  mix_rows(scores, n, values, hd, out);
  for (int64_t d = 0; d < hd; ++d) out[d] *= inv;
}

}  // namespace

void gemv_rows_on(Isa isa, const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n_out,
                  int64_t begin, int64_t end) {
  if (isa > cpu_isa())
    throw std::invalid_argument(std::string("gemv_rows_on: this CPU has no ") + isa_name(isa) + " (its widest is " +
                                isa_name(cpu_isa()) + ")");
#if defined(__x86_64__)
  if (isa == Isa::avx512) return gemv_avx512(x, m, w, k, y, n_out, begin, end);
  if (isa == Isa::avx2) return gemv_avx2(x, m, w, k, y, n_out, begin, end);
#endif
  for (int64_t o = begin; o < end; ++o)  // a weight row (in L1) for every row of x
    for (int64_t r = 0; r < m; ++r) y[r * n_out + o] = dot_portable(x + r * k, w + o * k, k);
}

void gemv_rows(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n_out, int64_t begin,
               int64_t end) {
  gemv_rows_on(kernel_isa(), x, m, w, k, y, n_out, begin, end);
}

void dequantize_q8_row(const int8_t* q, const float* scale, int64_t k, float* w) {
  const int64_t groups = k / 32;
#if defined(__x86_64__)
  if (has_avx512()) return dequantize_row_avx512(Q8Groups{q, scale, k}, 0, k, w);
#endif
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t j = 0; j < 32; ++j) w[32 * g + j] = static_cast<float>(q[32 * g + j]) * scale[g];
}

void dequantize_q4_row(const uint8_t* q, const float* scale, const float* min, int64_t k, float* w) {
  const int64_t groups = k / 32;
#if defined(__x86_64__)
  if (has_avx512()) return dequantize_row_avx512(Q4Groups{q, scale, min, k}, 0, k, w);
  if (has_avx2()) return dequantize_q4_avx2(q, scale, min, groups, w);
#endif
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t j = 0; j < 16; ++j) {
      const float product_lo = static_cast<float>(q[16 * g + j] & 15) * scale[g];
      const float product_hi = static_cast<float>(q[16 * g + j] >> 4) * scale[g];
      w[32 * g + j] = product_lo + min[g];
      w[32 * g + 16 + j] = product_hi + min[g];
    }
}

namespace {
// Output rows [begin, end) a block at a time: `dequantize(o, w)` writes row o's weights into w [k],
// then gemv_rows's tiles read the block (in L1) for every row of x.
template <class Dequantize>
void gemv_grouped(const float* x, int64_t m, int64_t k, float* y, int64_t n_out, int64_t begin, int64_t end,
                  const Dequantize& dequantize) {
  constexpr int64_t kBlock = 8;  // gemv_rows's widest tile of outputs
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(kBlock * k));
  for (int64_t o = begin; o < end; o += kBlock) {
    const int64_t n = std::min(kBlock, end - o);
    for (int64_t i = 0; i < n; ++i) dequantize(o + i, buffer.data() + i * k);
    gemv_rows(x, m, buffer.data(), k, y + o, n_out, 0, n);
  }
}
}  // namespace

void gemv_q8_rows(const float* x, int64_t m, const int8_t* q, const float* scale, int64_t k, float* y, int64_t n_out,
                  int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if (has_avx512()) return gemv_grouped_avx512(x, m, k, Q8Groups{q, scale, k}, y, n_out, begin, end);
#endif
  gemv_grouped(x, m, k, y, n_out, begin, end,
               [&](int64_t o, float* w) { dequantize_q8_row(q + o * k, scale + o * (k / 32), k, w); });
}

void gemv_q4_rows(const float* x, int64_t m, const uint8_t* q, const float* scale, const float* min, int64_t k,
                  float* y, int64_t n_out, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if (has_avx512()) return gemv_grouped_avx512(x, m, k, Q4Groups{q, scale, min, k}, y, n_out, begin, end);
#endif
  gemv_grouped(x, m, k, y, n_out, begin, end, [&](int64_t o, float* w) {
    dequantize_q4_row(q + o * (k / 2), scale + o * (k / 32), min + o * (k / 32), k, w);
  });
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

namespace {
#if defined(__x86_64__)
// paged_attention for the G query heads that share KV head `kvh`, head_dim = 16 C: every key and
// value is read once for all G (grouped-query attention), 16 dimensions at a time.
template <int G, int C>
COMB_AVX512 inline void group_score(const __m512 (&qv)[G][C], const float* key, const float* bias, float* scratch,
                                    int64_t n_all, int64_t j, float* max_score) {
  __m512 kv[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(key + 16 * c);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
#pragma GCC unroll 8
    for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
    const float v = _mm512_reduce_add_ps(a) + (bias ? bias[g] : 0.0f);
    scratch[g * n_all + j] = v;
    max_score[g] = std::max(max_score[g], v);
  }
}

template <int G, int C>
COMB_AVX512 inline void group_mix(__m512 (&acc)[G][C], const float* value, const float* scratch, int64_t n_all,
                                  int64_t j) {
  __m512 vv[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(value + 16 * c);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const __m512 p = _mm512_set1_ps(scratch[g * n_all + j]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
  }
}

template <int G, int C>
COMB_AVX512 void paged_group_avx512(const float* q, const float* k_pool, const float* v_pool, const int32_t* table,
                                    int64_t n_keys, const float* const* joint_k, const float* const* joint_v,
                                    const int64_t* joint_n, int64_t n_segments, const float* joint_bias,
                                    const PagedShape& s, float* out, float* scratch, int64_t kvh) {
  constexpr int64_t hd = 16 * C;
  const int64_t bt = s.block_tokens, block_stride = s.n_head_kv * bt * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t n_joint = 0;
  for (int64_t i = 0; i < n_segments; ++i) n_joint += joint_n[i];
  const int64_t n_all = n_joint + n_keys;
  __m512 qv[G][C];
  float bias[G], max_score[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t h = kvh * G + g;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * hd + 16 * c), _mm512_set1_ps(scale));
    bias[g] = joint_bias ? joint_bias[h] : 0.0f;
    max_score[g] = -INFINITY;
  }
  int64_t j = 0;
  for (int64_t i = 0; i < n_segments; ++i) {
    const float* jk = joint_k[i] + kvh * joint_n[i] * hd;
    for (int64_t t = 0; t < joint_n[i]; ++t, ++j)
      group_score<G, C>(qv, jk + t * hd, joint_bias ? bias : nullptr, scratch, n_all, j, max_score);
  }
  for (int64_t p0 = 0; p0 < n_keys; p0 += bt) {
    const float* kb = k_pool + int64_t(table[p0 / bt]) * block_stride + kvh * bt * hd;
    const int64_t len = std::min(bt, n_keys - p0);
    for (int64_t t = 0; t < len; ++t, ++j) group_score<G, C>(qv, kb + t * hd, nullptr, scratch, n_all, j, max_score);
  }
  float inv[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) inv[g] = 1.0f / softmax_exp(scratch + g * n_all, n_all, max_score[g]);
  __m512 acc[G][C];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  j = 0;
  for (int64_t i = 0; i < n_segments; ++i) {
    const float* jv = joint_v[i] + kvh * joint_n[i] * hd;
    for (int64_t t = 0; t < joint_n[i]; ++t, ++j) group_mix<G, C>(acc, jv + t * hd, scratch, n_all, j);
  }
  for (int64_t p0 = 0; p0 < n_keys; p0 += bt) {
    const float* vb = v_pool + int64_t(table[p0 / bt]) * block_stride + kvh * bt * hd;
    const int64_t len = std::min(bt, n_keys - p0);
    for (int64_t t = 0; t < len; ++t, ++j) group_mix<G, C>(acc, vb + t * hd, scratch, n_all, j);
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + (kvh * G + g) * hd + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}
#endif
}  // namespace

bool paged_attention_grouped(const float* q, const float* k_pool, const float* v_pool, const int32_t* table,
                             int64_t n_keys, const float* const* joint_k, const float* const* joint_v,
                             const int64_t* joint_n, int64_t n_segments, const float* joint_bias, const PagedShape& s,
                             float* out, float* scratch, int64_t kvh) {
#if defined(__x86_64__)
  if (!has_avx512()) return false;
  using F = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, const float* const*,
                     const float* const*, const int64_t*, int64_t, const float*, const PagedShape&, float*, float*,
                     int64_t);
  const int64_t group = s.n_head / s.n_head_kv;
  F f = nullptr;
  if (s.head_dim == 64) {
    static const F by_group[] = {paged_group_avx512<1, 4>, paged_group_avx512<2, 4>, paged_group_avx512<3, 4>,
                                 paged_group_avx512<4, 4>};
    if (group >= 1 && group <= 4) f = by_group[group - 1];
  } else if (s.head_dim == 128) {
    static const F by_group[] = {paged_group_avx512<1, 8>, paged_group_avx512<2, 8>};
    if (group >= 1 && group <= 2) f = by_group[group - 1];
  }
  if (!f) return false;
  f(q, k_pool, v_pool, table, n_keys, joint_k, joint_v, joint_n, n_segments, joint_bias, s, out, scratch, kvh);
  return true;
#else
  return false;
#endif
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
