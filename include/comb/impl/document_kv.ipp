// DocumentKV's storage forms (int8 with scales, other dtypes, devices) and the Linker (see
// comb/document_kv.hpp). Compiled into libcomb (src/document_kv.cpp), or inline in every
// translation unit that defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>

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

COMB_INLINE bool DocumentKV::keys_per_channel(int64_t n_tokens, int64_t head_dim) {
  return 2 * n_tokens >= head_dim;
}

COMB_INLINE int64_t DocumentKV::storage_bytes(c10::ScalarType dtype, int64_t n_blocks, int64_t n_head_kv,
                                              int64_t head_dim, int64_t n_tokens) {
  const int64_t elements = 2 * n_blocks * n_head_kv * head_dim * n_tokens;
  if (!is_quantized_form(dtype)) return elements * static_cast<int64_t>(c10::elementSize(dtype));
  // int8 or int4 codes and float16 scales: one per value row (one head, one token); keys one per
  // channel over the document's tokens, or per row for documents under head_dim / 2 tokens.
  const int64_t key_scales = keys_per_channel(n_tokens, head_dim) ? head_dim : n_tokens;
  const int64_t codes = dtype == at::kChar ? elements : dtype == kCacheInt4 ? elements / 2 : elements * 3 / 4;
  return codes + 2 * n_blocks * n_head_kv * (key_scales + n_tokens);
}

namespace detail::document_kv {  // this file's own helpers
// A scale from the largest magnitude it covers: amax / levels (127 for int8, 7 for int4; 1 where
// all are 0), at least 2^-14 (the smallest normal float16), kept in float16; the codes are computed
// with that float16 value.
COMB_INLINE at::Half int8_scale(float amax, float levels = 127.0f) {
  const float s = amax / levels;
  return at::Half(s > 0 ? std::max(s, 6.103515625e-05f) : 1.0f);
}

// NOTE: the tensor-op quantization below runs about ten ops per K and per V of every block; a cold
// request converts each new document's 28 blocks one at a time, so on short documents the ops'
// overhead outweighs the work. One pass each here, with the same arithmetic (the float16 scale,
// float32 division by it, round half to even, clamp), so the codes and scales are those of the
// tensor ops. Codes in [-key_levels, key_levels] and [-value_levels, value_levels] (127: int8; 7: the
// codes of int4, packed after).
COMB_INLINE std::array<at::Tensor, 4> quantize_int8_cpu(const at::Tensor& k, const at::Tensor& v,
                                                        float key_levels = 127.0f, float value_levels = 127.0f) {
  const int64_t heads = k.size(0), n = k.size(1), d = k.size(2);
  const bool per_channel = DocumentKV::keys_per_channel(n, d);
  at::Tensor kq = at::empty({heads, n, d}, at::kChar), vq = at::empty({heads, n, d}, at::kChar);
  at::Tensor ks = per_channel ? at::empty({heads, 1, d}, at::kHalf) : at::empty({heads, n, 1}, at::kHalf);
  at::Tensor vs = at::empty({heads, n, 1}, at::kHalf);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  int8_t* kqp = kq.data_ptr<int8_t>();
  int8_t* vqp = vq.data_ptr<int8_t>();
  at::Half* ksp = ks.data_ptr<at::Half>();
  at::Half* vsp = vs.data_ptr<at::Half>();
  auto code = [](float x, float scale, float levels) {
    const float q = std::nearbyint(x / scale);
    return static_cast<int8_t>(std::min(levels, std::max(-levels, q)));
  };
  auto row = [&](const float* x, int8_t* q, at::Half* scale, float levels) {  // one head, one token
    float m = 0.0f;
    for (int64_t j = 0; j < d; ++j) m = std::max(m, std::fabs(x[j]));
    *scale = int8_scale(m, levels);
    const float s = static_cast<float>(*scale);
    for (int64_t j = 0; j < d; ++j) q[j] = code(x[j], s, levels);
  };
  for (int64_t r = 0; r < heads * n; ++r) row(vp + r * d, vqp + r * d, vsp + r, value_levels);
  if (!per_channel) {
    for (int64_t r = 0; r < heads * n; ++r) row(kp + r * d, kqp + r * d, ksp + r, key_levels);
    return {kq, ks, vq, vs};
  }
  std::vector<float> m(d), scale(d);
  for (int64_t h = 0; h < heads; ++h) {  // keys: a scale per channel over the tokens
    std::fill(m.begin(), m.end(), 0.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j) m[j] = std::max(m[j], std::fabs(kp[(h * n + t) * d + j]));
    for (int64_t j = 0; j < d; ++j) {
      ksp[h * d + j] = int8_scale(m[j], key_levels);
      scale[j] = static_cast<float>(ksp[h * d + j]);
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j) kqp[(h * n + t) * d + j] = code(kp[(h * n + t) * d + j], scale[j], key_levels);
  }
  return {kq, ks, vq, vs};
}
}  // namespace detail::document_kv

COMB_INLINE at::Tensor unpack_int4(const at::Tensor& packed) {
  COMB_CHECK(packed.scalar_type() == at::kByte && packed.dim() >= 1,
             "int4 codes: expected uint8 bytes holding two codes each, found {} of {} dimensions",
             c10::toString(packed.scalar_type()), packed.dim());
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

COMB_INLINE DocumentKV DocumentKV::int8_codes() const {
  DocumentKV out = *this;
  for (auto* list : {&out.keys, &out.values})
    for (auto& t : *list) t = as_int8_codes(t);
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
        keys[b][d] = as_int8_codes(keys[b][d]).to(at::kFloat) * key_scales[b][d];
        values[b][d] = as_int8_codes(values[b][d]).to(at::kFloat) * value_scales[b][d];
      }
  }
}

COMB_INLINE DocumentKV DocumentKV::to(c10::Device device, c10::ScalarType dtype) const {
  DocumentKV out;
  out.n_tokens = n_tokens;
  const c10::ScalarType from = keys.empty() || values.empty() ? c10::ScalarType::Undefined : this->dtype();
  // int4 parts are read as their int8 codes; to int8 those are the codes, moved.
  if (packs_int4(from) && from != dtype) return int8_codes().to(device, dtype);
  const bool from_int8 = quantized();
  const bool to_codes = is_quantized_form(dtype);
  const float key_levels = dtype == kCacheInt4 ? 7.0f : 127.0f, value_levels = packs_int4(dtype) ? 7.0f : 127.0f;
  for (size_t b = 0; b < keys.size(); ++b) {
    at::Tensor k = keys[b].to(device), v = values[b].to(device);
    if (from_int8 && dtype == from) {  // already in this form: the same codes and scales, moved
      out.keys.push_back(k.contiguous());
      out.values.push_back(v.contiguous());
      out.key_scales.push_back(key_scales.at(b).to(device).contiguous());
      out.value_scales.push_back(value_scales.at(b).to(device).contiguous());
      continue;
    }
    if (from_int8) {  // back to float32 first
      k = k.to(at::kFloat) * key_scales.at(b).to(device);
      v = v.to(at::kFloat) * value_scales.at(b).to(device);
    }
    if (to_codes) {
      COMB_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && (!packs_int4(dtype) || k.size(2) % 2 == 0),
                 "quantizing a document cache to {}: block {} has keys [{}] and values [{}]; expected equal "
                 "[n_head_kv, n_tokens, head_dim]{}",
                 cache_dtype_name(dtype), b, fmt::join(k.sizes(), ", "), fmt::join(v.sizes(), ", "),
                 packs_int4(dtype) ? " with an even head_dim" : "");
      at::Tensor kq, ks, vq, vs;
      if (k.device().is_cpu() && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat) {
        auto q = detail::document_kv::quantize_int8_cpu(k.contiguous(), v.contiguous(), key_levels, value_levels);
        kq = q[0], ks = q[1], vq = q[2], vs = q[3];
      } else {
        k = k.to(at::kFloat);
        v = v.to(at::kFloat);
        // As quantize_int8_cpu: float16 scales of amax / levels (at least 2^-14; 1 for all zeros).
        // The divisor a tensor: ATen divides a CUDA tensor by a scalar as a product with its
        // reciprocal, which can differ in the last place from the CPU's quotient.
        auto scales = [](const at::Tensor& amax, float levels) {
          at::Tensor s = amax / at::full({}, levels, amax.options());
          return at::where(s > 0, s.clamp_min(6.103515625e-05), at::ones_like(s)).to(at::kHalf);
        };
        const bool per_channel = keys_per_channel(k.size(1), k.size(2));
        ks = scales(k.abs().amax(per_channel ? 1 : 2, /*keepdim=*/true), key_levels).contiguous();
        vs = scales(v.abs().amax(2, true), value_levels).contiguous();
        kq = (k / ks.to(at::kFloat)).round().clamp(-key_levels, key_levels).to(at::kChar).contiguous();
        vq = (v / vs.to(at::kFloat)).round().clamp(-value_levels, value_levels).to(at::kChar).contiguous();
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

}  // namespace comb
