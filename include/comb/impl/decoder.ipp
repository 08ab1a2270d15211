// comb::Decoder: the Llama forward pass (generic ATen path, fused fp32 CPU path for decode), the oneDNN-packed prefill, placing cached K/V.
// Compiled into libcomb (src/decoder.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include "comb/detail/cpu_kernels.hpp"
#include "comb/detail/decode_step.hpp"
#include "comb/decoder.hpp"
#include "comb/error.hpp"
#include "comb/weights.hpp"

// LibTorch exports this (its ahead-of-time compiler uses it) but ships no header for it; weak, so
// that a LibTorch without it simply leaves prefill on the BLAS path.
namespace at::native {
__attribute__((weak)) void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
}

namespace comb {

namespace detail::decoder {
template <typename I>
at::Tensor upload_ints(const std::vector<I>& values, c10::ScalarType type, c10::Device device) {
  COMB_CHECK(type == at::kLong || type == at::kInt, "upload_ints: int64 or int32 asked, found {}",
             c10::toString(type));
  if constexpr (sizeof(I) > sizeof(int32_t))
    if (type == at::kInt)
      for (I v : values)
        COMB_CHECK(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                   "upload_ints: {} does not fit int32", v);
  if (!device.is_cuda()) return at::tensor(values, c10::CppTypeToScalarType<I>::value).to(device, type);
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(type).pinned_memory(true));
  if (type == at::kLong)
    std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  else
    std::copy(values.begin(), values.end(), host.data_ptr<int32_t>());
  return host.to(host.options().device(device).pinned_memory(false), /*non_blocking=*/true);
}

// A tensor of integers (tokens, positions) as int64 on `device`, through detail::upload: a copy
// from pageable memory would wait for every launch queued before it (a cold request's prompt for
// its documents' encoder).
COMB_INLINE at::Tensor ints_on(const at::Tensor& t, c10::Device device) {
  return detail::upload(t.to(at::kLong), device);
}
}  // namespace detail::decoder

COMB_INLINE at::Tensor detail::upload_ints(const std::vector<int64_t>& values, c10::ScalarType type,
                                           c10::Device device) {
  return decoder::upload_ints(values, type, device);
}
COMB_INLINE at::Tensor detail::upload_ints(const std::vector<int32_t>& values, c10::ScalarType type,
                                           c10::Device device) {
  return decoder::upload_ints(values, type, device);
}

COMB_INLINE Decoder::Decoder(ModelConfig config, LlamaWeights weights, c10::ScalarType dtype, c10::Device device)
    : config_(std::move(config)), weights_(std::move(weights)), dtype_(dtype), device_(device) {
  std::tie(rope_cos_, rope_sin_) = rope_tables(config_, weights_.rope_freqs, config_.n_ctx, dtype_, device_);
  if (device_.is_cpu() && dtype_ == at::kFloat) prepack_onednn();
  cuda_paged_graphs_ = detail::env_on("COMB_CUDA_PAGED_GRAPHS");
}

// NOTE: oneDNN's fp32 GEMM beats the BLAS library's on the prefill shapes (by 15-30% on the
// development machine), but wants its own tensors. Each weight is moved into a plain-layout oneDNN
// tensor and the dense weight becomes a view of that memory: one copy of the weights, two kernels.
COMB_INLINE void Decoder::prepack_onednn() {
  if (!at::hasMKLDNN() || !at::native::data_ptr_from_mkldnn || weights_.quantized()) return;
  std::vector<std::array<at::Tensor, 4>> packed(config_.n_layer);
  std::vector<std::array<at::Tensor, 4>> views(config_.n_layer);
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    auto& l = weights_.layers[i];
    std::array<at::Tensor*, 4> dense{&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down};
    for (int k = 0; k < 4; ++k) {
      at::Tensor w = dense[k]->contiguous();
      at::Tensor m = w.to_mkldnn();
      void* data = at::native::data_ptr_from_mkldnn(m);
      if (!data) return;
      at::Tensor view = at::from_blob(data, w.sizes(), [m](void*) {}, w.options());
      if (!view.equal(w)) return;  // not the plain layout we expect: keep the BLAS path
      packed[i][k] = m;
      views[i][k] = view;
    }
  }
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    auto& l = weights_.layers[i];
    l.wqkv = views[i][0], l.wo = views[i][1], l.w_gate_up = views[i][2], l.w_down = views[i][3];
  }
  onednn_ = std::move(packed);
}

COMB_INLINE KVCache Decoder::make_cache(int64_t batch, int64_t capacity) const {
  return KVCache(config_, batch, capacity, dtype_, device_);
}

COMB_INLINE void Decoder::place(int64_t layer, KVCache& cache, int64_t pos, const at::Tensor& k, const at::Tensor& v) const {
  const auto& c = config_;
  COMB_CHECK(layer >= 0 && layer < cache.n_layers(), "place: layer {} outside [0, {})", layer, cache.n_layers());
  COMB_CHECK(k.dim() == 4 && k.size(0) == cache.batch() && k.size(1) == c.n_head_kv && k.size(3) == c.head_dim &&
                 v.sizes() == k.sizes(),
             "place: expected k, v [{}, {}, n, {}], found k [{}] and v [{}]", cache.batch(), c.n_head_kv, c.head_dim,
             fmt::join(k.sizes(), ", "), fmt::join(v.sizes(), ", "));
  const int64_t n = k.size(2);
  COMB_CHECK(pos >= 0 && pos + n <= cache.capacity(), "place: positions [{}, {}) outside the cache's capacity {}", pos,
             pos + n, cache.capacity());
  COMB_CHECK(pos + n <= rope_cos_.size(0), "place: positions [{}, {}) past the model's context of {} tokens", pos,
             pos + n, rope_cos_.size(0));
  const at::Tensor& k_cache = cache.keys(layer);
  const at::Tensor& v_cache = cache.values(layer);
  COMB_CHECK(k_cache.size(1) == c.n_head_kv && k_cache.size(3) == c.head_dim,
             "place: the cache holds [{}] per layer, this decoder needs {} KV heads of size {}",
             fmt::join(k_cache.sizes(), ", "), c.n_head_kv, c.head_dim);
  if (pos == 0) return cache.write(layer, 0, k, v);
  // The fused kernel reads k, v while it writes the cache: only for inputs in other storage than
  // the cache's (rows of the cache itself go through the generic path, which works on copies).
  const auto apart = [](const at::Tensor& a, const at::Tensor& b) { return !a.is_alias_of(b); };
  const bool in_place = cpu_kernels() && k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() &&
                        k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                        k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                        k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1 &&
                        apart(k, k_cache) && apart(v, v_cache);
  if (k.device() == device_ && k.scalar_type() == dtype_ && v.scalar_type() == dtype_ && k.stride(3) == 1 &&
      apart(k, k_cache) && cuda_kernels_apply(cache)) {
    // One kernel rotates the keys into the cache (the ATen rotation: five launches and temporaries).
    detail::cuda_layer_ops()->place_keys(k, rope_cos_, rope_sin_, k_cache, pos);
    v_cache.narrow(2, pos, n).copy_(apart(v, v_cache) ? v : v.clone());
    return;
  }
  if (!in_place) {
    // apply_rope returns a new tensor; v is copied first if it shares storage with the cache.
    return cache.write(layer, pos, apply_rope(k, rope_cos_.narrow(0, pos, 1), rope_sin_.narrow(0, pos, 1)),
                       apart(v, v_cache) ? v : v.clone());
  }
  // NOTE: straight into the cache, one pass per head: the ATen rotation makes five temporaries of
  // each document's keys per layer before the copy.
  const int64_t hd = c.head_dim, cap = cache.capacity();
  const float* cos = rope_cos_.data_ptr<float>() + pos * hd;
  const float* sin = rope_sin_.data_ptr<float>() + pos * hd;
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  float* k_dst = k_cache.data_ptr<float>();
  float* v_dst = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < k.size(0); ++b) {
    for (int64_t h = 0; h < c.n_head_kv; ++h) {
      const int64_t at = ((b * c.n_head_kv + h) * cap + pos) * hd;
      detail::cpu::rotate_rows(k_src + b * k.stride(0) + h * k.stride(1), k.stride(2), cos, sin, hd, n, k_dst + at, hd);
      const float* vr = v_src + b * v.stride(0) + h * v.stride(1);
      for (int64_t i = 0; i < n; ++i) std::copy(vr + i * v.stride(2), vr + i * v.stride(2) + hd, v_dst + at + i * hd);
    }
  }
}

COMB_INLINE at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  // Half precision: normalise in fp32, scale in the compute dtype (as the reference does).
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * xf.to(x.scalar_type());
}

COMB_INLINE at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

COMB_INLINE std::array<at::Tensor, 3> split_qkv(const at::Tensor& qkv, const ModelConfig& c) {
  const int64_t batch = qkv.size(0), n = qkv.size(1);
  auto heads = [&](int64_t offset, int64_t n_heads) {
    return qkv.narrow(-1, offset, n_heads * c.head_dim).view({batch, n, n_heads, c.head_dim}).transpose(1, 2);
  };
  return {heads(0, c.n_head), heads(c.q_dim(), c.n_head_kv), heads(c.q_dim() + c.kv_dim(), c.n_head_kv)};
}

COMB_INLINE at::Tensor swiglu_mlp(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down) {
  auto parts = at::linear(x, w_gate_up).chunk(2, -1);
  return at::linear(at::silu(parts[0]) * parts[1], w_down);
}

COMB_INLINE at::Tensor swiglu_mlp(const at::Tensor& x, const LayerWeights& l) {
  if (!l.quantized) return swiglu_mlp(x, l.w_gate_up, l.w_down);
  auto parts = project(l, Proj::gate_up, x).chunk(2, -1);
  return project(l, Proj::down, at::silu(parts[0]) * parts[1]);
}

namespace detail::decoder {  // this file's own helpers
COMB_INLINE std::pair<at::Tensor, at::Tensor> attend_after_cache_lse(const at::Tensor& q, const at::Tensor& keys,
                                                          const at::Tensor& values, int64_t start);
}  // namespace detail::decoder

COMB_INLINE bool merged_attention_applies(const JointKV& joint) {
  return !at::GradMode::is_enabled() && !joint.valid.defined() && joint.keys.device().is_cpu() &&
         joint.keys.scalar_type() == at::kFloat && joint.values.scalar_type() == at::kFloat;
}

// NOTE: the written-out joint_attention scores the queries against a copy of every joined and
// cached key with a full mask in each layer (on nq's 1,200 document tokens, most of a warm
// request's attention time); here the fused kernel attends to each part without a mask.
COMB_INLINE at::Tensor joint_attention_merged(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  int64_t start, const JointKV& joint) {
  RECORD_FUNCTION("comb::joint_attention_merged", std::vector<c10::IValue>());
  const int64_t batch = q.size(0), n_head = q.size(1), n = q.size(2), head_dim = q.size(3);
  const int64_t n_kv = keys.size(1), m = joint.keys.size(2), groups = n_head / n_kv;
  COMB_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && !joint.valid.defined(),
             "joint_attention_merged: CPU float32 queries and joined keys without padding");
  auto [own, own_lse] = detail::decoder::attend_after_cache_lse(q, keys, values, start);
  if (m == 0 || joint.anchor >= start + n) return own;  // no row reads the documents
  // Positions before the anchor (the instruction prefix, computed in the same call on a cold
  // request) read no document: only rows [first, n) attend to them.
  const int64_t first = std::max<int64_t>(0, joint.anchor - start), rows = n - first;
  const at::Tensor qd = first > 0 ? q.narrow(2, first, rows) : q;
  // The query heads that share a KV head are folded into its rows: row g * rows + i of KV head h
  // is query head h * groups + g at row i, so [batch, n_kv, groups, rows] reads as [batch, n_head, rows].
  auto [docs, docs_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      qd.reshape({batch, n_kv, groups * rows, head_dim}), joint.keys, joint.values);
  docs = docs.reshape({batch, n_head, rows, head_dim});
  docs_lse = docs_lse.reshape({batch, n_head, rows});
  if (joint.bias.defined()) docs_lse = docs_lse + joint.bias.to(at::kFloat).view({1, n_head, 1});
  const at::Tensor own_part = first > 0 ? own.narrow(2, first, rows) : own;
  const at::Tensor own_part_lse = first > 0 ? own_lse.narrow(2, first, rows) : own_lse;
  at::Tensor lse = at::logaddexp(own_part_lse, docs_lse);
  at::Tensor merged = own_part * (own_part_lse - lse).exp().unsqueeze(-1) + docs * (docs_lse - lse).exp().unsqueeze(-1);
  if (first == 0) return merged;
  own.narrow(2, first, rows).copy_(merged);
  return own;
}

COMB_INLINE at::Tensor joint_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            int64_t start, const JointKV& joint) {
  RECORD_FUNCTION("comb::joint_attention_rows", std::vector<c10::IValue>());
  const int64_t batch = q.size(0), n = q.size(1), n_head = q.size(2), head_dim = q.size(3);
  const int64_t n_kv = k_cache.size(1), capacity = k_cache.size(2), m = joint.keys.size(2);
  COMB_CHECK(q.is_contiguous() && q.device().is_cpu() && q.scalar_type() == at::kFloat && merged_attention_applies(joint),
             "joint_attention_rows: contiguous CPU float32 queries and joined keys without padding");
  COMB_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                 k_cache.dim() == 4 && k_cache.size(0) == batch && k_cache.size(3) == head_dim && start + n <= capacity,
             "joint_attention_rows: a cache [{}] for {} sequences of {} positions after {}", fmt::join(k_cache.sizes(), ", "),
             batch, n, start);
  COMB_CHECK(joint.keys.dim() == 4 && joint.keys.size(0) == batch && joint.keys.size(1) == n_kv &&
                 joint.keys.size(3) == head_dim && joint.values.sizes() == joint.keys.sizes(),
             "joint_attention_rows: joined keys [{}] and values [{}] should be [{}, {}, m, {}]",
             fmt::join(joint.keys.sizes(), ", "), fmt::join(joint.values.sizes(), ", "), batch, n_kv, head_dim);
  const at::Tensor jk = joint.keys.contiguous(), jv = joint.values.contiguous();
  const at::Tensor bias = joint.bias.defined() ? joint.bias.to(at::kFloat).contiguous() : at::Tensor();
  COMB_CHECK(!bias.defined() || bias.numel() == n_head, "joint_attention_rows: a bias of {} for {} heads",
             bias.numel(), n_head);
  at::Tensor out = at::empty({batch, n, n_head * head_dim}, q.options());
  // The cache read as a pool of one block per sequence: block b is sequence b's whole capacity.
  const detail::cpu::PagedShape shape{n_head, n_kv, head_dim, capacity};
  const int64_t group = n_head / n_kv;
  at::parallel_for(0, batch * n * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * (m + start + n));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / n_kv, kvh = item % n_kv, b = t / n, i = t % n;
      const int32_t table[1] = {static_cast<int32_t>(b)};
      // Rows before the anchor (the instruction prefix) read no document.
      const bool reads = start + i >= joint.anchor && m > 0;
      const float* seg_k = jk.data_ptr<float>() + b * n_kv * m * head_dim;
      const float* seg_v = jv.data_ptr<float>() + b * n_kv * m * head_dim;
      const int64_t seg_n = m;
      const float* qr = q.data_ptr<float>() + t * n_head * head_dim;
      float* o = out.data_ptr<float>() + t * n_head * head_dim;
      const float* b_ptr = reads && bias.defined() ? bias.data_ptr<float>() : nullptr;
      if (!detail::cpu::paged_attention_grouped(qr, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table,
                                                start + i + 1, &seg_k, &seg_v, &seg_n, reads ? 1 : 0, b_ptr, shape, o,
                                                scratch.data(), kvh))
        detail::cpu::paged_attention(qr, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table, start + i + 1,
                                     &seg_k, &seg_v, &seg_n, reads ? 1 : 0, b_ptr, shape, o, scratch.data(),
                                     kvh * group, (kvh + 1) * group);
    }
  });
  return out;
}

COMB_INLINE at::Tensor joint_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                           const JointKV& joint) {
  const int64_t batch = q.size(0), n_head = q.size(1), n = q.size(2), head_dim = q.size(3);
  const int64_t n_kv = keys.size(1), m = joint.keys.size(2), n_self = keys.size(2);
  COMB_CHECK(n_self == start + n, "joint attention: {} context keys for {} cached and {} new positions", n_self, start, n);
  COMB_CHECK(joint.keys.dim() == 4 && joint.keys.size(0) == batch && joint.keys.size(1) == n_kv &&
                 joint.keys.size(3) == head_dim && joint.values.sizes() == joint.keys.sizes(),
             "joint attention: keys [{}] and values [{}] should be [{}, {}, m, {}]", fmt::join(joint.keys.sizes(), ", "),
             fmt::join(joint.values.sizes(), ", "), batch, n_kv, head_dim);
  if (q.device().is_cpu() && q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
      merged_attention_applies(joint))
    return joint_attention_merged(q, keys, values, start, joint);
  const auto dt = q.scalar_type();
  const auto opts = q.options();
  // One float mask: the joined keys' bias (or -inf where not valid), then the causal mask of the
  // context.
  const auto fopts = opts.dtype(at::kFloat);
  at::Tensor joined = joint.bias.defined()
                          ? joint.bias.to(at::kFloat).view({1, n_head, 1, 1}).expand({batch, n_head, n, m})
                          : at::zeros({batch, 1, n, m}, fopts);
  if (joint.valid.defined())
    joined = joined.masked_fill(joint.valid.logical_not().view({batch, 1, 1, m}), -INFINITY);
  if (joint.anchor > start)  // positions before the anchor (the instruction prefix) read no document
    joined = joined.masked_fill((at::arange(start, start + n, opts.dtype(at::kLong)) < joint.anchor).view({1, 1, n, 1}),
                                -INFINITY);
  at::Tensor seen = visible_keys(at::arange(start, start + n, opts.dtype(at::kLong)), n_self);  // [n, n_self]
  at::Tensor own = at::zeros({n, n_self}, fopts).masked_fill(seen.logical_not(), -INFINITY);
  // The query heads that share a KV head are folded into rows of that head, so that the joined
  // and cached K/V are read as they lie (not repeated per group): q [batch, n_kv, groups * n, d].
  const int64_t groups = n_head / n_kv;
  // Row g * n + i of KV head h is query head h * groups + g at position i.
  joined = joined.size(1) == n_head ? joined.reshape({batch, n_kv, groups * n, m})  // a bias per query head
                                    : joined.repeat({1, 1, groups, 1});
  at::Tensor mask = at::cat({joined,
                             own.repeat({groups, 1}).view({1, 1, groups * n, n_self})
                                 .expand({batch, joined.size(1), groups * n, n_self})},
                            -1);
  at::Tensor k = at::cat({joint.keys.to(dt), keys}, 2), v = at::cat({joint.values.to(dt), values}, 2);
  // Written out (not a fused kernel): a mask that needs its gradient (the bias) is not taken by all.
  at::Tensor scores = at::matmul(q.reshape({batch, n_kv, groups * n, head_dim}), k.transpose(-1, -2)).to(at::kFloat) *
                          (1.0 / std::sqrt(double(head_dim))) +
                      mask;
  return at::matmul(at::softmax(scores, -1).to(dt), v).view({batch, n_head, n, head_dim});
}

namespace detail::decoder {  // this file's own helpers
// How a layer's norms, matrices and activation are computed; its attention is the caller's.
struct LayerMath {
  std::function<at::Tensor(const at::Tensor& t, const at::Tensor& weight)> norm;
  std::function<at::Tensor(const at::Tensor& t, Proj p)> linear;
  std::function<at::Tensor(const at::Tensor& gate_up)> act;  // [.., 2 n_ff] -> [.., n_ff]
};

// The one Llama layer every path runs: RMSNorm, the fused QKV projection, `attend` (from qkv [..,
// q_dim + 2 kv_dim] to the heads' output [.., q_dim]: RoPE, K/V stored, attention), the output
// projection and residual, RMSNorm, SwiGLU and residual. The paths differ in `math` (generic ATen
// ops and differentiable; fused CPU kernels; row-wise kernels) and in `attend` (no cache, a cache,
// explicit positions, several caches, a block pool).
COMB_INLINE at::Tensor layer_body(const at::Tensor& x, const LayerWeights& l, const LayerMath& math,
                                  const std::function<at::Tensor(const at::Tensor& qkv)>& attend) {
  at::Tensor h = x + math.linear(attend(math.linear(math.norm(x, l.attn_norm), Proj::qkv)), Proj::o);
  return h + math.linear(math.act(math.linear(math.norm(h, l.ffn_norm), Proj::gate_up)), Proj::down);
}

// Generic ATen ops (any device and dtype, differentiable).
COMB_INLINE LayerMath generic_math(const LayerWeights& l, const ModelConfig& c) {
  return {[eps = c.rms_eps](const at::Tensor& t, const at::Tensor& w) { return comb::rms_norm(t, w, eps); },
          [&l](const at::Tensor& t, Proj p) { return project(l, p, t); },
          [](const at::Tensor& gate_up) {
            auto parts = gate_up.chunk(2, -1);
            return at::silu(parts[0]) * parts[1];
          }};
}

// generic_math with the CUDA row-wise kernels for the norms and the activation (a CUDA
// bfloat16/float16 layer: layer_cuda, layer_packed).
COMB_INLINE LayerMath cuda_math(const LayerWeights& l, const ModelConfig& c, const CudaLayerOps& ops) {
  LayerMath math = generic_math(l, c);
  math.norm = [&ops, n_embd = c.n_embd, eps = c.rms_eps](const at::Tensor& t, const at::Tensor& weight) {
    return ops.add_rms_norm(t.contiguous().view({-1, n_embd}), at::Tensor(), weight, eps).view(t.sizes());
  };
  math.act = [&ops](const at::Tensor& gate_up) { return ops.silu_mul(gate_up.contiguous()); };
  return math;
}
}  // namespace detail::decoder

COMB_INLINE at::Tensor llama_layer(const at::Tensor& x, const LayerWeights& l, const ModelConfig& c, const at::Tensor& cos,
                       const at::Tensor& sin, bool causal, const at::Tensor& mask, const JointKV* joint) {
  const int64_t batch = x.size(0), n = x.size(1);
  COMB_CHECK(!joint || (causal && !mask.defined()), "a layer reads joined keys only when causal and unmasked");
  return detail::decoder::layer_body(x, l, detail::decoder::generic_math(l, c), [&](const at::Tensor& qkv) {
    auto [q, k, v] = split_qkv(qkv, c);
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
    at::Tensor attn =
        joint ? joint_attention(q, k, v, 0, *joint)
              : at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                                 0.0, causal, std::nullopt, /*enable_gqa=*/true);
    return attn.transpose(1, 2).reshape({batch, n, c.q_dim()});
  });
}

COMB_INLINE at::Tensor token_ids(const std::vector<int32_t>& tokens, int64_t begin, int64_t end) {
  COMB_CHECK(0 <= begin && begin <= end && end <= static_cast<int64_t>(tokens.size()),
             "token_ids: tokens [{}, {}) of {}", begin, end, tokens.size());
  return at::tensor(std::vector<int64_t>(tokens.begin() + begin, tokens.begin() + end), at::kLong).unsqueeze(0);
}

COMB_INLINE at::Tensor visible_keys(const at::Tensor& positions, int64_t n_keys) {
  return at::arange(n_keys, positions.options().dtype(at::kLong)).unsqueeze(0) <= positions.unsqueeze(1);
}

namespace detail::decoder {  // this file's own helpers
// Attention of n new queries q [batch, n_head, n, head_dim] that follow `start` cached positions:
// query j sees keys [0, start + j] of keys, values [batch, n_head_kv, start + n, head_dim] (grouped).
COMB_INLINE at::Tensor attend_after_cache(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start) {
  const int64_t n = q.size(2);
  COMB_CHECK(keys.size(2) == start + n, "attention after a cache: {} keys for {} cached and {} new positions",
             keys.size(2), start, n);
  if (!q.device().is_cpu() || start == 0) {
    std::optional<at::Tensor> mask;
    if (start > 0) mask = visible_keys(at::arange(start, start + n, at::TensorOptions().device(q.device())), start + n);
    return at::scaled_dot_product_attention(q, keys, values, mask, 0.0, start == 0 && n > 1, std::nullopt, true);
  }
  return attend_after_cache_lse(q, keys, values, start).first;
}

// attend_after_cache on CPU with each row's log-sum-exp of scores [batch, n_head, n] (float32),
// so that another part of the softmax can be merged in (joint_attention's documents).
COMB_INLINE std::pair<at::Tensor, at::Tensor> attend_after_cache_lse(const at::Tensor& q, const at::Tensor& keys,
                                                          const at::Tensor& values, int64_t start) {
  const int64_t n = q.size(2), groups = q.size(1) / keys.size(1);
  if (start == 0) {
    at::Tensor k = keys, v = values;
    if (groups > 1) {
      k = k.repeat_interleave(groups, 1);
      v = v.repeat_interleave(groups, 1);
    }
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
    return {out, lse};
  }
  // NOTE: one masked call would score every query against every key (the CPU kernel skips no
  // masked block): 61.6 against 36.8 ms a layer for 1,227 rows after 60 (docs/benchmarks.md).
  // Instead: the cached keys without a mask, the chunk's own keys causally, and the two partial
  // results merged by their log-sum-exp, which is exact. The cached part needs no mask, so the
  // query heads that share a KV head are folded into rows of that head ([batch, n_head_kv,
  // groups * n, head_dim]) and the cached K/V are read as they lie; only the chunk's own K/V are
  // repeated per group for the causal call.
  const int64_t batch = q.size(0), n_head = q.size(1), head_dim = q.size(3), n_kv = keys.size(1);
  auto [old_out, old_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q.reshape({batch, n_kv, groups * n, head_dim}), keys.narrow(2, 0, start), values.narrow(2, 0, start));
  old_out = old_out.reshape({batch, n_head, n, head_dim});
  old_lse = old_lse.reshape({batch, n_head, n});
  at::Tensor k = keys.narrow(2, start, n), v = values.narrow(2, start, n);
  if (groups > 1) {
    k = k.repeat_interleave(groups, 1);
    v = v.repeat_interleave(groups, 1);
  }
  auto [new_out, new_lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
  at::Tensor lse = at::logaddexp(old_lse, new_lse);
  return {(old_out * (old_lse - lse).exp().unsqueeze(-1) + new_out * (new_lse - lse).exp().unsqueeze(-1))
              .to(q.scalar_type()),
          lse};
}

// Rows q [1, n_head, m, head_dim] at `pos` (int64 [m], on q's device): row j sees keys [0, pos[j]]
// of keys, values [1, n_head_kv, n_keys, head_dim] (grouped).
COMB_INLINE at::Tensor attend_at_positions(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& pos) {
  constexpr int64_t kRowsPerCall = 64;
  const int64_t m = q.size(2), n_keys = keys.size(2);
  if (!q.device().is_cpu() || m <= kRowsPerCall)
    return at::scaled_dot_product_attention(q, keys, values, visible_keys(pos, n_keys), 0.0, false, std::nullopt, true);
  // NOTE: the CPU kernel scores every key of a masked call, so rows scattered over a long cache
  // (CacheBlend's chosen tokens, EPIC's document heads) would each score all n_keys. In groups of
  // rows, a call scores only the keys up to its group's last position: about half the work when
  // the rows spread evenly.
  const at::Tensor p = pos.contiguous();
  const int64_t* at_p = p.data_ptr<int64_t>();
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < m; r += kRowsPerCall) {
    const int64_t rows = std::min(kRowsPerCall, m - r);
    const int64_t seen = std::min(n_keys, *std::max_element(at_p + r, at_p + r + rows) + 1);
    parts.push_back(at::scaled_dot_product_attention(q.narrow(2, r, rows), keys.narrow(2, 0, seen),
                                                     values.narrow(2, 0, seen), visible_keys(p.narrow(0, r, rows), seen),
                                                     0.0, false, std::nullopt, true));
  }
  return at::cat(parts, 2);
}
}  // namespace detail::decoder

COMB_INLINE at::Tensor Decoder::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  return comb::rms_norm(x, weight, config_.rms_eps);
}

COMB_INLINE at::Tensor Decoder::attention(int64_t i, const at::Tensor& qkv, KVCache& cache, const JointKV* joint) const {
  const auto& c = config_;
  const int64_t batch = qkv.size(0), n = qkv.size(1), start = cache.length();
  auto [q, k, v] = split_qkv(qkv, c);
  at::Tensor cos = rope_cos_.narrow(0, start, n), sin = rope_sin_.narrow(0, start, n);
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  auto [keys, values] = cache.append(i, k, v);  // [batch, n_head_kv, start + n, head_dim]
  at::Tensor out;
  if (joint) {
    out = joint_attention(q, keys, values, start, *joint);
  } else if (n == 1) {
    out = at::scaled_dot_product_attention(q, keys, values, {}, 0.0, false, std::nullopt, /*enable_gqa=*/true);
  } else {  // query j sees keys [0, start + j]
    out = detail::decoder::attend_after_cache(q, keys, values, start);
  }
  return out.transpose(1, 2).reshape({batch, n, c.q_dim()});
}

COMB_INLINE at::Tensor Decoder::keys_at(int64_t i, const at::Tensor& x, const at::Tensor& positions) const {
  const auto& c = config_;
  at::Tensor k = split_qkv(project(weights_.layers[i], Proj::qkv, rms_norm(x, weights_.layers[i].attn_norm)), c)[1];
  at::Tensor pos = detail::decoder::ints_on(positions, device_);
  return apply_rope(k, rope_cos_.index_select(0, pos), rope_sin_.index_select(0, pos));
}

COMB_INLINE at::Tensor Decoder::layer_at(int64_t i, const at::Tensor& x, const at::Tensor& positions, KVCache& cache,
                             int64_t n_keys) const {
  const auto& c = config_;
  const auto& w = weights_.layers[i];
  const int64_t m = x.size(1);
  COMB_CHECK(x.size(0) == 1 && positions.numel() == m, "layer_at takes one sequence: x [1, {}], {} positions", m,
             positions.numel());
  COMB_CHECK(n_keys <= cache.capacity(), "layer_at: {} keys past the cache capacity {}", n_keys, cache.capacity());
  at::Tensor pos = detail::decoder::ints_on(positions, device_);
  return detail::decoder::layer_body(x, w, detail::decoder::generic_math(w, c), [&](const at::Tensor& qkv) {
    auto [q, k, v] = split_qkv(qkv, c);
    at::Tensor cos = rope_cos_.index_select(0, pos), sin = rope_sin_.index_select(0, pos);
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
    cache.keys(i).index_copy_(2, pos, k.to(cache.keys(i).scalar_type()));
    cache.values(i).index_copy_(2, pos, v.to(cache.values(i).scalar_type()));
    at::Tensor keys = cache.keys(i).narrow(2, 0, n_keys), values = cache.values(i).narrow(2, 0, n_keys);
    // Rows that are the last m of the n_keys positions, in order (CacheBlend's pass below its check
    // layer, EPIC when it recomputes a whole tail), are a prefill after `start` cached positions.
    const int64_t start = n_keys - m;
    const at::Tensor cpu_positions = positions.cpu().to(at::kLong);
    at::Tensor attn = start >= 0 && at::equal(cpu_positions, at::arange(start, n_keys, at::kLong))
                          ? detail::decoder::attend_after_cache(q, keys, values, start)
                          : detail::decoder::attend_at_positions(q, keys, values, pos);
    return attn.transpose(1, 2).reshape({1, m, c.q_dim()});
  });
}

COMB_INLINE at::Tensor Decoder::embed(const at::Tensor& tokens) const {
  RECORD_FUNCTION("comb::embed", std::vector<c10::IValue>());
  const at::Tensor ids = detail::decoder::ints_on(tokens, device_);
  if (weights_.tok_embd_q) return weights_.tok_embd_q->gather_rows(ids);
  return at::embedding(weights_.tok_embd, ids);
}

// ---- The fused fp32 CPU path ------------------------------------------------------------------

namespace detail::decoder {  // this file's own helpers
// Steps of up to this many rows (decode, small batches) use fused kernels throughout; longer ones
// are GEMM-bound and keep the BLAS and SDPA kernels.
COMB_INLINE constexpr int64_t kFusedMaxRows = 4;
// Up to this many rows the projections read each weight once for all of them (comb's tiled
// kernel); oneDNN's GEMM costs about a read of every weight more per call at these sizes.
COMB_INLINE constexpr int64_t kGemvMaxRows = 64;
// Up to this many rows a joint-attention layer reads the documents and the context with
// joint_attention_rows (one fused softmax per row); longer ones with joint_attention_merged.
COMB_INLINE constexpr int64_t kJointRowsMax = 32;
// Up to this many rows a CUDA layer without documents attends with comb's rows kernel (each row
// reads its keys once, split over the device); longer prompts with FlashAttention through SDPA.
COMB_INLINE constexpr int64_t kCudaRowsMax = 64;

// Whether comb's CUDA attention kernels take a joint block as it is: one sequence's keys (batch 1)
// without a mask (padded documents of a batch take the written-out joint_attention). No block: yes.
COMB_INLINE bool joint_fits_kernels(const JointKV* joint) {
  return !joint || (!joint->valid.defined() && joint->keys.size(0) == 1);
}

// A joint block as the kernels read it: keys and values [n_head_kv, m, head_dim] in `dtype` on
// `device`, contiguous (views of [1, n_head_kv, m, head_dim]), the bias float32 [n_head] or
// undefined, the anchor; undefined keys when the block holds no document (m == 0). The block must
// fit (joint_fits_kernels); its shapes are checked here.
COMB_INLINE StepJoined joint_for_kernels(const JointKV& joint, const ModelConfig& c, at::Device device,
                                         at::ScalarType dtype, int64_t layer) {
  StepJoined s;
  s.anchor = joint.anchor;
  if (joint.keys.size(2) == 0) return s;
  const at::Tensor keys = joint.keys.to(device, dtype).contiguous(), values = joint.values.to(device, dtype).contiguous();
  COMB_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.size(1) == c.n_head_kv && keys.size(3) == c.head_dim &&
                 values.sizes() == keys.sizes(),
             "layer {}'s joined keys [{}] and values [{}] for the CUDA kernels: expected [1, {}, m, {}]", layer,
             fmt::join(keys.sizes(), ", "), fmt::join(values.sizes(), ", "), c.n_head_kv, c.head_dim);
  s.keys = keys.view({c.n_head_kv, -1, c.head_dim});
  s.values = values.view({c.n_head_kv, -1, c.head_dim});
  if (joint.bias.defined()) {
    s.bias = joint.bias.to(device, at::kFloat).contiguous();
    COMB_CHECK(s.bias.numel() == c.n_head, "layer {}'s joined bias for the CUDA kernels: {} values for {} heads", layer,
               s.bias.numel(), c.n_head);
  }
  return s;
}
}  // namespace detail::decoder

COMB_INLINE at::Tensor Decoder::rms_norm_cpu(const at::Tensor& x, const at::Tensor& w) const {
  RECORD_FUNCTION("comb::rms_norm", std::vector<c10::IValue>());
  at::Tensor in = x.contiguous(), out = at::empty_like(in);
  const int64_t dim = in.size(-1), rows = in.numel() / dim;
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    detail::cpu::rms_norm_rows(in.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), dim,
                               static_cast<float>(config_.rms_eps), b, e);
  });
  return out;
}

COMB_INLINE at::Tensor Decoder::linear_cpu(const at::Tensor& x, const at::Tensor& w) const {
  RECORD_FUNCTION("comb::gemv_f32", std::vector<c10::IValue>());
  const int64_t k = x.size(-1), rows = x.numel() / k, n_out = w.size(0);
  COMB_CHECK(rows <= detail::decoder::kGemvMaxRows, "linear_cpu is for at most {} rows, found {}",
             detail::decoder::kGemvMaxRows, rows);
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape.back() = n_out;
  at::Tensor out = at::empty(shape, in.options());
  at::parallel_for(0, n_out, 256, [&](int64_t b, int64_t e) {
    detail::cpu::gemv_rows(in.data_ptr<float>(), rows, w.data_ptr<float>(), k, out.data_ptr<float>(), n_out, b, e);
  });
  return out;
}

namespace detail::decoder {  // this file's own helpers
// One layer's joined keys as a LayerReads (Decoder::layer's caller gives them as such).
class JointOnly final : public LayerReads {
 public:
  explicit JointOnly(const JointKV* joint) : joint_(joint) {}
  const JointKV* joint(int64_t) const override { return joint_; }

 private:
  const JointKV* joint_;
};
// Reads whose documents come as segments alone (Documents::paged_reads) are the fused CPU paged
// step's; every other forward refuses them instead of running without the documents.
COMB_INLINE void check_not_segments_only(const LayerReads* reads, const char* where) {
  COMB_CHECK(!reads || !reads->segments_only(),
             "{}: documents read as segments (Documents::paged_reads) are for the fused CPU paged step "
             "(Decoder::step_paged with cpu_kernels()); this path would read none of them",
             where);
}
}  // namespace detail::decoder

COMB_INLINE at::Tensor Decoder::layer_cpu(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint) const {
  const detail::decoder::JointOnly reads(joint);
  std::vector<LayerPart> parts{{x, &cache, joint ? &reads : nullptr}};
  return std::move(layer_parts(i, parts)[0]);
}

COMB_INLINE std::vector<at::Tensor> Decoder::layer_parts(int64_t i, const std::vector<LayerPart>& parts) const {
  RECORD_FUNCTION("comb::layer_parts", std::vector<c10::IValue>());
  const auto& c = config_;
  const auto& w = weights_.layers[i];
  COMB_CHECK(cpu_kernels(), "layer_parts: the fused CPU path (a float32 decoder on the CPU with cpu_kernels on)");
  COMB_CHECK(!parts.empty(), "layer_parts: no input");
  std::vector<int64_t> row_counts;
  int64_t rows = 0;
  for (const auto& p : parts) {
    detail::decoder::check_not_segments_only(p.reads, "layer_parts");
    COMB_CHECK(p.x.dim() == 3 && p.x.size(2) == c.n_embd && p.cache && p.x.size(0) == p.cache->batch(),
               "layer_parts: an input of shape [{}] for a cache of batch {}", fmt::join(p.x.sizes(), ", "),
               p.cache ? p.cache->batch() : 0);
    COMB_CHECK(p.cache->length() + p.x.size(1) <= p.cache->capacity(),
               "KV cache full: {} positions held, {} more asked, capacity {}", p.cache->length(), p.x.size(1),
               p.cache->capacity());
    row_counts.push_back(p.x.size(0) * p.x.size(1));
    rows += row_counts.back();
  }
  // Every part's rows through each matrix at once (one read of the layer's weights); attention
  // apart, each part over its own cache. Few rows (decode): fused kernels throughout. Many rows
  // (prefill): oneDNN GEMMs (packed at load) and SDPA (after cached rows: attend_after_cache),
  // fused RoPE.
  const bool few = rows <= detail::decoder::kFusedMaxRows;
  detail::decoder::LayerMath math;
  math.norm = [&](const at::Tensor& t, const at::Tensor& weight) {
    return few ? rms_norm_cpu(t, weight) : at::rms_norm(t, {c.n_embd}, weight, c.rms_eps);
  };
  math.linear = [&](const at::Tensor& t, Proj p) {  // t [rows, in]
    if (w.quantized) return project(w, p, t);
    const at::Tensor weight = dense_matrix(w, p);  // the layer's own tensor (a new handle)
    if (rows <= detail::decoder::kGemvMaxRows) return linear_cpu(t, weight);
    if (onednn_.empty()) return at::linear(t, weight);
    return at::mkldnn_linear(t.contiguous().to_mkldnn(), onednn_[i][static_cast<int>(p)]).to_dense();
  };
  math.act = [&](const at::Tensor& gate_up) {
    if (!few) {
      auto halves = gate_up.chunk(2, -1);
      return at::silu(halves[0]).mul_(halves[1]);
    }
    RECORD_FUNCTION("comb::silu_mul", std::vector<c10::IValue>());
    at::Tensor act = at::empty({rows, c.n_ff}, gate_up.options());
    detail::cpu::silu_mul_rows(gate_up.data_ptr<float>(), act.data_ptr<float>(), c.n_ff, 0, rows);
    return act;
  };
  std::vector<at::Tensor> flat;
  std::vector<const JointKV*> joints;  // what each part's attention reads beside its cache
  for (size_t j = 0; j < parts.size(); ++j) {
    const LayerPart& p = parts[j];
    const at::Tensor in = p.reads ? p.reads->before(i, p.x, p.cache->length()) : p.x;
    flat.push_back(in.reshape({row_counts[j], c.n_embd}));
    joints.push_back(p.reads ? p.reads->joint(i) : nullptr);
  }
  at::Tensor x = flat.size() == 1 ? flat[0] : at::cat(flat, 0);  // [rows, n_embd]
  at::Tensor h = detail::decoder::layer_body(x, w, math, [&](const at::Tensor& qkv_rows) {
    at::Tensor qkv = qkv_rows.contiguous();  // [rows, q_dim + 2 kv_dim]
    std::vector<at::Tensor> attn_parts;
    int64_t offset = 0;
    for (size_t j = 0; j < parts.size(); ++j) {
      const LayerPart& part = parts[j];
      KVCache& cache = *part.cache;
      const int64_t batch = part.x.size(0), n = part.x.size(1), start = cache.length(), part_rows = row_counts[j];
      at::Tensor part_qkv = qkv.narrow(0, offset, part_rows);
      offset += part_rows;
      at::Tensor q = at::empty({batch, n, c.n_head, c.head_dim}, x.options());
      detail::cpu::AttentionShape shape{n, start, c.n_head, c.n_head_kv, c.head_dim, cache.capacity()};
      float* k_cache = cache.keys(i).data_ptr<float>();
      float* v_cache = cache.values(i).data_ptr<float>();
      {
        RECORD_FUNCTION("comb::rope_and_store_kv", std::vector<c10::IValue>());
        at::parallel_for(0, part_rows, 16, [&](int64_t b, int64_t e) {
          detail::cpu::rope_and_store(part_qkv.data_ptr<float>(), rope_cos_.data_ptr<float>(),
                                      rope_sin_.data_ptr<float>(), shape, q.data_ptr<float>(), k_cache, v_cache, b, e);
        });
      }
      at::Tensor attn;
      const JointKV* joint = joints[j];
      if (joint && n <= detail::decoder::kJointRowsMax && merged_attention_applies(*joint)) {
        // A warm request's question or a decoding step: one softmax per row by the fused kernel.
        attn = joint_attention_rows(q, cache.keys(i), cache.values(i), start, *joint);
      } else if (joint) {  // the documents' keys beside the context's
        at::Tensor keys = cache.keys(i).narrow(2, 0, start + n), values = cache.values(i).narrow(2, 0, start + n);
        attn = joint_attention_merged(q.transpose(1, 2), keys, values, start, *joint).transpose(1, 2);
      } else if (few) {
        RECORD_FUNCTION("comb::attention", std::vector<c10::IValue>());
        attn = at::empty({batch, n, c.q_dim()}, x.options());
        at::parallel_for(0, batch * c.n_head, 1, [&](int64_t b, int64_t e) {
          std::vector<float> scratch(start + n);
          detail::cpu::attention_rows(q.data_ptr<float>(), k_cache, v_cache, shape, attn.data_ptr<float>(),
                                      scratch.data(), b, e);
        });
      } else {
        at::Tensor keys = cache.keys(i).narrow(2, 0, start + n), values = cache.values(i).narrow(2, 0, start + n);
        attn = detail::decoder::attend_after_cache(q.transpose(1, 2), keys, values, start).transpose(1, 2);
      }
      attn_parts.push_back(attn.reshape({part_rows, c.q_dim()}));
    }
    return attn_parts.size() == 1 ? attn_parts[0] : at::cat(attn_parts, 0);
  });
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (size_t j = 0; j < parts.size(); ++j) {
    out.push_back(h.narrow(0, offset, row_counts[j]).view({parts[j].x.size(0), parts[j].x.size(1), c.n_embd}));
    offset += row_counts[j];
  }
  return out;
}

// ---- Generic path -----------------------------------------------------------------------------

COMB_INLINE at::Tensor Decoder::layer(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint) const {
  // NOTE: a layer that reads documents takes the fused path too where joint_attention_merged
  // applies (no gradients, float32 joined keys without padding). On the generic path (BLAS GEMMs),
  // a warm request's question was 8% faster or 9% slower than naive reuse's from one process to the
  // next (`comb bench --pic-data`, code words); on the fused path, as naive reuse, it is steady.
  if (cpu_kernels() && (!joint || merged_attention_applies(*joint))) return layer_cpu(i, x, cache, joint);
  if (x.size(0) == 1 && cuda_attention_applies(cache, joint)) return layer_cuda(i, x, cache, joint);
  const auto& w = weights_.layers[i];
  return detail::decoder::layer_body(x, w, detail::decoder::generic_math(w, config_),
                                     [&](const at::Tensor& qkv) { return attention(i, qkv, cache, joint); });
}

COMB_INLINE at::Tensor Decoder::logits(const at::Tensor& x, LogitsMode mode) const {
  at::Tensor h = mode == LogitsMode::last ? x.narrow(1, x.size(1) - 1, 1) : x;
  // The same steps for float and kept-quantized heads (the same numbers: see quantized.hpp).
  const int64_t rows = h.size(0) * h.size(1);
  const bool fused = cpu_kernels();
  at::Tensor n = fused && rows <= detail::decoder::kFusedMaxRows ? rms_norm_cpu(h, weights_.output_norm)
                                                                 : rms_norm(h, weights_.output_norm);
  if (weights_.output_q) return weights_.output_q->apply(n);  // float32
  if (fused && rows <= detail::decoder::kGemvMaxRows) return linear_cpu(n, weights_.output);
  return at::linear(n, weights_.output).to(at::kFloat);
}

COMB_INLINE at::Tensor Decoder::forward(const at::Tensor& tokens, KVCache& cache, LogitsMode mode,
                                        const LayerReads* reads) const {
  COMB_CHECK(tokens.dim() == 2 && tokens.size(1) > 0, "decoder input should be [batch, n>0] token ids, found shape [{}]",
             fmt::join(tokens.sizes(), ", "));
  detail::decoder::check_not_segments_only(reads, "Decoder::forward");
  COMB_CHECK(tokens.size(0) == cache.batch(), "decoder input batch {} does not match the KV cache batch {}",
             tokens.size(0), cache.batch());
  const int64_t n = tokens.size(1), start = cache.length();
  COMB_CHECK(start + n <= config_.n_ctx, "{} positions exceed the model's context of {} tokens", start + n,
             config_.n_ctx);
  // A short forward as one graph: its last row's logits only.
  if (tokens.size(0) == 1 && n <= detail::step_rows() && (n == 1 || mode == LogitsMode::last) &&
      (!reads || !reads->changes_state()) && start + n <= std::min(cache.capacity(), rope_cos_.size(0)) &&
      cuda_graph_applies(cache)) {
    at::Tensor out = cuda_step(tokens, cache, reads);
    if (out.defined()) {
      cache.advance(n);
      return out;
    }
  }
  at::Tensor x = embed(tokens);
  for (int64_t i = 0; i < config_.n_layer; ++i)
    x = reads ? layer(i, reads->before(i, x, start), cache, reads->joint(i)) : layer(i, x, cache);
  cache.advance(n);
  return logits(x, mode);
}

// ---- The CUDA decoding step -----------------------------------------------------------------------

COMB_INLINE bool Decoder::cuda_kernels_apply(const KVCache& cache) const {
  const int64_t hd = config_.head_dim;  // (COMB_CUDA_KERNELS=0: no ops, detail/decode_step.hpp)
  return cuda_kernels_ && device_.is_cuda() && (dtype_ == at::kBFloat16 || dtype_ == at::kHalf) &&
         !weights_.quantized() && detail::cuda_layer_ops() != nullptr && !at::GradMode::is_enabled() &&
         cache.batch() == 1 && cache.n_layers() == config_.n_layer && cache.keys(0).scalar_type() == dtype_ &&
         cache.keys(0).is_contiguous() && cache.values(0).is_contiguous() &&
         (hd == 32 || hd == 64 || hd == 128 || hd == 256);
}

COMB_INLINE bool Decoder::cuda_graph_applies(const KVCache& cache) const {
  static const bool env = detail::env_on("COMB_CUDA_GRAPHS");
  return env && detail::decode_step_factory() != nullptr && cuda_kernels_apply(cache);
}

COMB_INLINE at::Tensor Decoder::layer_cuda(int64_t i, const at::Tensor& x, KVCache& cache, const JointKV* joint) const {
  RECORD_FUNCTION("comb::layer_cuda", std::vector<c10::IValue>());
  const auto& w = weights_.layers[i];
  return detail::decoder::layer_body(x, w, detail::decoder::cuda_math(w, config_, *detail::cuda_layer_ops()),
                                     [&](const at::Tensor& qkv) { return attend_cuda(i, qkv, cache, joint); });
}

COMB_INLINE at::Tensor Decoder::attend_cuda(int64_t i, const at::Tensor& qkv, KVCache& cache, const JointKV* joint) const {
  const auto& c = config_;
  const detail::CudaLayerOps& ops = *detail::cuda_layer_ops();
  const int64_t n = qkv.size(1), start = cache.length();
  COMB_CHECK(start + n <= cache.capacity(), "KV cache full: {} positions held, {} more asked, capacity {}", start, n,
             cache.capacity());
  at::Tensor q = ops.rope_append(qkv.contiguous().view({n, -1}), rope_cos_, rope_sin_, cache.keys(i), cache.values(i),
                                 start, c.n_head);  // [n, n_head, head_dim]
  at::Tensor out;
  if (joint || n <= detail::decoder::kCudaRowsMax) {
    const detail::StepJoined j =
        joint ? detail::decoder::joint_for_kernels(*joint, c, device_, dtype_, i) : detail::StepJoined{};
    out = ops.rows_attention(q, cache.keys(i), cache.values(i), start, j.keys, j.values, j.bias, j.anchor);
  } else {  // a long prompt: FlashAttention through SDPA over the cache
    at::Tensor keys = cache.keys(i).narrow(2, 0, start + n), values = cache.values(i).narrow(2, 0, start + n);
    out = detail::decoder::attend_after_cache(q.transpose(0, 1).unsqueeze(0), keys, values, start)[0].transpose(0, 1);
  }
  return out.reshape({1, n, c.q_dim()});
}

COMB_INLINE bool Decoder::cuda_attention_applies(const KVCache& cache, const JointKV* joint) const {
  return detail::decoder::joint_fits_kernels(joint) && cuda_kernels_apply(cache);
}

COMB_INLINE at::Tensor Decoder::attend_piece(int64_t i, const at::Tensor& qkv, KVCache& cache, const JointKV* joint) const {
  return cuda_attention_applies(cache, joint) ? attend_cuda(i, qkv, cache, joint) : attention(i, qkv, cache, joint);
}

COMB_INLINE Decoder::PackedRows Decoder::packed_rows(const std::vector<int64_t>& lengths, int64_t pre) const {
  COMB_CHECK(!lengths.empty() && pre >= 0, "packed_rows: {} sequences after {} positions", lengths.size(), pre);
  PackedRows r;
  r.pre = pre;
  r.first.push_back(0);
  std::vector<int64_t> positions, gather, cu{0};  // cu: the first rows', then the first keys' offsets
  for (int64_t len : lengths) {
    COMB_CHECK(len > 0 && pre + len <= config_.n_ctx, "packed_rows: a sequence of {} tokens after {} (context {})", len,
               pre, config_.n_ctx);
    const int64_t f = r.first.back();
    for (int64_t p = 0; p < pre; ++p) gather.push_back(p);
    for (int64_t j = 0; j < len; ++j) {
      positions.push_back(pre + j);
      gather.push_back(pre + f + j);  // in [prefix; every row]
    }
    r.first.push_back(f + len);
    r.longest = std::max(r.longest, len);
    cu.push_back(f + len);
  }
  const auto n_seq = static_cast<int64_t>(lengths.size()), n = static_cast<int64_t>(positions.size());
  cu.push_back(0);
  for (int64_t s = 0; s < n_seq; ++s) cu.push_back(cu.back() + pre + lengths[s]);
  // Two uploads (int64 and int32), the tensors views of them; on a CUDA device without the host
  // waiting for the device's queue.
  positions.insert(positions.end(), gather.begin(), gather.end());
  const at::Tensor longs = detail::upload_ints(positions, at::kLong, device_);
  const at::Tensor ints = detail::upload_ints(cu, at::kInt, device_);
  const at::Tensor pos = longs.narrow(0, 0, n).to(rope_cos_.device());
  r.cos = rope_cos_.index_select(0, pos);
  r.sin = rope_sin_.index_select(0, pos);
  r.gather = longs.narrow(0, n, longs.size(0) - n);
  r.cu_rows = ints.narrow(0, 0, n_seq + 1);
  r.cu_keys = ints.narrow(0, n_seq + 1, n_seq + 1);
  return r;
}

COMB_INLINE at::Tensor Decoder::layer_packed(int64_t i, const at::Tensor& x, const PackedRows& rows,
                                             const at::Tensor& prefix_keys, const at::Tensor& prefix_values,
                                             bool varlen, std::pair<at::Tensor, at::Tensor>* kv) const {
  RECORD_FUNCTION("comb::layer_packed", std::vector<c10::IValue>());
  const auto& c = config_;
  const auto& w = weights_.layers[i];
  const int64_t n = x.size(1), n_seq = static_cast<int64_t>(rows.first.size()) - 1, pre = rows.pre;
  COMB_CHECK(x.dim() == 3 && x.size(0) == 1 && n_seq > 0 && rows.first.back() == n && rows.cos.size(0) == n,
             "layer_packed: rows [{}] for {} packed sequences of {} rows", fmt::join(x.sizes(), ", "), n_seq,
             rows.first.back());
  COMB_CHECK(pre == 0 || (prefix_keys.defined() && prefix_keys.dim() == 4 && prefix_keys.size(2) >= pre &&
                          prefix_values.defined() && prefix_values.sizes() == prefix_keys.sizes()),
             "layer_packed: the sequences follow {} positions; their keys and values should be [1, n_head_kv, >= {}, "
             "head_dim]", pre, pre);
  const bool half = device_.is_cuda() && (dtype_ == at::kBFloat16 || dtype_ == at::kHalf) && !at::GradMode::is_enabled();
  COMB_CHECK(!varlen || half, "layer_packed: the variable-length attention runs on a CUDA bfloat16 or float16 decoder");
  const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
  const detail::decoder::LayerMath math = half && cuda_kernels_ && !weights_.quantized() && ops
                                              ? detail::decoder::cuda_math(w, c, *ops)
                                              : detail::decoder::generic_math(w, c);
  // The packed rows' queries and keys turned in one launch, in place (the qkv product is this
  // layer's own), equal to apply_rope's.
  const bool fused_rope = varlen && cuda_kernels_ && !weights_.quantized() && ops && ops->rope_rows;
  return detail::decoder::layer_body(x, w, math, [&](const at::Tensor& qkv) {
    if (fused_rope && qkv.is_contiguous()) {
      ops->rope_rows(qkv, rows.cos, rows.sin, c.n_head, c.n_head_kv);
      const at::Tensor heads = qkv.view({n, c.n_head + 2 * c.n_head_kv, c.head_dim});  // [rows, heads, head_dim]
      if (kv)
        *kv = {heads.narrow(1, c.n_head, c.n_head_kv).transpose(0, 1).unsqueeze(0),
               heads.narrow(1, c.n_head + c.n_head_kv, c.n_head_kv).transpose(0, 1).unsqueeze(0)};
      const at::Tensor own_k = heads.narrow(1, c.n_head, c.n_head_kv);
      const at::Tensor own_v = heads.narrow(1, c.n_head + c.n_head_kv, c.n_head_kv);
      at::Tensor keys, values;
      if (ops->pack_keys && (pre == 0 || (prefix_keys.scalar_type() == qkv.scalar_type() &&
                                          prefix_values.scalar_type() == qkv.scalar_type()))) {
        // Every sequence's keys, the prefix's then its own, in one launch (as the gather below).
        const auto packed = ops->pack_keys(own_k, own_v, prefix_keys, prefix_values, rows.first, pre);
        keys = packed[0], values = packed[1];
      } else {
        auto keys_of = [&](const at::Tensor& own, const at::Tensor& prefix) {  // as below, from [rows, n_head_kv, head_dim]
          at::Tensor all = own;
          if (pre > 0) all = at::cat({prefix[0].narrow(1, 0, pre).transpose(0, 1).to(all.scalar_type()), all}, 0);
          return all.index_select(0, rows.gather);
        };
        keys = keys_of(own_k, prefix_keys), values = keys_of(own_v, prefix_values);
      }
      at::Tensor out = std::get<0>(at::_flash_attention_forward(
          heads.narrow(1, 0, c.n_head).contiguous(), keys, values, rows.cu_rows, rows.cu_keys, rows.longest,
          rows.longest + pre, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false));
      return out.reshape({1, n, c.q_dim()});
    }
    auto [q, k, v] = split_qkv(qkv, c);  // [1, heads, n, head_dim]
    q = apply_rope(q, rows.cos, rows.sin);
    k = apply_rope(k, rows.cos, rows.sin);
    if (kv) *kv = {k, v};
    if (varlen) {
      // Every sequence's keys, the prefix's then its own, gathered from [prefix; every row]
      // ([keys, n_head_kv, head_dim]); FlashAttention's causal mask is aligned to the last key, so
      // row j of a sequence sees the prefix and its rows up to j.
      auto keys_of = [&](const at::Tensor& own, const at::Tensor& prefix) {
        at::Tensor all = own[0].transpose(0, 1);
        if (pre > 0) all = at::cat({prefix[0].narrow(1, 0, pre).transpose(0, 1).to(all.scalar_type()), all}, 0);
        return all.index_select(0, rows.gather);
      };
      at::Tensor out = std::get<0>(at::_flash_attention_forward(
          q[0].transpose(0, 1).contiguous(), keys_of(k, prefix_keys), keys_of(v, prefix_values), rows.cu_rows,
          rows.cu_keys, rows.longest, rows.longest + pre, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false));
      return out.reshape({1, n, c.q_dim()});  // [rows, n_head, head_dim]
    }
    std::vector<at::Tensor> outs;
    for (int64_t d = 0; d < n_seq; ++d) {
      const int64_t f = rows.first[d], len = rows.first[d + 1] - f;
      at::Tensor kd = k.narrow(2, f, len), vd = v.narrow(2, f, len);
      if (pre > 0) {
        kd = at::cat({prefix_keys.narrow(2, 0, pre).to(kd.scalar_type()), kd}, 2);
        vd = at::cat({prefix_values.narrow(2, 0, pre).to(vd.scalar_type()), vd}, 2);
      }
      outs.push_back(detail::decoder::attend_after_cache(q.narrow(2, f, len), kd, vd, pre));
    }
    return at::cat(outs, 2).transpose(1, 2).reshape({1, n, c.q_dim()});
  });
}

COMB_INLINE detail::DecodeStepSpec Decoder::decode_step_spec() const {
  const auto& c = config_;
  COMB_CHECK(!weights_.quantized(), "the CUDA decoding step reads dense weights, found weights kept quantized");
  detail::DecodeStepSpec spec;
  spec.n_layer = c.n_layer, spec.n_embd = c.n_embd, spec.n_ff = c.n_ff, spec.n_head = c.n_head;
  spec.n_head_kv = c.n_head_kv, spec.head_dim = c.head_dim, spec.n_vocab = c.n_vocab, spec.rms_eps = c.rms_eps;
  spec.tok_embd = weights_.tok_embd.contiguous();
  spec.output_norm = weights_.output_norm.contiguous();
  spec.output = weights_.output.contiguous();
  spec.rope_cos = rope_cos_.contiguous();
  spec.rope_sin = rope_sin_.contiguous();
  for (const auto& l : weights_.layers)
    spec.layers.push_back({l.attn_norm.contiguous(), l.wqkv.contiguous(), l.wo.contiguous(), l.ffn_norm.contiguous(),
                           l.w_gate_up.contiguous(), l.w_down.contiguous()});
  return spec;
}

COMB_INLINE at::Tensor Decoder::cuda_step(const at::Tensor& tokens, KVCache& cache, const LayerReads* reads) const {
  const auto& c = config_;
  std::vector<detail::StepJoined> joined;
  if (reads) {
    joined.resize(c.n_layer);
    for (int64_t i = 0; i < c.n_layer; ++i) {
      const JointKV* j = reads->joint(i);
      if (!j) continue;
      // One sequence's keys without padding, as attend_cuda takes them (else the layers' path).
      if (!detail::decoder::joint_fits_kernels(j)) return {};
      joined[i] = detail::decoder::joint_for_kernels(*j, c, device_, dtype_, i);
    }
  }
  const at::Tensor t = tokens.reshape({-1}).to(at::kCPU, at::kLong).contiguous();
  const std::vector<int64_t> ids(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  std::vector<at::Tensor> keys, values;
  for (int64_t l = 0; l < cache.n_layers(); ++l) {
    keys.push_back(cache.keys(l));
    values.push_back(cache.values(l));
  }
  std::lock_guard<std::mutex> lock(*cuda_step_mutex_);
  if (!cuda_step_) cuda_step_ = detail::decode_step_factory()(decode_step_spec(), /*graph=*/true);
  return cuda_step_->run(ids, cache.length(), keys, values, joined);
}

COMB_INLINE at::Tensor Decoder::hidden(const at::Tensor& tokens, const LayerReads* reads) const {
  const auto& c = config_;
  const int64_t n = tokens.size(1);
  COMB_CHECK(tokens.dim() == 2 && n > 0, "decoder input should be [batch, n>0] token ids, found shape [{}]",
             fmt::join(tokens.sizes(), ", "));
  COMB_CHECK(n <= c.n_ctx, "a sequence of {} tokens; the context holds {}", n, c.n_ctx);
  detail::decoder::check_not_segments_only(reads, "Decoder::hidden");
  at::Tensor x = embed(tokens);
  at::Tensor cos = rope_cos_.narrow(0, 0, n), sin = rope_sin_.narrow(0, 0, n);
  for (int64_t i = 0; i < c.n_layer; ++i)
    x = reads ? llama_layer(reads->before(i, x, 0), weights_.layers[i], c, cos, sin, /*causal=*/true, {}, reads->joint(i))
              : llama_layer(x, weights_.layers[i], c, cos, sin, /*causal=*/true);
  return comb::rms_norm(x, weights_.output_norm, c.rms_eps);
}

// ---- The paged, batched decoding step -------------------------------------------------------------

COMB_INLINE at::Tensor Decoder::step_paged(BlockPool& pool, const std::vector<PagedRow>& rows, const ParallelFor& run,
                                           PagedPiece* piece) const {
  namespace cpu = detail::cpu;
  const auto& c = config_;
  COMB_CHECK(!rows.empty(), "step_paged: no row");
  const c10::Device pool_device = pool.keys(0).device();
  COMB_CHECK(pool_device.type() == device_.type() && (!device_.has_index() || pool_device.index() == device_.index()) &&
                 pool.keys(0).scalar_type() == dtype_,
             "step_paged: a block pool of {} on {} for a decoder of {} on {}",
             c10::toString(pool.keys(0).scalar_type()), pool.keys(0).device().str(), c10::toString(dtype_),
             device_.str());
  const int64_t B = static_cast<int64_t>(rows.size()), E = c.n_embd, hd = c.head_dim;
  const int64_t q_dim = c.q_dim(), kv_dim = c.kv_dim(), qkv_dim = q_dim + 2 * kv_dim, bt = pool.block_tokens();
  for (const auto& r : rows)
    COMB_CHECK(r.blocks && r.position >= 0 && r.position < c.n_ctx &&
                   r.position / bt < static_cast<int64_t>(r.blocks->size()),
               "step_paged: position {} past the row's {} blocks of {} tokens (or the context of {})", r.position,
               r.blocks ? r.blocks->size() : 0, bt, c.n_ctx);
  if (piece) {
    COMB_CHECK(paged_piece_applies(), "step_paged: a prompt's piece beside the rows needs the generic path, not the "
                                      "fused CPU kernels (Decoder::paged_piece_applies)");
    COMB_CHECK(piece->cache && piece->tokens.defined() && piece->tokens.dim() == 2 && piece->tokens.size(0) == 1 &&
                   piece->tokens.size(1) > 0,
               "step_paged: a piece should be tokens [1, n>0] with a cache, found {}",
               piece->tokens.defined() ? fmt::format("[{}]", fmt::join(piece->tokens.sizes(), ", ")) : "no tokens");
    const KVCache& pc = *piece->cache;
    const int64_t from = pc.length(), n = piece->tokens.size(1);
    COMB_CHECK(pc.batch() == 1 && from + n <= pc.capacity() && from + n <= c.n_ctx,
               "step_paged: a piece of {} tokens after {} in a cache of batch {} holding {} (context {})", n, from,
               pc.batch(), pc.capacity(), c.n_ctx);
  }
  if (!cpu_kernels()) {
    for (const auto& r : rows) detail::decoder::check_not_segments_only(r.reads, "step_paged (the generic path)");
    if (piece) detail::decoder::check_not_segments_only(piece->reads, "step_paged (the generic path)");
    return step_paged_generic(pool, rows, piece);
  }
  ParallelFor each = run ? run : ParallelFor([](int64_t n, const std::function<void(int64_t)>& fn) {
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) fn(j);
    });
  });
  std::vector<int64_t> ids(B);
  for (int64_t b = 0; b < B; ++b) ids[b] = rows[b].token;
  at::Tensor x = embed(at::tensor(ids, at::kLong).view({B, 1})).view({B, E}).to(at::kFloat).contiguous();
  // Row-wise kernels: every row alone through the norms, the matrices (weight rows in chunks of 64
  // over the pool: a chunk's results do not depend on who computes it) and the activation.
  detail::decoder::LayerMath math;
  math.norm = [&](const at::Tensor& t, const at::Tensor& w) {  // w: float32, as the decoder's dtype
    at::Tensor in = t.contiguous(), out = at::empty_like(in);
    cpu::rms_norm_rows(in.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), E,
                       static_cast<float>(c.rms_eps), 0, B);
    return out;
  };
  auto gemv = [&](const float* in, const float* w, int64_t k, float* out, int64_t n_out) {
    constexpr int64_t chunk = 64;
    each((n_out + chunk - 1) / chunk,
         [&](int64_t j) { cpu::gemv_rows(in, B, w, k, out, n_out, j * chunk, std::min(n_out, (j + 1) * chunk)); });
  };
  // The same over kept-quantized weights: the row kernels, kKernelRows rows of the batch at a time.
  auto gemv_quantized = [&](const at::Tensor& t, const QuantizedMatrix& m) {
    constexpr int64_t chunk = 64;
    const int64_t k = t.size(-1), n_out = m.rows();
    at::Tensor out = at::empty({B, n_out}, t.options());
    for (int64_t r = 0; r < B; r += QuantizedMatrix::kKernelRows) {
      const int64_t n = std::min(QuantizedMatrix::kKernelRows, B - r);
      const float* in = t.data_ptr<float>() + r * k;
      float* o = out.data_ptr<float>() + r * n_out;
      each((n_out + chunk - 1) / chunk,
           [&](int64_t j) { m.apply_rows(in, n, o, j * chunk, std::min(n_out, (j + 1) * chunk)); });
    }
    return out;
  };
  math.act = [&](const at::Tensor& gate_up) {
    at::Tensor act = at::empty({B, c.n_ff}, gate_up.options());
    cpu::silu_mul_rows(gate_up.data_ptr<float>(), act.data_ptr<float>(), c.n_ff, 0, B);
    return act;
  };
  const cpu::PagedShape shape{c.n_head, c.n_head_kv, hd, bt};
  const float* cos = rope_cos_.data_ptr<float>();
  const float* sin = rope_sin_.data_ptr<float>();
  const int64_t group = c.n_head / c.n_head_kv, block_stride = c.n_head_kv * bt * hd;
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const auto& w = weights_.layers[i];
    math.linear = [&](const at::Tensor& t, Proj p) -> at::Tensor {
      at::Tensor in = t.contiguous();
      if (w.quantized) return gemv_quantized(in, quantized_matrix(*w.quantized, p));
      const at::Tensor weight = dense_matrix(w, p);  // the layer's own tensor (a new handle)
      const int64_t k = in.size(-1), n_out = weight.size(0);
      at::Tensor out = at::empty({B, n_out}, in.options());
      gemv(in.data_ptr<float>(), weight.data_ptr<float>(), k, out.data_ptr<float>(), n_out);
      return out;
    };
    for (int64_t b = 0; b < B; ++b)  // a residual cross block before the layer, row by row
      if (rows[b].reads) {
        at::Tensor row = x[b].view({1, 1, E});
        at::Tensor read = rows[b].reads->before(i, row, rows[b].position);
        if (!read.is_same(row)) x[b].copy_(read.view({E}));
      }
    x = detail::decoder::layer_body(x, w, math, [&](const at::Tensor& qkv_rows) {
      at::Tensor qkv = qkv_rows.contiguous();  // [B, qkv_dim]
      at::Tensor q = at::empty({B, q_dim}, x.options()), attn = at::empty({B, q_dim}, x.options());
      float* kp = pool.keys(i).data_ptr<float>();
      float* vp = pool.values(i).data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {  // RoPE; the row's K/V into its block
        const int64_t pos = rows[b].position;
        const int32_t block = (*rows[b].blocks)[pos / bt];
        const float* row = qkv.data_ptr<float>() + b * qkv_dim;
        const float* cp = cos + pos * hd;
        const float* sp = sin + pos * hd;
        cpu::rotate_rows(row, hd, cp, sp, hd, c.n_head, q.data_ptr<float>() + b * q_dim, hd);
        float* kb = kp + int64_t(block) * block_stride + (pos % bt) * hd;
        float* vb = vp + int64_t(block) * block_stride + (pos % bt) * hd;
        cpu::rotate_rows(row + q_dim, hd, cp, sp, hd, c.n_head_kv, kb, bt * hd);
        for (int64_t h = 0; h < c.n_head_kv; ++h)
          std::copy(row + q_dim + kv_dim + h * hd, row + q_dim + kv_dim + (h + 1) * hd, vb + h * bt * hd);
      }
      // What each row's attention reads beside its own positions (a joint-attention plug-in's documents).
      std::vector<JointSegments> seg(B);
      for (int64_t b = 0; b < B; ++b)
        if (rows[b].reads) seg[b] = rows[b].reads->segments(i);
      each(B * c.n_head_kv, [&](int64_t item) {  // one KV head and the query heads that share it
        const int64_t b = item / c.n_head_kv, kvh = item % c.n_head_kv;
        const PagedRow& r = rows[b];
        const JointSegments& sg = seg[b];
        int64_t n_joint = 0;
        for (int64_t n : sg.lengths) n_joint += n;
        thread_local std::vector<float> scratch;
        scratch.resize(group * (n_joint + r.position + 1));
        const int64_t n_seg = static_cast<int64_t>(sg.lengths.size());
        float* o = attn.data_ptr<float>() + b * q_dim;
        const float* qb = q.data_ptr<float>() + b * q_dim;
        if (!cpu::paged_attention_grouped(qb, kp, vp, r.blocks->data(), r.position + 1, sg.keys.data(),
                                          sg.values.data(), sg.lengths.data(), n_seg, sg.bias, shape, o,
                                          scratch.data(), kvh))
          cpu::paged_attention(qb, kp, vp, r.blocks->data(), r.position + 1, sg.keys.data(), sg.values.data(),
                               sg.lengths.data(), n_seg, sg.bias, shape, o, scratch.data(), kvh * group,
                               (kvh + 1) * group);
      });
      return attn;
    });
  }
  at::Tensor h = math.norm(x, weights_.output_norm);
  if (weights_.output_q) return gemv_quantized(h, *weights_.output_q);
  const int64_t n_vocab = weights_.output.size(0);
  at::Tensor out = at::empty({B, n_vocab}, h.options());
  gemv(h.data_ptr<float>(), weights_.output.data_ptr<float>(), E, out.data_ptr<float>(), n_vocab);
  return out;
}

COMB_INLINE at::Tensor Decoder::step_paged_generic(BlockPool& pool, const std::vector<PagedRow>& rows,
                                                   PagedPiece* piece) const {
  RECORD_FUNCTION("comb::step_paged", std::vector<c10::IValue>());
  const auto& c = config_;
  const int64_t B = static_cast<int64_t>(rows.size()), bt = pool.block_tokens(), hd = c.head_dim;
  int64_t n_blocks_max = 0, longest = 0;
  for (const auto& r : rows) n_blocks_max = std::max(n_blocks_max, r.position / bt + 1);
  for (const auto& r : rows) longest = std::max(longest, r.position + 1);
  // Per row: its position, the block and offset its new K/V go to, and its block table, padded
  // with its own first block to the longest row's (positions past its own are never read).
  std::vector<int64_t> pos(B), dest_block(B), dest_offset(B), ids(B);
  std::vector<int32_t> table(B * n_blocks_max);
  for (int64_t b = 0; b < B; ++b) {
    const auto& r = rows[b];
    pos[b] = r.position;
    ids[b] = r.token;
    dest_block[b] = (*r.blocks)[r.position / bt];
    dest_offset[b] = r.position % bt;
    for (int64_t j = 0; j < n_blocks_max; ++j) table[b * n_blocks_max + j] = (*r.blocks)[j <= r.position / bt ? j : 0];
  }
  // On a CUDA half decoder with comb's ops: the norms and the activation fused, and each row's RoPE,
  // K/V store and attention read straight from its blocks (no gather).
  const detail::CudaLayerOps* ops = detail::cuda_layer_ops();
  const bool cuda_ops = device_.is_cuda() && (dtype_ == at::kBFloat16 || dtype_ == at::kHalf) &&
                        !weights_.quantized() && ops != nullptr && cuda_kernels_;
  const bool paged_kernels = cuda_ops && ops->paged_attention != nullptr && B <= 65535 &&
                             (hd == 32 || hd == 64 || hd == 128 || hd == 256);
  const bool all_plain = !piece &&
      std::none_of(rows.begin(), rows.end(), [](const PagedRow& r) { return r.reads != nullptr; });
  // Rows the graphs take: without documents, or reading joint blocks alone (one sequence's keys
  // each, no mask), each row's joined keys named in the graph's joined table.
  const bool graph_rows = !piece && std::all_of(rows.begin(), rows.end(), [&](const PagedRow& r) {
    if (!r.reads) return true;
    if (r.reads->changes_state()) return false;
    for (int64_t i = 0; i < c.n_layer; ++i)
      if (!detail::decoder::joint_fits_kernels(r.reads->joint(i))) return false;
    return true;
  });
  // One graph per bucket of rows (1, 2, 4, 8, then multiples of 8) and width of tables (a power of
  // two of blocks, at least 16); the rows past B repeat the last row (the same K/V written to the
  // same place). Before any copy to the device: the graph's buffers take the host's values.
  const int64_t bucket = B <= 1 ? 1 : B <= 2 ? 2 : B <= 4 ? 4 : (B + 7) / 8 * 8;
  if (paged_kernels && graph_rows && cuda_paged_graphs_ && ops->paged_graphs != nullptr &&
      ops->paged_attention_joined != nullptr && bucket <= 65535) {
    int64_t width = 16;
    while (width < n_blocks_max) width *= 2;
    std::vector<int64_t> ids_b(bucket), pos_b(bucket);
    std::vector<int32_t> table_b(bucket * width);
    std::vector<int64_t> joined_b(c.n_layer * bucket * 5, 0);  // [layer][row]: keys, values, bias, m, anchor
    std::vector<at::Tensor> held;  // what joined_b names, alive until the replay has run
    bool documents = false;        // some row reads joined keys
    for (int64_t b = 0; b < bucket; ++b) {
      const PagedRow& r = rows[std::min(b, B - 1)];
      ids_b[b] = r.token, pos_b[b] = r.position;
      for (int64_t j = 0; j < width; ++j) table_b[b * width + j] = (*r.blocks)[j <= r.position / bt ? j : 0];
      if (!r.reads) continue;
      if (b >= B) {  // a repeat of the last row: its entries
        for (int64_t i = 0; i < c.n_layer; ++i)
          std::copy_n(joined_b.data() + (i * bucket + B - 1) * 5, 5, joined_b.data() + (i * bucket + b) * 5);
        continue;
      }
      for (int64_t i = 0; i < c.n_layer; ++i) {
        const JointKV* j = r.reads->joint(i);
        if (!j || j->keys.size(2) == 0) continue;  // no document: the entry stays zero
        const detail::StepJoined s = detail::decoder::joint_for_kernels(*j, c, device_, dtype_, i);
        int64_t* p = joined_b.data() + (i * bucket + b) * 5;
        p[0] = reinterpret_cast<int64_t>(s.keys.data_ptr());
        p[1] = reinterpret_cast<int64_t>(s.values.data_ptr());
        if (s.bias.defined()) {
          p[2] = reinterpret_cast<int64_t>(s.bias.data_ptr());
          held.push_back(s.bias);
        }
        p[3] = s.keys.size(1);
        p[4] = s.anchor;
        held.push_back(s.keys), held.push_back(s.values);
        documents = true;
      }
    }
    if (!documents) joined_b.clear();  // the plain graphs
    struct State {
      std::weak_ptr<const int> decoder;  // the decoder whose weights the graphs read
      std::unique_ptr<detail::PagedGraphs> graphs;
    };
    auto state = std::static_pointer_cast<State>(pool.step_state());
    if (!state || state->decoder.lock() != identity_) {
      state = std::make_shared<State>();
      state->decoder = identity_;
      state->graphs = ops->paged_graphs(pool.keys(0).device());
      pool.step_state() = state;
    }
    at::Tensor out = state->graphs->run(
        bucket, width, ids_b, pos_b, table_b, joined_b,
        [&](const at::Tensor& i, const at::Tensor& p, const at::Tensor& t, const at::Tensor& j) {
          // With documents the grid fills the device whatever the joined keys' count (a split past
          // a row's keys ends at once), as the eager path's split count would for many of them.
          if (!j.defined()) return paged_kernels_step(pool, i, p, t, width * bt);
          return paged_kernels_step(pool, i, p, t, int64_t(1) << 20, j.view({c.n_layer, bucket, 5}));
        });
    return out.narrow(0, 0, B);
  }
  // Host integers on the device; on a GPU queued without the host waiting (detail::upload_ints).
  auto on_device = [&](const std::vector<int64_t>& v) { return detail::upload_ints(v, at::kLong, device_); };
  // The block tables, int32 as the kernels take them (index_select takes them too).
  const at::Tensor pos_t = on_device(pos);
  const at::Tensor table_t = detail::upload_ints(table, at::kInt, device_);
  const at::Tensor table32 = table_t.view({B, n_blocks_max});
  at::Tensor block_t, offset_t, cos, sin, visible;
  if (!paged_kernels) {
    block_t = on_device(dest_block), offset_t = on_device(dest_offset);
    // RoPE angles of each row's position: [B, 1, 1, head_dim], broadcast over heads.
    cos = rope_cos_.index_select(0, pos_t).view({B, 1, 1, hd});
    sin = rope_sin_.index_select(0, pos_t).view({B, 1, 1, hd});
    // Which gathered keys each row sees: its positions [0, position].
    const int64_t n_keys = n_blocks_max * bt;
    visible = (at::arange(n_keys, at::TensorOptions().dtype(at::kLong).device(device_)).view({1, n_keys}) <=
               pos_t.view({B, 1}))
                  .view({B, 1, 1, n_keys});
  }
  if (paged_kernels && all_plain) return paged_kernels_step(pool, on_device(ids), pos_t, table32, longest);
  std::vector<int64_t> plain;  // rows without joined keys at a layer: attended together
  at::Tensor x = embed(on_device(ids).view({B, 1})).to(dtype_);  // [B, 1, n_embd]
  // A prompt's piece: its n rows after the B decoding rows, [B + n, 1, n_embd], through every
  // matrix together; its attention is forward()'s over its own cache.
  const int64_t n_piece = piece ? piece->tokens.size(1) : 0, piece_start = piece ? piece->cache->length() : 0;
  if (piece) x = at::cat({x, embed(piece->tokens).to(dtype_).view({n_piece, 1, c.n_embd})});
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const auto& w = weights_.layers[i];
    for (int64_t b = 0; b < B; ++b)  // a residual cross block before the layer, row by row
      if (rows[b].reads) {
        at::Tensor row = x.narrow(0, b, 1);
        at::Tensor read = rows[b].reads->before(i, row, rows[b].position);
        if (!read.is_same(row)) x.narrow(0, b, 1).copy_(read);
      }
    if (piece && piece->reads) {  // the piece's, as forward() reads it: [1, n, n_embd] at its first position
      at::Tensor rows_of_piece = x.narrow(0, B, n_piece).view({1, n_piece, c.n_embd});
      at::Tensor read = piece->reads->before(i, rows_of_piece, piece_start);
      if (!read.is_same(rows_of_piece)) x.narrow(0, B, n_piece).copy_(read.view({n_piece, 1, c.n_embd}));
    }
    const auto math = cuda_ops ? detail::decoder::cuda_math(w, c, *ops) : detail::decoder::generic_math(w, c);
    at::Tensor pool_k = pool.keys(i), pool_v = pool.values(i);  // handles on the pool's memory
    x = detail::decoder::layer_body(x, w, math, [&](const at::Tensor& qkv_all) {
      const at::Tensor qkv = piece ? qkv_all.narrow(0, 0, B) : qkv_all;
      at::Tensor piece_out;
      if (piece)
        piece_out = attend_piece(i, qkv_all.narrow(0, B, n_piece).reshape({1, n_piece, -1}), *piece->cache,
                                 piece->reads ? piece->reads->joint(i) : nullptr)
                        .reshape({n_piece, 1, c.q_dim()});
      // q: [B, n_head, head_dim] from the kernel, else [B, n_head, 1, head_dim].
      at::Tensor q;
      if (paged_kernels) {
        q = ops->paged_rope_store(qkv.reshape({B, -1}).contiguous(), rope_cos_, rope_sin_, pool_k, pool_v, table32,
                                  pos_t, c.n_head);
      } else {
        auto [q4, k, v] = split_qkv(qkv, c);  // q [B, n_head, 1, head_dim], k, v [B, n_head_kv, 1, head_dim]
        q = apply_rope(q4, cos, sin);
        k = apply_rope(k, cos, sin);
        using at::indexing::Slice;
        pool_k.index_put_({block_t, Slice(), offset_t}, k.squeeze(2));
        pool_v.index_put_({block_t, Slice(), offset_t}, v.squeeze(2));
      }
      // Row b's keys and values gathered from its blocks: [1, n_head_kv, position + 1, head_dim].
      auto row_kv = [&](int64_t b) {
        const int64_t nb = rows[b].position / bt + 1;
        auto one = [&](const at::Tensor& t) {
          return t.index_select(0, table_t.narrow(0, b * n_blocks_max, nb))
              .permute({1, 0, 2, 3})
              .reshape({1, c.n_head_kv, nb * bt, hd})
              .narrow(2, 0, rows[b].position + 1);
        };
        return std::make_pair(one(pool_k), one(pool_v));
      };
      at::Tensor out = at::empty_like(q);
      plain.clear();
      for (int64_t b = 0; b < B; ++b) {
        const JointKV* joint = rows[b].reads ? rows[b].reads->joint(i) : nullptr;
        if (!joint) {
          plain.push_back(b);
          continue;
        }
        if (paged_kernels && detail::decoder::joint_fits_kernels(joint)) {  // its documents in the softmax
          const detail::StepJoined j = detail::decoder::joint_for_kernels(*joint, c, device_, dtype_, i);
          out.narrow(0, b, 1).copy_(ops->paged_attention(q.narrow(0, b, 1), pool_k, pool_v, table32.narrow(0, b, 1),
                                                         pos_t.narrow(0, b, 1), rows[b].position + 1, j.keys, j.values,
                                                         j.bias, j.anchor));
          continue;
        }
        auto [keys, values] = row_kv(b);
        const at::Tensor qb = paged_kernels ? q.narrow(0, b, 1).unsqueeze(2) : q.narrow(0, b, 1);
        const at::Tensor o = joint_attention(qb, keys, values, rows[b].position, *joint);  // [1, n_head, 1, head_dim]
        out.narrow(0, b, 1).copy_(paged_kernels ? o.squeeze(2) : o);
      }
      const bool all = static_cast<int64_t>(plain.size()) == B;
      const at::Tensor idx = all || plain.empty() ? at::Tensor() : on_device(plain);
      auto some = [&](const at::Tensor& t) { return all ? t : t.index_select(0, idx); };
      at::Tensor attn;
      if (plain.empty()) {
      } else if (paged_kernels) {
        attn = ops->paged_attention(some(q), pool_k, pool_v, some(table32), some(pos_t), longest, {}, {}, {}, 0);
      } else {  // the plain rows' blocks gathered, [rows, n_head_kv, n_keys, head_dim], the padding masked
        const int64_t n_plain = static_cast<int64_t>(plain.size());
        const at::Tensor plain_table = some(table32).reshape({-1});
        auto gather = [&](const at::Tensor& t) {
          return t.index_select(0, plain_table)
              .view({n_plain, n_blocks_max, c.n_head_kv, bt, hd})
              .permute({0, 2, 1, 3, 4})
              .reshape({n_plain, c.n_head_kv, n_blocks_max * bt, hd});
        };
        attn = at::scaled_dot_product_attention(some(q), gather(pool_k), gather(pool_v), some(visible), 0.0, false,
                                                std::nullopt, /*enable_gqa=*/true);
      }
      if (attn.defined()) {
        if (all) out = attn;
        else out.index_copy_(0, idx, attn);
      }
      at::Tensor rows_out = (paged_kernels ? out : out.transpose(1, 2)).reshape({B, 1, c.q_dim()});
      return piece ? at::cat({rows_out, piece_out.to(rows_out.scalar_type())}) : rows_out;
    });
  }
  if (!piece) return logits(x, LogitsMode::last).view({B, -1});
  piece->cache->advance(n_piece);
  // The rows' logits and the piece's last token's, through the head together.
  at::Tensor all = logits(at::cat({x.narrow(0, 0, B), x.narrow(0, B + n_piece - 1, 1)}), LogitsMode::last).view({B + 1, -1});
  piece->logits = all[B];
  return all.narrow(0, 0, B);
}

COMB_INLINE at::Tensor Decoder::paged_kernels_step(BlockPool& pool, const at::Tensor& ids, const at::Tensor& positions,
                                                   const at::Tensor& table, int64_t longest,
                                                   const at::Tensor& joined) const {
  const auto& c = config_;
  const detail::CudaLayerOps& ops = *detail::cuda_layer_ops();
  const int64_t n = ids.size(0);
  COMB_CHECK(!joined.defined() || (ops.paged_attention_joined != nullptr && joined.dim() == 3 &&
                                   joined.size(0) == c.n_layer && joined.size(1) == n && joined.size(2) == 5),
             "paged_kernels_step: joined parameters [{}, {}, 5] (with comb's paged_attention_joined)", c.n_layer, n);
  at::Tensor x = embed(ids.view({n, 1}));  // [n, 1, n_embd]
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const auto& w = weights_.layers[i];
    const at::Tensor pool_k = pool.keys(i), pool_v = pool.values(i);
    x = detail::decoder::layer_body(x, w, detail::decoder::cuda_math(w, c, ops), [&](const at::Tensor& qkv) {
      const at::Tensor q =
          ops.paged_rope_store(qkv.reshape({n, -1}).contiguous(), rope_cos_, rope_sin_, pool_k, pool_v, table, positions,
                               c.n_head);  // [n, n_head, head_dim]
      const at::Tensor out = joined.defined()
                                 ? ops.paged_attention_joined(q, pool_k, pool_v, table, positions, longest, joined[i])
                                 : ops.paged_attention(q, pool_k, pool_v, table, positions, longest, {}, {}, {}, 0);
      return out.reshape({n, 1, c.q_dim()});
    });
  }
  return logits(x, LogitsMode::last).view({n, -1});
}

COMB_INLINE std::string base_fingerprint(const Decoder& base) {
  const auto& w = base.weights();
  if (!w.fingerprint.empty()) return w.fingerprint;  // weights kept quantized: computed on load
  Decoder::FingerprintMemo& memo = *base.fingerprint_;
  std::call_once(memo.once, [&] {
    RECORD_FUNCTION("comb::base_fingerprint", std::vector<c10::IValue>());
    BaseFingerprint f(base.config());
    for (const at::Tensor* t : {&w.tok_embd, &w.output_norm, &w.layers[0].attn_norm, &w.layers[0].wqkv}) f.add(*t);
    memo.value = f.finish();
  });
  return memo.value;
}

}  // namespace comb
