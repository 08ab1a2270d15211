// DocumentKV's storage forms (int8 with scales, other dtypes, devices) and the Linker (see
// comb/document_kv.hpp). Compiled into libcomb (src/document_kv.cpp), or inline in every
// translation unit that defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "comb/detail/decode_step.hpp"
#include "comb/detail/upload.hpp"
#include "comb/document_kv.hpp"
#include "comb/error.hpp"
#include "comb/store.hpp"  // cache_dtype_name

namespace comb {

COMB_INLINE int64_t DocumentKV::bytes() const {
  int64_t n = 0;
  for (const auto* list : {&keys, &values, &key_scales, &value_scales})
    for (const auto& t : *list) n += t.numel() * t.element_size();
  return n;
}

COMB_INLINE c10::ScalarType DocumentKV::dtype() const {
  COMB_CHECK(!keys.empty() && !values.empty(), "a document cache with no blocks has no dtype");
  const c10::ScalarType k = keys[0].scalar_type(), v = values[0].scalar_type();
  if (k == at::kByte) return kCacheInt4;
  if (k == at::kChar && v == at::kByte) return kCacheInt8Int4;
  return k;
}

COMB_INLINE int64_t DocumentKV::head_dim() const {
  COMB_CHECK(!keys.empty() && keys[0].dim() == 3, "a document cache's keys should be [n_head_kv, n_tokens, head_dim]");
  return keys[0].size(2) * (keys[0].scalar_type() == at::kByte ? 2 : 1);
}

COMB_INLINE bool DocumentKV::keys_per_channel(int64_t n_tokens, int64_t head_dim, c10::ScalarType form) {
  return form == kCacheInt4 || 2 * n_tokens >= head_dim;
}

COMB_INLINE int64_t DocumentKV::storage_bytes(c10::ScalarType dtype, int64_t n_blocks, int64_t n_head_kv,
                                              int64_t head_dim, int64_t n_tokens) {
  const int64_t elements = 2 * n_blocks * n_head_kv * head_dim * n_tokens;
  if (!is_quantized_form(dtype)) return elements * static_cast<int64_t>(c10::elementSize(dtype));
  // int8 or int4 codes and float16 scales: one per value row (one head, one token); keys one per
  // channel over the document's tokens, or per row for int8 keys of documents under head_dim / 2
  // tokens; int4 keys under head_dim tokens: per head a float16 scale and 4 bits a channel, from
  // head_dim tokens on those and an int8 centre a channel.
  const int64_t codes = dtype == at::kChar ? elements : dtype == kCacheInt4 ? elements / 2 : elements * 3 / 4;
  const int64_t value_scales = 2 * n_blocks * n_head_kv * n_tokens;
  const KeyScaleForm form = key_scale_form(dtype, n_tokens, head_dim);
  if (form == KeyScaleForm::coded || form == KeyScaleForm::centred)
    return codes + value_scales + n_blocks * n_head_kv * coded_key_scale_bytes(head_dim, form == KeyScaleForm::centred);
  const int64_t key_scales = form == KeyScaleForm::per_channel ? head_dim : n_tokens;
  return codes + value_scales + 2 * n_blocks * n_head_kv * key_scales;
}

COMB_INLINE DocumentKV::KeyScaleForm DocumentKV::key_scale_form(c10::ScalarType form, int64_t n_tokens,
                                                                int64_t head_dim) {
  if (form == kCacheInt4) return centres_int4_keys(n_tokens, head_dim) ? KeyScaleForm::centred : KeyScaleForm::coded;
  return keys_per_channel(n_tokens, head_dim, form) ? KeyScaleForm::per_channel : KeyScaleForm::per_row;
}

namespace detail::document_kv {  // this file's own helpers
// A scale from the largest magnitude it covers: amax / levels (127 for int8, 7 for int4; 1 where
// all are 0), at least 2^-14 (the smallest normal float16) and at most 65504 (the largest: beyond
// it the codes saturate instead of a scale turning infinite), kept in float16; the codes are
// computed with that float16 value.
COMB_INLINE at::Half int8_scale(float amax, float levels = 127.0f) {
  const float s = amax / levels;
  return at::Half(s > 0 ? std::min(std::max(s, 6.103515625e-05f), 65504.0f) : 1.0f);
}

// NOTE: the tensor-op quantization below runs about ten ops per K and per V of every block; a cold
// request converts each new document's 28 blocks one at a time, so on short documents the ops'
// overhead outweighs the work. One pass each here, with the same arithmetic (the float16 scale,
// float32 division by it, round half to even, clamp), so the codes and scales are those of the
// tensor ops. Codes in [-levels, levels] (127: int8; 7: the codes of int4, packed after).
//
// Rounding half to even by adding and subtracting 1.5 * 2^23: for |v| <= 2^22 the sum lies in [2^23,
// 2^24], where floats are the integers, so the addition rounds v to an integer half to even (1.5 *
// 2^23 is even) and the subtraction is exact: std::nearbyint's result in the default rounding mode,
// without its call, so that the loops over codes vectorize. Beyond 2^22 the result keeps v's sign
// and a magnitude above 2^21, which the clamp to [-levels, levels] (levels <= 127) takes to the same
// code as nearbyint's; infinities and NaN pass through as they do there. Reassociation of floats
// would fold the two operations away: comb's build never allows it, and where a translation unit
// is compiled with -ffast-math or -Ofast (a project using comb header-only may; GCC and Clang define
// __FAST_MATH__ then) std::nearbyint is used. -fassociative-math alone defines nothing to test;
// docs/building.md asks not to use it.
COMB_INLINE float round_half_even(float v) {
#if defined(__FAST_MATH__)
  return std::nearbyint(v);
#else
  constexpr float shift = 12582912.0f;  // 1.5 * 2^23
  return (v + shift) - shift;
#endif
}
COMB_INLINE int8_t code(float x, float scale, float levels) {
  const float q = round_half_even(x / scale);
  return static_cast<int8_t>(std::min(levels, std::max(-levels, q)));
}

// Rows of `d` floats, each with its own scale ([..., 1]): values, and keys of short documents.
COMB_INLINE void quantize_rows_cpu(const float* x, int64_t rows, int64_t d, float levels, int8_t* q, at::Half* scale) {
  for (int64_t r = 0; r < rows; ++r, x += d, q += d) {
    float m = 0.0f;
    for (int64_t j = 0; j < d; ++j) m = std::max(m, std::fabs(x[j]));
    scale[r] = int8_scale(m, levels);
    const float s = static_cast<float>(scale[r]);
    for (int64_t j = 0; j < d; ++j) q[j] = code(x[j], s, levels);
  }
}

// One head's float16 scales per channel `s` (d of them; zero[j]: channel j is all zeros) coded as
// code_int4_key_scales codes them: 2 + d / 2 bytes to `out`, and the float16 scales they stand for
// to `used`.
COMB_INLINE void code_key_scales_head(const at::Half* s, const bool* zero, int64_t d, uint8_t* out, at::Half* used) {
  float top = 0.0f;  // S: the largest scale of a channel that is not all zeros (1 where none is)
  for (int64_t j = 0; j < d; ++j)
    if (!zero[j]) top = std::max(top, static_cast<float>(s[j]));
  const at::Half big(top > 0.0f ? top : 1.0f);
  at::Half step[16];
  for (int e = 0; e < 16; ++e) step[e] = at::Half(static_cast<float>(big) * kInt4ScaleSteps[e]);
  out[0] = static_cast<uint8_t>(big.x & 0xff), out[1] = static_cast<uint8_t>(big.x >> 8);
  for (int64_t j = 0; j < d; ++j) {
    int e = 15;  // the largest e whose step is at least s[j]; step[0] = S >= s[j], and the steps fall
    if (!zero[j])
      while (e > 0 && static_cast<float>(step[e]) < static_cast<float>(s[j])) --e;
    used[j] = step[e];
    uint8_t& byte = out[2 + j / 2];
    byte = j % 2 == 0 ? static_cast<uint8_t>(e) : static_cast<uint8_t>(byte | (e << 4));
  }
}

// Coded scales ([heads, 1, row] bytes, row = 2 + d / 2, or with the centres after them 2 + d / 2 +
// d) decoded to float16 [heads, 1, d] on the CPU.
COMB_INLINE void decode_key_scales_cpu(const uint8_t* in, int64_t heads, int64_t d, int64_t row, at::Half* out) {
  for (int64_t h = 0; h < heads; ++h, in += row, out += d) {
    const at::Half big(static_cast<uint16_t>(in[0] | (in[1] << 8)), at::Half::from_bits());
    const float top = static_cast<float>(big);
    for (int64_t j = 0; j < d; ++j) {
      const int e = j % 2 == 0 ? in[2 + j / 2] & 15 : in[2 + j / 2] >> 4;
      out[j] = at::Half(top * kInt4ScaleSteps[e]);
    }
  }
}

// Centred int4 keys: the largest magnitude a key is coded with (65504, the largest float16 scale,
// times 127 centre steps); NaN keys are coded as 0 and infinite ones as this bound, alike by the
// loops and the tensor ops.
inline constexpr float kCentredKeyBound = 65504.0f * 127.0f;
COMB_INLINE float centred_key(float v) {
  return std::isnan(v) ? 0.0f : std::min(kCentredKeyBound, std::max(-kCentredKeyBound, v));
}
// The float16 scale of a centred channel: w rounded up to float16 (so that the scale covers w and
// |mid| / scale is at most 127), at least 2^-14 and at most 65504; 1 where w is not above 0.
COMB_INLINE at::Half centred_scale(float w) {
  at::Half h = int8_scale(w, 1.0f);
  if (static_cast<float>(h) < w && static_cast<float>(h) < 65504.0f) h.x = static_cast<uint16_t>(h.x + 1);
  return h;
}

// One head's rotated keys ([n, d] floats, row-major) coded centred (see DocumentKV): the codes in
// [-8, 7] to `q`, the coded scales and the centres (2 + d / 2 + d bytes) to `out`.
COMB_INLINE void code_centred_head(const float* x, int64_t n, int64_t d, int8_t* q, uint8_t* out) {
  std::vector<float> lo(static_cast<size_t>(d), 0.0f), hi(static_cast<size_t>(d), 0.0f), mid(static_cast<size_t>(d));
  std::vector<at::Half> s(static_cast<size_t>(d)), used(static_cast<size_t>(d));
  std::unique_ptr<bool[]> zero(new bool[d]);
  for (int64_t j = 0; j < d && n > 0; ++j) lo[j] = hi[j] = centred_key(x[j]);
  for (int64_t t = 1; t < n; ++t)
    for (int64_t j = 0; j < d; ++j) {
      const float v = centred_key(x[t * d + j]);
      lo[j] = std::min(lo[j], v), hi[j] = std::max(hi[j], v);
    }
  for (int64_t j = 0; j < d; ++j) {
    mid[j] = (lo[j] + hi[j]) * 0.5f;
    const float w = std::max((hi[j] - lo[j]) / 15.0f, std::fabs(mid[j]) / 127.0f);
    s[j] = centred_scale(w), zero[j] = !(w > 0.0f);
  }
  code_key_scales_head(s.data(), zero.get(), d, out, used.data());
  int8_t* centre = reinterpret_cast<int8_t*>(out + DocumentKV::coded_key_scale_bytes(d, false));
  std::vector<float> scale(static_cast<size_t>(d)), m(static_cast<size_t>(d));
  for (int64_t j = 0; j < d; ++j) {
    scale[j] = static_cast<float>(used[j]);
    m[j] = std::min(127.0f, std::max(-127.0f, round_half_even(mid[j] / scale[j] + 0.5f)));
    centre[j] = static_cast<int8_t>(m[j]);
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < d; ++j) {
      const float c = round_half_even(centred_key(x[t * d + j]) / scale[j] - m[j]);
      q[t * d + j] = static_cast<int8_t>(std::min(7.0f, std::max(-8.0f, c)));
    }
}

using KeyScaleForm = DocumentKV::KeyScaleForm;

// Keys [heads, n, d] (float32, contiguous): codes and a scale per channel over the tokens
// ([heads, 1, d]), or per row ([heads, n, 1]); `coded`: per channel, the scales coded
// (code_int4_key_scales: [heads, 1, 2 + d / 2] bytes), the codes computed with what they stand for;
// `centred`: rotated int4 keys coded centred ([heads, 1, 2 + d / 2 + d] bytes; see DocumentKV).
COMB_INLINE std::pair<at::Tensor, at::Tensor> quantize_keys_cpu(const at::Tensor& k, float levels, KeyScaleForm form) {
  const int64_t heads = k.size(0), n = k.size(1), d = k.size(2);
  const bool coded = form == KeyScaleForm::coded, per_channel = form != KeyScaleForm::per_row;
  const int64_t row = DocumentKV::coded_key_scale_bytes(d, form == KeyScaleForm::centred);
  if (form == KeyScaleForm::centred) {
    at::Tensor kq = at::empty({heads, n, d}, at::kChar), ks = at::empty({heads, 1, row}, at::kByte);
    for (int64_t h = 0; h < heads; ++h)
      code_centred_head(k.data_ptr<float>() + h * n * d, n, d, kq.data_ptr<int8_t>() + h * n * d,
                        ks.data_ptr<uint8_t>() + h * row);
    return {kq, ks};
  }
  at::Tensor kq = at::empty({heads, n, d}, at::kChar);
  at::Tensor ks = coded        ? at::empty({heads, 1, row}, at::kByte)
                  : per_channel ? at::empty({heads, 1, d}, at::kHalf)
                                : at::empty({heads, n, 1}, at::kHalf);
  const float* kp = k.data_ptr<float>();
  int8_t* kqp = kq.data_ptr<int8_t>();
  if (!per_channel) {
    quantize_rows_cpu(kp, heads * n, d, levels, kqp, ks.data_ptr<at::Half>());
    return {kq, ks};
  }
  std::vector<float> m(d), scale(d);
  std::vector<at::Half> s(d), used(d);
  std::unique_ptr<bool[]> zero(new bool[d]);
  for (int64_t h = 0; h < heads; ++h) {
    std::fill(m.begin(), m.end(), 0.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j) m[j] = std::max(m[j], std::fabs(kp[(h * n + t) * d + j]));
    // zero: a channel whose scale is int8_scale's 1 for nothing to scale (amax / levels not above 0)
    for (int64_t j = 0; j < d; ++j) s[j] = int8_scale(m[j], levels), zero[j] = !(m[j] / levels > 0.0f);
    if (coded)
      code_key_scales_head(s.data(), zero.get(), d, ks.data_ptr<uint8_t>() + h * row, used.data());
    else
      std::copy(s.begin(), s.end(), ks.data_ptr<at::Half>() + h * d);
    for (int64_t j = 0; j < d; ++j) scale[j] = static_cast<float>(coded ? used[j] : s[j]);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j) kqp[(h * n + t) * d + j] = code(kp[(h * n + t) * d + j], scale[j], levels);
  }
  return {kq, ks};
}

COMB_INLINE std::array<at::Tensor, 4> quantize_int8_cpu(const at::Tensor& k, const at::Tensor& v, float key_levels,
                                                        float value_levels, KeyScaleForm key_form) {
  const int64_t heads = v.size(0), n = v.size(1), d = v.size(2);
  at::Tensor vq = at::empty({heads, n, d}, at::kChar), vs = at::empty({heads, n, 1}, at::kHalf);
  quantize_rows_cpu(v.data_ptr<float>(), heads * n, d, value_levels, vq.data_ptr<int8_t>(), vs.data_ptr<at::Half>());
  auto [kq, ks] = quantize_keys_cpu(k, key_levels, key_form);
  return {kq, ks, vq, vs};
}

// The tensor ops' form of the same (any device): float16 scales of amax / levels (2^-14 to 65504;
// 1 for all zeros), codes by float32 division, round half to even and clamp. The divisor a tensor:
// ATen divides a CUDA tensor by a scalar as a product with its reciprocal, which can differ in the
// last place from the CPU's quotient. NaN elements are coded -levels, as code() codes them
// (std::max(-levels, NaN) is -levels).
COMB_INLINE at::Tensor scales_of(const at::Tensor& amax, float levels) {
  at::Tensor s = amax / at::full({}, levels, amax.options());
  return at::where(s > 0, s.clamp(6.103515625e-05, 65504.0), at::ones_like(s)).to(at::kHalf);
}
COMB_INLINE at::Tensor codes_of(const at::Tensor& x, const at::Tensor& scales, float levels) {
  return (x / scales.to(at::kFloat)).round().nan_to_num_(-levels).clamp_(-levels, levels).to(at::kChar).contiguous();
}
// The largest magnitude along `dim` (kept) as the loops take it: NaN skipped (std::max keeps its
// first argument), infinities kept.
COMB_INLINE at::Tensor abs_max(const at::Tensor& x, int64_t dim) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  return x.abs().nan_to_num_(0.0, inf, inf).amax(dim, /*keepdim=*/true);
}
// kInt4ScaleSteps on `device`: on the CPU the table itself; elsewhere a copy made once per device
// and kept (a copy from pageable host memory waits for the device: once per key block read, every
// int4 block of a request would wait). Kept for the process's life, never destroyed, so no tensor
// is freed after the device's runtime has shut down.
COMB_INLINE at::Tensor int4_scale_steps_on(c10::Device device) {
  const at::Tensor table = at::from_blob(const_cast<float*>(kInt4ScaleSteps), {16}, at::kFloat);
  if (device.is_cpu()) return table;
  static std::mutex mutex;
  static auto* held = new std::map<std::pair<int, int>, at::Tensor>();
  const std::pair<int, int> key{static_cast<int>(device.type()), static_cast<int>(device.index())};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = held->find(key);
  if (it == held->end()) {
    c10::InferenceMode normal(false);  // a plain tensor, usable with autograd on or off
    it = held->emplace(key, table.to(device)).first;
  }
  return it->second;
}
// code_int4_key_scales and int4_key_scales by tensor ops (any device; the CPU's loops give the same
// bytes and scales).
COMB_INLINE at::Tensor int4_scale_steps(const at::Tensor& big) {
  return (big.to(at::kFloat) * int4_scale_steps_on(big.device())).to(at::kHalf);  // [heads, 1, 16]
}
COMB_INLINE std::pair<at::Tensor, at::Tensor> code_int4_key_scales_ops(const at::Tensor& scales,
                                                                       const at::Tensor& zero) {
  at::Tensor big = at::where(zero, at::zeros_like(scales), scales).amax(-1, /*keepdim=*/true);
  big = at::where(big > 0, big, at::ones_like(big)).contiguous();
  at::Tensor step = int4_scale_steps(big);
  at::Tensor e = (step.unsqueeze(-2) >= scales.unsqueeze(-1)).sum(-1) - 1;  // the steps fall: a prefix
  e = at::where(zero, at::full_like(e, 15), e.clamp_min(0));
  at::Tensor used = at::gather(step, -1, e).contiguous();
  at::Tensor nibbles = e.to(at::kByte);
  at::Tensor packed = at::bitwise_or(nibbles.slice(-1, 0, c10::nullopt, 2),
                                     at::bitwise_left_shift(nibbles.slice(-1, 1, c10::nullopt, 2), 4));
  return {at::cat({big.view(at::kByte), packed}, -1).contiguous(), used};
}
COMB_INLINE at::Tensor decode_int4_key_scales_ops(const at::Tensor& coded) {
  const int64_t heads = coded.size(0), d = (coded.size(2) - 2) * 2;
  at::Tensor big = coded.narrow(-1, 0, 2).contiguous().view(at::kHalf);  // [heads, 1, 1]
  at::Tensor bytes = coded.narrow(-1, 2, d / 2);
  at::Tensor e = at::stack({at::bitwise_and(bytes, 15), at::bitwise_right_shift(bytes, 4)}, -1)
                     .reshape({heads, 1, d})
                     .to(at::kLong);
  return at::gather(int4_scale_steps(big), -1, e).contiguous();
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> code_centred_int4_keys_ops(const at::Tensor& x) {
  COMB_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(1) > 0 && x.size(2) % 2 == 0,
             "coding centred int4 keys: expected float32 rotated keys [n_head_kv, n_tokens > 0, head_dim even], found "
             "{} [{}]",
             c10::toString(x.scalar_type()), fmt::join(x.sizes(), ", "));
  auto f = [&](float v) { return at::full({}, v, x.options()); };
  const at::Tensor k = at::nan_to_num(x, 0.0, kCentredKeyBound, -kCentredKeyBound).clamp(-kCentredKeyBound, kCentredKeyBound);
  at::Tensor lo = k.amin(1, /*keepdim=*/true), hi = k.amax(1, /*keepdim=*/true);
  at::Tensor mid = (lo + hi) * f(0.5f);
  at::Tensor w = at::maximum((hi - lo) / f(15.0f), mid.abs() / f(127.0f));
  at::Tensor s = scales_of(w, 1.0f);  // int8_scale(w, 1), as centred_scale starts
  // rounded up (centred_scale): the next float16 where the nearest is under w
  const at::Tensor up = (s.to(at::kFloat) < w).logical_and(s.to(at::kFloat) < 65504.0f);
  s = at::where(up, (s.view(at::kShort) + 1).view(at::kHalf), s);
  auto [bytes, used] = code_int4_key_scales_ops(s, (w > 0).logical_not());
  at::Tensor scale = used.to(at::kFloat);
  at::Tensor m = (mid / scale + f(0.5f)).round().clamp(-127, 127);
  at::Tensor q = (k / scale - m).round().clamp(-8, 7).to(at::kChar).contiguous();
  at::Tensor centres = m.to(at::kChar).view(at::kByte);
  return {q, at::cat({bytes, centres}, -1).contiguous()};
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> quantize_keys_ops(const at::Tensor& k, float levels, KeyScaleForm form) {
  if (form == KeyScaleForm::centred) return code_centred_int4_keys_ops(k);
  at::Tensor amax = abs_max(k, form == KeyScaleForm::per_row ? 2 : 1);
  at::Tensor ks = scales_of(amax, levels).contiguous();
  if (form != KeyScaleForm::coded) return {codes_of(k, ks, levels), ks};
  auto [bytes, used] = code_int4_key_scales_ops(ks, (amax / at::full({}, levels, amax.options()) > 0).logical_not());
  return {codes_of(k, used, levels), bytes};
}
COMB_INLINE std::pair<at::Tensor, at::Tensor> quantize_keys(const at::Tensor& k, float levels, KeyScaleForm form) {
  if (k.device().is_cpu()) return quantize_keys_cpu(k.contiguous(), levels, form);
  return quantize_keys_ops(k, levels, form);
}

COMB_INLINE float hadamard_norm(int64_t d) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))); }

COMB_INLINE void check_hadamard_order(int64_t d) {
  COMB_CHECK(DocumentKV::rotates_int4_keys(d),
             "int4 keys are rotated by a Walsh-Hadamard matrix of order head_dim, which must be a power of two; "
             "found head_dim {}",
             d);
}

// Rotated int4 keys ([heads, n, d / 2] uint8 codes, float16 scales per channel or row): checked,
// and whether the scales are per channel.
COMB_INLINE bool int4_keys_per_channel(const at::Tensor& packed, const at::Tensor& scales) {
  COMB_CHECK(packed.dim() == 3 && scales.dim() == 3 && packed.scalar_type() == at::kByte,
             "int4 keys: expected uint8 codes and scales of 3 dimensions, found {} codes of {} dimensions and scales of {}",
             c10::toString(packed.scalar_type()), packed.dim(), scales.dim());
  const int64_t heads = packed.size(0), n = packed.size(1), d = packed.size(2) * 2;
  check_hadamard_order(d);
  const bool per_channel = scales.size(1) == 1 && scales.size(2) == d;
  COMB_CHECK(scales.scalar_type() == at::kHalf && scales.size(0) == heads &&
                 (per_channel || (scales.size(1) == n && scales.size(2) == 1)),
             "int4 keys [{}, {}, {}]: expected float16 scales [{}, 1, {}] or [{}, {}, 1], found {} [{}]", heads, n,
             d / 2, heads, d, heads, n, c10::toString(scales.scalar_type()), fmt::join(scales.sizes(), ", "));
  return per_channel;
}

// One head of rotated int4 keys read as float32 and rotated back, on the CPU, transposed: xt[j * n
// + t] is channel j of token t (bt: room for the head's n * d / 2 bytes). The same floats as
// unpack_int4, a float32 product with the scales and hadamard_rows (each element's operations are
// theirs, in their order). Transposed, every butterfly is two rows of n floats added and
// subtracted, which the compiler vectorizes.
COMB_INLINE void rotated_int4_head_cpu(const uint8_t* codes, const float* scales, const int8_t* centres,
                                       bool per_channel, int64_t n, int64_t d, float* xt, uint8_t* bt) {
  for (int64_t t = 0; t < n; ++t)  // the bytes transposed
    for (int64_t j = 0; j < d / 2; ++j) bt[j * n + t] = codes[t * (d / 2) + j];
  for (int64_t j = 0; j < d / 2; ++j) {  // codes times scales, transposed: channels 2j and 2j + 1
    float* lo = xt + 2 * j * n;
    float* hi = lo + n;
    const uint8_t* b = bt + j * n;
    // centred keys: (q + m_j) * s_j, the sum an exact integer
    const int c_lo = centres ? centres[2 * j] : 0, c_hi = centres ? centres[2 * j + 1] : 0;
    for (int64_t t = 0; t < n; ++t) {
      lo[t] = static_cast<float>((b[t] & 15) - 8 + c_lo);
      hi[t] = static_cast<float>((b[t] >> 4) - 8 + c_hi);
    }
    if (per_channel) {
      const float s_lo = scales[2 * j], s_hi = scales[2 * j + 1];
      for (int64_t t = 0; t < n; ++t) lo[t] *= s_lo, hi[t] *= s_hi;
    } else {
      for (int64_t t = 0; t < n; ++t) lo[t] *= scales[t], hi[t] *= scales[t];
    }
  }
  for (int64_t w = 1; w < d; w *= 2)  // butterflies over channel pairs (j, j + w), as hadamard_rows
    for (int64_t i = 0; i < d; i += 2 * w)
      for (int64_t j = i; j < i + w; ++j) {
        float* a = xt + j * n;
        float* b = xt + (j + w) * n;
        for (int64_t t = 0; t < n; ++t) {
          const float u = a[t], v = b[t];
          a[t] = u + v;
          b[t] = u - v;
        }
      }
  const float norm = hadamard_norm(d);  // times 1 / sqrt(d)
  for (int64_t i = 0; i < d * n; ++i) xt[i] *= norm;
}

// Rotated int4 keys read as float32 and rotated back on the CPU, one head at a time.
COMB_INLINE at::Tensor rotated_int4_keys_float_cpu(const at::Tensor& packed, const at::Tensor& coded_or_half) {
  auto [scales, centres] = int4_key_scales_and_centres(packed, coded_or_half);
  const bool per_channel = int4_keys_per_channel(packed, scales);
  const int64_t heads = packed.size(0), n = packed.size(1), d = packed.size(2) * 2;
  at::Tensor p = packed.contiguous(), sc = scales.to(at::kFloat).contiguous();
  if (centres.defined()) centres = centres.contiguous();
  at::Tensor x = at::empty({heads, n, d}, at::kFloat);
  float* xp = x.data_ptr<float>();
  std::vector<float> xt(static_cast<size_t>(d * n));
  std::vector<uint8_t> bt(static_cast<size_t>(d / 2 * n));
  for (int64_t h = 0; h < heads; ++h) {
    rotated_int4_head_cpu(p.data_ptr<uint8_t>() + h * n * (d / 2), sc.data_ptr<float>() + h * (per_channel ? d : n),
                          centres.defined() ? centres.data_ptr<int8_t>() + h * d : nullptr, per_channel, n, d,
                          xt.data(), bt.data());
    for (int64_t t = 0; t < n; ++t)  // back to rows
      for (int64_t j = 0; j < d; ++j) xp[(h * n + t) * d + j] = xt[j * n + t];
  }
  return x;
}

// The same read as int8 keys (int8's scales: per channel from head_dim / 2 tokens, else per row):
// the codes and scales quantize_keys_cpu gives those floats (the same largest magnitudes, scales and
// codes), computed on the transposed head without writing the floats out.
// One block's rotated int4 keys ([heads, n, d / 2] bytes, float32 scales per channel or row) to
// int8 codes [heads, n, d] and float16 scales ([heads, 1, d] where keys_per_channel(n, d), else
// [heads, n, 1]): loops over memory only, so that blocks can run in parallel.
COMB_INLINE void rotated_int4_keys_to_int8(const uint8_t* packed, const float* scales, const int8_t* centres,
                                           bool per_channel_in, int64_t heads, int64_t n, int64_t d, int8_t* kqp,
                                           at::Half* ksp) {
  const bool per_channel = DocumentKV::keys_per_channel(n, d);
  std::vector<float> xt(static_cast<size_t>(d * n)), m(static_cast<size_t>(n)), s(static_cast<size_t>(n));
  std::vector<int8_t> ct(static_cast<size_t>(d * n));
  std::vector<uint8_t> bt(static_cast<size_t>(d / 2 * n));
  for (int64_t h = 0; h < heads; ++h) {
    rotated_int4_head_cpu(packed + h * n * (d / 2), scales + h * (per_channel_in ? d : n),
                          centres ? centres + h * d : nullptr, per_channel_in, n, d, xt.data(), bt.data());
    if (per_channel) {  // a scale per channel: a row of xt each
      for (int64_t j = 0; j < d; ++j) {
        const float* x = xt.data() + j * n;
        // The largest magnitude over eight running maxima (no chain of one per element); max is
        // exact and NaN never enters (std::max keeps its first argument then), so any order
        // gives quantize_keys_cpu's value.
        float part[8] = {};
        int64_t t = 0;
        for (; t + 8 <= n; t += 8)
          for (int64_t i = 0; i < 8; ++i) part[i] = std::max(part[i], std::fabs(x[t + i]));
        for (; t < n; ++t) part[0] = std::max(part[0], std::fabs(x[t]));
        float amax = 0.0f;
        for (float partial : part) amax = std::max(amax, partial);
        ksp[h * d + j] = int8_scale(amax, 127.0f);
        const float scale = static_cast<float>(ksp[h * d + j]);
        int8_t* c = ct.data() + j * n;
        for (int64_t u = 0; u < n; ++u) c[u] = code(x[u], scale, 127.0f);
      }
    } else {  // a scale per token: a column of xt each
      std::fill(m.begin(), m.end(), 0.0f);
      for (int64_t j = 0; j < d; ++j)
        for (int64_t t = 0; t < n; ++t) m[t] = std::max(m[t], std::fabs(xt[j * n + t]));
      for (int64_t t = 0; t < n; ++t) {
        ksp[h * n + t] = int8_scale(m[t], 127.0f);
        s[t] = static_cast<float>(ksp[h * n + t]);
      }
      for (int64_t j = 0; j < d; ++j)
        for (int64_t t = 0; t < n; ++t) ct[j * n + t] = code(xt[j * n + t], s[t], 127.0f);
    }
    for (int64_t t = 0; t < n; ++t)  // codes back to rows
      for (int64_t j = 0; j < d; ++j) kqp[(h * n + t) * d + j] = ct[j * n + t];
  }
}

// One block's part of DocumentKV::int8_codes on the CPU, split in two: prepare (tensor ops: checks,
// contiguous inputs, the outputs allocated), then run (loops over memory only, safe inside
// at::parallel_for, whose threads do not carry ATen's thread-local state).
struct Int8BlockRead {
  std::array<at::Tensor, 4> out;  // key codes, key scales, value codes, value scales
  at::Tensor keys, key_scales, key_centres, values;  // the inputs read by run (contiguous), where converted
  bool per_channel_in = false;
  // Prepares the rotated int4 keys `packed` with their scales (float16, or coded) to be read as int8.
  void prepare_int4_keys(const at::Tensor& packed, const at::Tensor& coded_or_half) {
    auto [scales, centres] = int4_key_scales_and_centres(packed, coded_or_half);
    per_channel_in = int4_keys_per_channel(packed, scales);
    const int64_t heads = packed.size(0), n = packed.size(1), d = packed.size(2) * 2;
    keys = packed.contiguous(), key_scales = scales.to(at::kFloat).contiguous();
    if (centres.defined()) key_centres = centres.contiguous();
    out[0] = at::empty({heads, n, d}, at::kChar);
    out[1] = DocumentKV::keys_per_channel(n, d) ? at::empty({heads, 1, d}, at::kHalf)
                                                : at::empty({heads, n, 1}, at::kHalf);
  }
  void run() const;
};

// The codes of an int4 key block as int8: rotated back, coded again.
COMB_INLINE std::pair<at::Tensor, at::Tensor> rotated_int4_keys_cpu(const at::Tensor& packed,
                                                                    const at::Tensor& scales) {
  Int8BlockRead r;
  r.prepare_int4_keys(packed, scales);
  r.run();
  return {r.out[0], r.out[1]};
}

// int4 codes unpacked on the CPU: the bytes of unpack_int4's tensor ops, in one loop.
COMB_INLINE void unpack_int4_bytes(const uint8_t* src, int64_t n, int8_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    dst[2 * i] = static_cast<int8_t>((src[i] & 15) - 8);
    dst[2 * i + 1] = static_cast<int8_t>((src[i] >> 4) - 8);
  }
}
COMB_INLINE at::Tensor unpacked_int4_like(const at::Tensor& packed) {
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() *= 2;
  return at::empty(shape, at::kChar);
}
COMB_INLINE at::Tensor unpack_int4_cpu(const at::Tensor& packed) {
  at::Tensor p = packed.contiguous(), out = unpacked_int4_like(p);
  unpack_int4_bytes(p.data_ptr<uint8_t>(), p.numel(), out.data_ptr<int8_t>());
  return out;
}

COMB_INLINE void Int8BlockRead::run() const {
  if (keys.defined())
    rotated_int4_keys_to_int8(keys.data_ptr<uint8_t>(), key_scales.data_ptr<float>(),
                              key_centres.defined() ? key_centres.data_ptr<int8_t>() : nullptr, per_channel_in,
                              keys.size(0), keys.size(1), keys.size(2) * 2, out[0].data_ptr<int8_t>(),
                              out[1].data_ptr<at::Half>());
  if (values.defined()) unpack_int4_bytes(values.data_ptr<uint8_t>(), values.numel(), out[2].data_ptr<int8_t>());
}

// Rotated int4 keys (packed, with their float16 scales) as int8 keys of the rows rotated back, on
// any device: the CPU's one pass, else tensor ops (the same numbers).
COMB_INLINE std::pair<at::Tensor, at::Tensor> rotated_int4_keys_as_int8(const at::Tensor& packed,
                                                                        const at::Tensor& scales) {
  if (packed.device().is_cpu()) return rotated_int4_keys_cpu(packed, scales);
  at::Tensor x = rotated_int4_keys_float(packed, scales);
  return quantize_keys(x, 127.0f, DocumentKV::key_scale_form(at::kChar, x.size(1), x.size(2)));
}
}  // namespace detail::document_kv

COMB_INLINE at::Tensor unpack_int4(const at::Tensor& packed) {
  COMB_CHECK(packed.scalar_type() == at::kByte && packed.dim() >= 1,
             "int4 codes: expected uint8 bytes holding two codes each, found {} of {} dimensions",
             c10::toString(packed.scalar_type()), packed.dim());
  if (packed.device().is_cpu()) return detail::document_kv::unpack_int4_cpu(packed);
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() *= 2;
  at::Tensor lo = at::bitwise_and(packed, 15).to(at::kChar) - 8;
  at::Tensor hi = at::bitwise_right_shift(packed, 4).to(at::kChar) - 8;
  return at::stack({lo, hi}, -1).reshape(shape);
}

COMB_INLINE at::Tensor pack_int4(const at::Tensor& codes) {
  COMB_CHECK(codes.scalar_type() == at::kChar && codes.dim() >= 1 && codes.size(-1) % 2 == 0,
             "int4 packing: expected int8 codes over an even last dimension, found {} [{}]",
             c10::toString(codes.scalar_type()), fmt::join(codes.sizes(), ", "));
  at::Tensor u = (codes + 8).to(at::kByte);
  return at::bitwise_or(u.slice(-1, 0, c10::nullopt, 2), at::bitwise_left_shift(u.slice(-1, 1, c10::nullopt, 2), 4))
      .contiguous();
}

COMB_INLINE at::Tensor as_int8_codes(const at::Tensor& part) {
  return part.scalar_type() == at::kByte ? unpack_int4(part) : part;
}

COMB_INLINE at::Tensor hadamard_rows(const at::Tensor& x) {
  COMB_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "hadamard_rows: expected float32 rows, found {} [{}]",
             c10::toString(x.scalar_type()), fmt::join(x.sizes(), ", "));
  const int64_t d = x.size(-1);
  detail::document_kv::check_hadamard_order(d);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  at::Tensor y = x.contiguous().view({rows, d});
  for (int64_t h = 1; h < d; h *= 2) {
    at::Tensor pairs = y.view({rows, d / (2 * h), 2, h});
    at::Tensor a = pairs.select(2, 0), b = pairs.select(2, 1);
    y = at::stack({a + b, a - b}, 2).view({rows, d});
  }
  return (y * at::full({}, detail::document_kv::hadamard_norm(d), y.options())).view(x.sizes());
}

COMB_INLINE at::Tensor rotated_int4_keys_float(const at::Tensor& packed, const at::Tensor& coded_or_half) {
  if (packed.device().is_cpu()) return detail::document_kv::rotated_int4_keys_float_cpu(packed, coded_or_half);
  const auto [scales, centres] = detail::document_kv::int4_key_scales_and_centres(packed, coded_or_half);
  detail::document_kv::int4_keys_per_channel(packed, scales);  // the same checks (sizes only)
  at::Tensor q = unpack_int4(packed).to(at::kFloat);
  if (centres.defined()) q = q + centres.to(at::kFloat);  // (q + m_j): exact integers
  return hadamard_rows(q * scales.to(at::kFloat));
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> code_int4_key_scales(const at::Tensor& scales, const at::Tensor& zero) {
  COMB_CHECK(scales.dim() == 3 && scales.size(1) == 1 && scales.size(2) % 2 == 0 && scales.scalar_type() == at::kHalf &&
                 zero.sizes() == scales.sizes() && zero.scalar_type() == at::kBool && zero.device() == scales.device(),
             "coding int4 key scales: expected float16 scales [n_head_kv, 1, head_dim] (head_dim even) and a bool "
             "mask of their size on their device, found {} [{}] and {} [{}]",
             c10::toString(scales.scalar_type()), fmt::join(scales.sizes(), ", "), c10::toString(zero.scalar_type()),
             fmt::join(zero.sizes(), ", "));
  COMB_CHECK((scales > 0).logical_and(scales.isfinite()).all().item<bool>(),
             "coding int4 key scales: every scale must be a finite positive number");
  if (!scales.device().is_cpu()) return detail::document_kv::code_int4_key_scales_ops(scales, zero);
  const int64_t heads = scales.size(0), d = scales.size(2);
  at::Tensor s = scales.contiguous(), z = zero.contiguous();
  const int64_t row = DocumentKV::coded_key_scale_bytes(d, false);
  at::Tensor bytes = at::empty({heads, 1, row}, at::kByte), used = at::empty({heads, 1, d}, at::kHalf);
  for (int64_t h = 0; h < heads; ++h)
    detail::document_kv::code_key_scales_head(s.data_ptr<at::Half>() + h * d, z.data_ptr<bool>() + h * d, d,
                                              bytes.data_ptr<uint8_t>() + h * row,
                                              used.data_ptr<at::Half>() + h * d);
  return {bytes, used};
}

namespace detail::document_kv {
// Coded int4 key scales checked against their keys; returns head_dim / 2.
COMB_INLINE int64_t check_coded_key_scales(const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t half = packed.dim() == 3 ? packed.size(2) : 0;  // head_dim / 2
  const int64_t coded = DocumentKV::coded_key_scale_bytes(2 * half, false);
  const int64_t centred = DocumentKV::coded_key_scale_bytes(2 * half, true);
  COMB_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && scales.dim() == 3 &&
                 scales.size(0) == packed.size(0) && scales.size(1) == 1 &&
                 (scales.size(2) == coded || scales.size(2) == centred) && scales.device() == packed.device(),
             "int4 keys [{}] ({}): expected coded scales [{}, 1, {}] or, centred, [{}, 1, {}] (uint8) on their device, "
             "found [{}] on {}",
             fmt::join(packed.sizes(), ", "), c10::toString(packed.scalar_type()), packed.dim() == 3 ? packed.size(0) : 0,
             coded, packed.dim() == 3 ? packed.size(0) : 0, centred, fmt::join(scales.sizes(), ", "),
             scales.device().str());
  return half;
}

// The centres of coded scales checked by check_coded_key_scales (a view, undefined without them).
COMB_INLINE at::Tensor coded_key_centres(const at::Tensor& scales, int64_t half) {
  if (scales.size(2) != DocumentKV::coded_key_scale_bytes(2 * half, true)) return at::Tensor();
  return scales.narrow(-1, DocumentKV::coded_key_scale_bytes(2 * half, false), 2 * half).view(at::kChar);
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> int4_key_scales_and_centres(const at::Tensor& packed,
                                                                           const at::Tensor& scales) {
  if (scales.scalar_type() != at::kByte) return {scales, at::Tensor()};
  const int64_t half = check_coded_key_scales(packed, scales);
  at::Tensor centres = coded_key_centres(scales, half);
  if (!scales.device().is_cpu())
    return {decode_int4_key_scales_ops(scales.narrow(-1, 0, DocumentKV::coded_key_scale_bytes(2 * half, false))),
            centres};
  const int64_t heads = scales.size(0), d = 2 * half;
  at::Tensor in = scales.contiguous(), out = at::empty({heads, 1, d}, at::kHalf);
  decode_key_scales_cpu(in.data_ptr<uint8_t>(), heads, d, scales.size(2), out.data_ptr<at::Half>());
  return {out, centres};
}
}  // namespace detail::document_kv

COMB_INLINE at::Tensor int4_key_scales(const at::Tensor& packed, const at::Tensor& scales) {
  return detail::document_kv::int4_key_scales_and_centres(packed, scales).first;
}

COMB_INLINE at::Tensor int4_key_centres(const at::Tensor& packed, const at::Tensor& scales) {
  if (scales.scalar_type() != at::kByte) return at::Tensor();
  return detail::document_kv::coded_key_centres(scales, detail::document_kv::check_coded_key_scales(packed, scales));
}

namespace detail::document_kv {
// Block b of `kv` as int8_codes reads it on the CPU, prepared (see Int8BlockRead).
COMB_INLINE Int8BlockRead prepare_int8_block(const DocumentKV& kv, size_t b) {
  Int8BlockRead r;
  const at::Tensor& k = kv.keys[b];
  const at::Tensor& v = kv.values[b];
  r.out = {k, kv.quantized() ? kv.key_scales.at(b) : at::Tensor(), v,
           kv.quantized() ? kv.value_scales.at(b) : at::Tensor()};
  if (k.scalar_type() == at::kByte) {  // int4 keys, rotated: back, then int8
    COMB_CHECK(kv.quantized(), "int4 keys without scales");
    r.prepare_int4_keys(k, kv.key_scales.at(b));
  }
  if (v.scalar_type() == at::kByte) {  // int4 values: their codes unpacked
    COMB_CHECK(v.dim() >= 1, "int4 codes: expected uint8 bytes holding two codes each, found {} dimensions", v.dim());
    r.values = v.contiguous();
    r.out[2] = unpacked_int4_like(r.values);
  }
  return r;
}
}  // namespace detail::document_kv

COMB_INLINE std::array<at::Tensor, 4> DocumentKV::int8_block(size_t block) const {
  COMB_CHECK(block < keys.size() && block < values.size(), "int8_block: block {} of a cache of {}", block, keys.size());
  if (keys[block].device().is_cpu() && values[block].device().is_cpu()) {
    const detail::document_kv::Int8BlockRead r = detail::document_kv::prepare_int8_block(*this, block);
    r.run();
    return r.out;
  }
  const at::Tensor& k = keys[block];
  at::Tensor kc, ks = quantized() ? key_scales.at(block) : at::Tensor();
  if (k.scalar_type() == at::kByte) {  // int4 keys, rotated: back, then int8
    COMB_CHECK(quantized(), "int4 keys without scales");
    std::tie(kc, ks) = detail::document_kv::rotated_int4_keys_as_int8(k, ks);
  } else {
    kc = k;
  }
  return {kc, ks, as_int8_codes(values[block]), quantized() ? value_scales.at(block) : at::Tensor()};
}

COMB_INLINE DocumentKV DocumentKV::int8_codes() const {
  if (keys.empty() || values.empty() || !packs_int4(dtype())) return *this;
  COMB_CHECK(values.size() == keys.size(), "a document cache with keys for {} blocks and values for {}", keys.size(),
             values.size());
  DocumentKV out;
  out.n_tokens = n_tokens;
  const size_t n = keys.size();
  out.keys.resize(n), out.key_scales.resize(n), out.values.resize(n), out.value_scales.resize(n);
  const bool cpu = std::all_of(keys.begin(), keys.end(), [](const at::Tensor& t) { return t.device().is_cpu(); }) &&
                   std::all_of(values.begin(), values.end(), [](const at::Tensor& t) { return t.device().is_cpu(); });
  if (!cpu) {  // in order, on the caller's stream
    for (size_t b = 0; b < n; ++b) {
      auto [kc, ks, vc, vs] = int8_block(b);
      out.keys[b] = kc, out.key_scales[b] = ks, out.values[b] = vc, out.value_scales[b] = vs;
    }
    return out;
  }
  // On the CPU every tensor is made first, then the blocks' loops run in parallel.
  std::vector<detail::document_kv::Int8BlockRead> reads;
  reads.reserve(n);
  for (size_t b = 0; b < n; ++b) reads.push_back(detail::document_kv::prepare_int8_block(*this, b));
  at::parallel_for(0, static_cast<int64_t>(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) reads[b].run();
  });
  for (size_t b = 0; b < n; ++b) {
    const auto& [kc, ks, vc, vs] = reads[b].out;
    out.keys[b] = kc, out.key_scales[b] = ks, out.values[b] = vc, out.value_scales[b] = vs;
  }
  return out;
}

COMB_INLINE void dequantize_linked(std::vector<std::vector<at::Tensor>>& keys,
                                   std::vector<std::vector<at::Tensor>>& values,
                                   const std::vector<std::vector<at::Tensor>>& key_scales,
                                   const std::vector<std::vector<at::Tensor>>& value_scales) {
  COMB_CHECK(key_scales.size() == value_scales.size() && (key_scales.empty() || key_scales.size() == keys.size()) &&
                 values.size() == keys.size(),
             "linked documents: scales for {} and {} blocks, K/V for {} and {}", key_scales.size(), value_scales.size(),
             keys.size(), values.size());
  for (size_t b = 0; b < key_scales.size(); ++b) {
    COMB_CHECK(key_scales[b].size() == keys[b].size() && value_scales[b].size() == keys[b].size() &&
                   values[b].size() == keys[b].size(),
               "linked documents: block {} has {} documents but {} and {} scales", b, keys[b].size(),
               key_scales[b].size(), value_scales[b].size());
    for (size_t d = 0; d < keys[b].size(); ++d)
      if (key_scales[b][d].defined()) {
        if (keys[b][d].scalar_type() == at::kByte) {  // rotated int4 keys: as int8_codes reads them
          auto [kc, ks] = detail::document_kv::rotated_int4_keys_as_int8(keys[b][d], key_scales[b][d]);
          keys[b][d] = kc.to(at::kFloat) * ks;
        } else {
          keys[b][d] = keys[b][d].to(at::kFloat) * key_scales[b][d];
        }
        values[b][d] = as_int8_codes(values[b][d]).to(at::kFloat) * value_scales[b][d];
      }
  }
}

// (Declared in comb/detail/upload.hpp; defined here, where documents' caches move to a device.)
COMB_INLINE at::Tensor detail::upload(const at::Tensor& t, c10::Device device) {
  if (!device.is_cuda() || !t.device().is_cpu()) return t.to(device);
  at::Tensor host;
  try {
    host = at::empty(t.sizes(), t.options().pinned_memory(true));
  } catch (const c10::Error&) {  // no page-locked memory left: the plain copy, which waits
    return t.to(device);
  }
  host.copy_(t);
  return host.to(device, /*non_blocking=*/true);
}

COMB_INLINE DocumentKV DocumentKV::to(c10::Device device, c10::ScalarType dtype) const {
  const c10::ScalarType from = keys.empty() || values.empty() ? c10::ScalarType::Undefined : this->dtype();
  // Already on `device` in `dtype`, every part contiguous: the same tensors, which is what the
  // conversions below would give, without the ATen call each makes (a store's put of a GPU's
  // entries: four a document and block).
  auto here = [&](const std::vector<at::Tensor>& parts) {  // each of one scalar type, as the first
    return std::all_of(parts.begin(), parts.end(), [&](const at::Tensor& t) {
      return t.defined() && t.scalar_type() == parts[0].scalar_type() && t.device() == device && t.is_contiguous();
    });
  };
  if (from == dtype && from != c10::ScalarType::Undefined && (quantized() || !is_quantized_form(dtype)) &&
      keys.size() == values.size() &&
      key_scales.size() == (quantized() ? keys.size() : 0) && value_scales.size() == key_scales.size() &&
      (quantized() || values[0].scalar_type() == dtype) && here(keys) && here(values) && here(key_scales) &&
      here(value_scales))
    return *this;
  DocumentKV out;
  out.n_tokens = n_tokens;
  // An int4 entry is read as its int8 form (int8_codes: int4 keys rotated back); to int8 that, moved.
  if (packs_int4(from) && from != dtype) return int8_codes().to(device, dtype);
  const bool from_int8 = quantized();
  const bool to_codes = is_quantized_form(dtype);
  const float key_levels = dtype == kCacheInt4 ? 7.0f : 127.0f, value_levels = packs_int4(dtype) ? 7.0f : 127.0f;
  // From the host to a CUDA device each part goes through page-locked memory, the host not waiting
  // for the device's queue (detail::upload): a store's entry promoted from pageable host memory, or
  // read from disk or Redis, no longer holds up the launches after it.
  for (size_t b = 0; b < keys.size(); ++b) {
    at::Tensor k = detail::upload(keys[b], device), v = detail::upload(values[b], device);
    if (from_int8 && dtype == from) {  // already in this form: the same codes and scales, moved
      out.keys.push_back(k.contiguous());
      out.values.push_back(v.contiguous());
      out.key_scales.push_back(detail::upload(key_scales.at(b), device).contiguous());
      out.value_scales.push_back(detail::upload(value_scales.at(b), device).contiguous());
      continue;
    }
    if (from_int8) {  // back to float32 first
      k = k.to(at::kFloat) * detail::upload(key_scales.at(b), device);
      v = v.to(at::kFloat) * detail::upload(value_scales.at(b), device);
    }
    if (to_codes) {
      COMB_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && (!packs_int4(dtype) || k.size(2) % 2 == 0),
                 "quantizing a document cache to {}: block {} has keys [{}] and values [{}]; expected equal "
                 "[n_head_kv, n_tokens, head_dim]{}",
                 cache_dtype_name(dtype), b, fmt::join(k.sizes(), ", "), fmt::join(v.sizes(), ", "),
                 packs_int4(dtype) ? " with an even head_dim" : "");
      at::Tensor kq, ks, vq, vs;
      if (dtype == kCacheInt4) {  // int4 keys are quantized rotated (see the header)
        detail::document_kv::check_hadamard_order(k.size(2));
        k = hadamard_rows(k.to(at::kFloat));
      }
      const KeyScaleForm key_form = key_scale_form(dtype, k.size(1), k.size(2));
      if (k.device().is_cpu() && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat) {
        auto q = detail::document_kv::quantize_int8_cpu(k.contiguous(), v.contiguous(), key_levels, value_levels,
                                                        key_form);
        kq = q[0], ks = q[1], vq = q[2], vs = q[3];
      } else {
        v = v.to(at::kFloat);
        std::tie(kq, ks) = detail::document_kv::quantize_keys(k.to(at::kFloat), key_levels, key_form);
        vs = detail::document_kv::scales_of(detail::document_kv::abs_max(v, 2), value_levels).contiguous();
        vq = detail::document_kv::codes_of(v, vs, value_levels);
      }
      out.keys.push_back(dtype == kCacheInt4 ? pack_int4(kq) : kq);
      out.values.push_back(packs_int4(dtype) ? pack_int4(vq) : vq);
      out.key_scales.push_back(ks);
      out.value_scales.push_back(vs);
      continue;
    }
    out.keys.push_back(k.to(dtype).contiguous());
    out.values.push_back(v.to(dtype).contiguous());
  }
  return out;
}

// ================================================================================================
// Linker
// ================================================================================================

COMB_INLINE LinkedDocuments Linker::link(const std::vector<std::shared_ptr<const DocumentKV>>& documents) const {
  return link_batch({documents});
}

COMB_INLINE LinkedDocuments Linker::link_batch(const std::vector<std::vector<std::shared_ptr<const DocumentKV>>>& documents) const {
  LinkedDocuments out;
  size_t n_blocks = 0;
  for (const auto& request : documents)
    for (const auto& d : request) {
      COMB_CHECK(d && !d->keys.empty(), "a linked document is empty");
      COMB_CHECK(n_blocks == 0 || d->keys.size() == n_blocks,
                 "linked documents come from different plug-ins ({} and {} cross blocks)", n_blocks, d->keys.size());
      n_blocks = d->keys.size();
    }
  out.keys.resize(n_blocks);
  out.values.resize(n_blocks);
  if (keep_int8_) {
    out.key_scales.resize(n_blocks);
    out.value_scales.resize(n_blocks);
  }
  for (const auto& request : documents) {
    out.doc_counts.push_back(static_cast<int64_t>(request.size()));
    for (auto d : request) {
      // A host-tier entry for a GPU decoder: one copy; an int8 entry: read as float32 (the store
      // keeps the int8 one), or linked as it is (keep_int8); an int4 one as its int8 codes.
      const bool as_stored = keep_int8_ && d->quantized() && d->keys[0].device() == device_;
      if (d->quantized() && !as_stored)
        d = std::make_shared<const DocumentKV>(d->to(device_, at::kFloat));
      else if (d->keys[0].device() != device_)
        d = std::make_shared<const DocumentKV>(d->to(device_, d->dtype()));
      if (as_stored && DocumentKV::packs_int4(d->dtype())) d = std::make_shared<const DocumentKV>(d->int8_codes());
      for (size_t b = 0; b < n_blocks; ++b) {
        out.keys[b].push_back(d->keys[b]);
        out.values[b].push_back(d->values[b]);
        if (keep_int8_) {
          out.key_scales[b].push_back(as_stored ? d->key_scales.at(b) : at::Tensor());
          out.value_scales[b].push_back(as_stored ? d->value_scales.at(b) : at::Tensor());
        }
      }
      out.held.push_back(std::move(d));
    }
  }
  return out;
}

// ---- DocumentSplit -----------------------------------------------------------------------------

COMB_INLINE detail::DocumentSplit::DocumentSplit(std::vector<std::array<int64_t, 3>> rows, int64_t n_blocks)
    : rows_(std::move(rows)), out_(rows_.size()), n_blocks_(n_blocks) {
  for (size_t d = 0; d < rows_.size(); ++d) {
    out_[d].n_tokens = rows_[d][2];
    out_[d].keys.resize(static_cast<size_t>(n_blocks));
    out_[d].values.resize(static_cast<size_t>(n_blocks));
  }
}

COMB_INLINE void detail::DocumentSplit::add(int64_t block, const at::Tensor& keys, const at::Tensor& values) {
  COMB_CHECK(!taken_, "splitting documents' K/V: block {} added after the entries were taken", block);
  COMB_CHECK(0 <= block && block < n_blocks_, "splitting documents' K/V: block {} of {}", block, n_blocks_);
  COMB_CHECK(keys.defined() && keys.dim() == 4 && values.defined() && values.sizes() == keys.sizes(),
             "splitting documents' K/V: block {}: keys and values [batch, n_head_kv, n, head_dim], found [{}] and [{}]",
             block, keys.defined() ? fmt::format("{}", fmt::join(keys.sizes(), ", ")) : std::string("undefined"),
             values.defined() ? fmt::format("{}", fmt::join(values.sizes(), ", ")) : std::string("undefined"));
  for (size_t d = 0; d < rows_.size(); ++d) {
    const auto [row, first, len] = rows_[d];
    COMB_CHECK(0 <= row && row < keys.size(0) && 0 < len && 0 <= first && first + len <= keys.size(2),
               "splitting documents' K/V: document {}: batch row {}, positions [{}, {}) of a batch [{}, {}]", d, row,
               first, first + len, keys.size(0), keys.size(2));
  }
  if (on_device(keys, values)) {
    const int64_t n_kv = keys.size(1), hd = keys.size(3);
    if (buffers_.empty())
      for (const auto& r : rows_) buffers_.push_back(at::empty({n_blocks_, 2, n_kv, r[2], hd}, keys.options()));
    cuda_layer_ops()->split_documents(keys, values, rows_, buffers_, block);
    for (size_t d = 0; d < rows_.size(); ++d) {
      const at::Tensor& b = buffers_[d];
      const int64_t len = rows_[d][2], each = n_kv * len * hd;
      const auto part = [&](int64_t i) {
        return b.as_strided({n_kv, len, hd}, {len * hd, hd, 1}, b.storage_offset() + i * each);
      };
      out_[d].keys[block] = part(2 * block);
      out_[d].values[block] = part(2 * block + 1);
    }
    return;
  }
  // K after k_norm (stored so, never recomputed per decode step), V as is: [n_head_kv, n, head_dim],
  // each a tensor of its own (a slice that happens to be contiguous copied too, so that an entry
  // never holds the whole batch's memory).
  const auto own = [](const at::Tensor& t) {
    return t.is_contiguous() && t.storage_offset() == 0 && static_cast<size_t>(t.nbytes()) == t.storage().nbytes()
               ? t
               : t.clone(at::MemoryFormat::Contiguous);
  };
  for (size_t d = 0; d < rows_.size(); ++d) {
    const auto [row, first, len] = rows_[d];
    out_[d].keys[block] = own(keys[row].narrow(1, first, len));
    out_[d].values[block] = own(values[row].narrow(1, first, len));
  }
}

COMB_INLINE std::vector<DocumentKV> detail::DocumentSplit::take() {
  COMB_CHECK(!taken_, "splitting documents' K/V: the entries were taken already");
  for (int64_t k = 0; k < n_blocks_; ++k)  // every add fills every document's block
    COMB_CHECK(out_.empty() || out_[0].keys[k].defined(), "splitting documents' K/V: block {} of {} was never added",
               k, n_blocks_);
  taken_ = true;
  return std::move(out_);
}

COMB_INLINE bool detail::DocumentSplit::on_device(const at::Tensor& keys, const at::Tensor& values) const {
  const CudaLayerOps* ops = cuda_layer_ops();
  if (!ops || !ops->split_documents || at::GradMode::is_enabled() || keys.requires_grad() || values.requires_grad() ||
      !keys.is_cuda() || values.device() != keys.device() || values.scalar_type() != keys.scalar_type() ||
      keys.stride(3) != 1 || values.stride(3) != 1 || (keys.element_size() != 2 && keys.element_size() != 4) ||
      rows_.empty())
    return false;
  if (buffers_.empty()) return true;
  const at::Tensor& b = buffers_[0];
  return b.device() == keys.device() && b.scalar_type() == keys.scalar_type() && b.size(2) == keys.size(1) &&
         b.size(4) == keys.size(3);
}

}  // namespace comb
