// comb's fused decoder ops on CUDA (adapters of decode_kernels.hpp: checks, then the launch on the
// current stream) and the one-launch decoding step built from them (detail/decode_step.hpp): the
// step's kernels and cuBLAS GEMMs over static buffers, captured once as a CUDA graph and replayed.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "comb/detail/decode_step.hpp"
#include "comb/error.hpp"
#include "decode_kernels.hpp"

namespace comb::ops {

namespace {

namespace k = comb::detail::cuda;

k::Half half_type(const at::Tensor& t, const char* op) {
  COMB_CHECK(t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf),
             "{}: expected a float16 or bfloat16 CUDA tensor, found {} on {}", op, c10::toString(t.scalar_type()),
             t.device().str());
  return t.scalar_type() == at::kBFloat16 ? k::Half::bf16 : k::Half::f16;
}

void check_launch(cudaError_t err, const char* op) {
  COMB_CHECK(err == cudaSuccess, "{}: CUDA launch failed: {}", op, cudaGetErrorString(err));
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* what, const char* op) {
  COMB_CHECK(t.device() == like.device() && t.scalar_type() == like.scalar_type() && t.is_contiguous(),
             "{}: {} should be contiguous {} on {}, found {} on {}{}", op, what, c10::toString(like.scalar_type()),
             like.device().str(), c10::toString(t.scalar_type()), t.device().str(),
             t.is_contiguous() ? "" : " (strided)");
}

// A parameter block (decode_kernels.hpp) for one layer's cache: int64 [kParamCaches + 2] on the device.
at::Tensor cache_params(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t position) {
  std::vector<int64_t> p{position, k_cache.size(2), 0, reinterpret_cast<int64_t>(k_cache.data_ptr()),
                         reinterpret_cast<int64_t>(v_cache.data_ptr())};
  return at::tensor(p, at::kLong).to(k_cache.device());
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& like, const char* op) {
  check_like(k_cache, like, "the key cache", op);
  check_like(v_cache, like, "the value cache", op);
  COMB_CHECK(k_cache.dim() == 4 && k_cache.size(0) == 1 && v_cache.sizes() == k_cache.sizes(),
             "{}: caches [1, n_head_kv, capacity, head_dim] of one sequence, found keys [{}] and values [{}]", op,
             fmt::join(k_cache.sizes(), ", "), fmt::join(v_cache.sizes(), ", "));
}

// residual [.., dim] (in place) += delta (when defined); returns RMSNorm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  const char* op = "comb::add_rms_norm";
  const k::Half type = half_type(residual, op);
  check_like(residual, residual, "residual", op);
  const int64_t dim = residual.size(-1);
  check_like(weight, residual, "weight", op);
  COMB_CHECK(weight.dim() == 1 && weight.size(0) == dim, "{}: weight [{}] for rows of {}", op,
             fmt::join(weight.sizes(), ", "), dim);
  if (delta.defined()) {
    check_like(delta, residual, "delta", op);
    COMB_CHECK(delta.sizes() == residual.sizes(), "{}: delta [{}] and residual [{}] differ", op,
               fmt::join(delta.sizes(), ", "), fmt::join(residual.sizes(), ", "));
  }
  c10::cuda::CUDAGuard guard(residual.device());
  at::Tensor out = at::empty_like(residual);
  check_launch(k::add_rms_norm(type, residual.data_ptr(), delta.defined() ? delta.data_ptr() : nullptr,
                               weight.data_ptr(), out.data_ptr(), residual.numel() / dim, dim, static_cast<float>(eps),
                               at::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor rope_append(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t position, int64_t n_head) {
  const char* op = "comb::rope_append";
  const k::Half type = half_type(qkv, op);
  check_like(qkv, qkv, "qkv", op);
  check_like(cos, qkv, "cos", op);
  check_like(sin, qkv, "sin", op);
  check_cache(k_cache, v_cache, qkv, op);
  const int64_t n_kv = k_cache.size(1), hd = k_cache.size(3), n = qkv.size(0);
  COMB_CHECK(qkv.dim() == 2 && qkv.size(1) == (n_head + 2 * n_kv) * hd && hd % 2 == 0,
             "{}: qkv [n, {}] for {} query heads and {} KV heads of {}, found [{}]", op, (n_head + 2 * n_kv) * hd,
             n_head, n_kv, hd, fmt::join(qkv.sizes(), ", "));
  COMB_CHECK(position >= 0 && position + n <= k_cache.size(2) && position + n <= cos.size(0) &&
                 cos.sizes() == sin.sizes() && cos.size(1) == hd,
             "{}: positions [{}, {}) past the cache's {} or the tables' {}", op, position, position + n,
             k_cache.size(2), cos.size(0));
  c10::cuda::CUDAGuard guard(qkv.device());
  at::Tensor q = at::empty({n, n_head, hd}, qkv.options());
  at::Tensor params = cache_params(k_cache, v_cache, position);
  check_launch(k::rope_store(type, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), params.data_ptr<int64_t>(), 0, 1,
                             q.data_ptr(), n, n_head, n_kv, hd, at::cuda::getCurrentCUDAStream()),
               op);
  return q;
}

void place_keys(const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                int64_t position) {
  const char* op = "comb::place_keys";
  const k::Half type = half_type(k_cache, op);
  check_like(k_cache, k_cache, "the key cache", op);
  check_like(cos, k_cache, "cos", op);
  check_like(sin, k_cache, "sin", op);
  COMB_CHECK(k.device() == k_cache.device() && k.scalar_type() == k_cache.scalar_type() && k.dim() == 4 &&
                 k.size(0) == 1 && k_cache.dim() == 4 && k_cache.size(0) == 1 && k.size(1) == k_cache.size(1) &&
                 k.size(3) == k_cache.size(3) && k.stride(3) == 1,
             "{}: keys [1, {}, n, {}] {} on {} (last dimension contiguous), found [{}] {} on {}", op, k_cache.size(1),
             k_cache.size(3), c10::toString(k_cache.scalar_type()), k_cache.device().str(), fmt::join(k.sizes(), ", "),
             c10::toString(k.scalar_type()), k.device().str());
  const int64_t n = k.size(2), hd = k.size(3);
  COMB_CHECK(position >= 0 && position + n <= k_cache.size(2) && position < cos.size(0) && cos.size(1) == hd &&
                 sin.sizes() == cos.sizes(),
             "{}: positions [{}, {}) past the cache's {} or the tables' {}", op, position, position + n,
             k_cache.size(2), cos.size(0));
  COMB_CHECK(!k.is_alias_of(k_cache), "{}: the keys must not be the cache's own", op);
  c10::cuda::CUDAGuard guard(k.device());
  check_launch(k::rotate_keys(type, k.data_ptr(), k.stride(1), k.stride(2), cos[position].data_ptr(),
                              sin[position].data_ptr(), k_cache.data_ptr(), k_cache.size(2), position, n, k.size(1), hd,
                              at::cuda::getCurrentCUDAStream()),
               op);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const char* op = "comb::silu_mul";
  const k::Half type = half_type(gate_up, op);
  check_like(gate_up, gate_up, "gate_up", op);
  COMB_CHECK(gate_up.size(-1) % 2 == 0, "{}: an odd last dimension {}", op, gate_up.size(-1));
  const int64_t n_ff = gate_up.size(-1) / 2;
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = n_ff;
  c10::cuda::CUDAGuard guard(gate_up.device());
  at::Tensor out = at::empty(shape, gate_up.options());
  check_launch(k::silu_mul(type, gate_up.data_ptr(), out.data_ptr(), gate_up.numel() / (2 * n_ff), n_ff,
                           at::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

// Splits of each row's keys: enough blocks to fill the device twice, none of fewer than 32 keys.
int64_t split_count(const at::Tensor& on, int64_t n_head_kv, int64_t n_rows, int64_t longest) {
  const int sms = at::cuda::getDeviceProperties(on.device().index())->multiProcessorCount;
  const int64_t fill = (2 * sms + n_head_kv * n_rows - 1) / (n_head_kv * n_rows);
  return std::clamp<int64_t>(std::min(fill, (longest + 31) / 32), 1, 64);
}

at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                          const at::Tensor& joined_keys, const at::Tensor& joined_values, const at::Tensor& joined_bias,
                          int64_t anchor) {
  const char* op = "comb::rows_attention";
  const k::Half type = half_type(q, op);
  check_like(q, q, "q", op);
  check_cache(k_cache, v_cache, q, op);
  const int64_t n_kv = k_cache.size(1), hd = k_cache.size(3);
  COMB_CHECK(q.dim() == 3 && q.size(2) == hd && q.size(1) % n_kv == 0 &&
                 (hd == 32 || hd == 64 || hd == 128 || hd == 256),
             "{}: q [n, n_head, head_dim] with head_dim 32, 64, 128 or 256 and n_head a multiple of {}, found [{}]", op,
             n_kv, fmt::join(q.sizes(), ", "));
  const int64_t n = q.size(0), n_head = q.size(1);
  COMB_CHECK(n >= 1 && n <= 65535 && start >= 0 && start + n <= k_cache.size(2),
             "{}: {} rows after {} positions in a cache of {}", op, n, start, k_cache.size(2));
  int64_t m = 0;
  if (joined_keys.defined()) {
    check_like(joined_keys, q, "joined keys", op);
    check_like(joined_values, q, "joined values", op);
    COMB_CHECK(joined_keys.dim() == 3 && joined_keys.size(0) == n_kv && joined_keys.size(2) == hd &&
                   joined_values.sizes() == joined_keys.sizes(),
               "{}: joined keys [{}] and values [{}] should be [{}, m, {}]", op, fmt::join(joined_keys.sizes(), ", "),
               fmt::join(joined_values.sizes(), ", "), n_kv, hd);
    m = joined_keys.size(1);
  }
  if (joined_bias.defined())
    COMB_CHECK(joined_bias.is_cuda() && joined_bias.device() == q.device() &&
                   joined_bias.scalar_type() == at::kFloat && joined_bias.is_contiguous() && joined_bias.numel() == n_head,
               "{}: joined_bias should be float32 [{}] on {}", op, n_head, q.device().str());
  c10::cuda::CUDAGuard guard(q.device());
  k::RowsAttention a;
  a.n_rows = n, a.n_head = n_head, a.n_head_kv = n_kv, a.head_dim = hd;
  a.n_split = split_count(q, n_kv, n, m + start + n);
  at::Tensor partial = at::empty({n, n_head, a.n_split, hd + 2}, q.options().dtype(at::kFloat));
  at::Tensor out = at::empty_like(q);
  at::Tensor params = cache_params(k_cache, v_cache, start);
  a.q = q.data_ptr(), a.params = params.data_ptr<int64_t>(), a.out = out.data_ptr(), a.partial = partial.data_ptr<float>();
  if (m > 0) {
    a.joined_keys = joined_keys.data_ptr(), a.joined_values = joined_values.data_ptr(), a.n_joined = m;
    a.anchor = anchor;
    if (joined_bias.defined()) a.joined_bias = joined_bias.data_ptr<float>();
  }
  check_launch(k::rows_attention(type, a, at::cuda::getCurrentCUDAStream()), op);
  return out;
}

int gemv_blocks(const at::Tensor& on) {
  return 4 * at::cuda::getDeviceProperties(on.device().index())->multiProcessorCount;
}

// x [k] (or [1, k]) times w [n, k] transposed: [n] (or [1, n]).
at::Tensor gemv(const at::Tensor& w, const at::Tensor& x) {
  const char* op = "comb::gemv";
  const k::Half type = half_type(w, op);
  check_like(w, w, "w", op);
  check_like(x, w, "x", op);
  COMB_CHECK(w.dim() == 2 && x.numel() == w.size(1) && w.size(1) % 8 == 0 && w.size(1) * 2 <= k::kGemvMaxShared,
             "{}: w [n, k] with k a multiple of 8 up to {} and x of k values, found w [{}] and x [{}]", op,
             k::kGemvMaxShared / 2, fmt::join(w.sizes(), ", "), fmt::join(x.sizes(), ", "));
  c10::cuda::CUDAGuard guard(w.device());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.size(0);
  at::Tensor y = at::empty(shape, x.options());
  check_launch(k::gemv(type, w.data_ptr(), x.data_ptr(), y.data_ptr(), w.size(0), w.size(1), gemv_blocks(w),
                       at::cuda::getCurrentCUDAStream()),
               op);
  return y;
}

// The Torch ops' forms (optional tensors).
at::Tensor add_rms_norm_op(const at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                           double eps) {
  return add_rms_norm(residual, delta.value_or(at::Tensor()), weight, eps);
}
at::Tensor rows_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                             const std::optional<at::Tensor>& joined_keys, const std::optional<at::Tensor>& joined_values,
                             const std::optional<at::Tensor>& joined_bias, int64_t anchor) {
  return rows_attention(q, k_cache, v_cache, start, joined_keys.value_or(at::Tensor()),
                        joined_values.value_or(at::Tensor()), joined_bias.value_or(at::Tensor()), anchor);
}

// ---- The one-launch decoding step ---------------------------------------------------------------

class GraphDecodeStep final : public comb::detail::DecodeStep {
 public:
  GraphDecodeStep(const comb::detail::DecodeStepSpec& spec, bool graph) : s_(spec), graph_wanted_(graph) {
    const at::Tensor& e = s_.tok_embd;
    type_ = half_type(e, "the decoding step");
    device_ = e.device();
    const int64_t L = s_.n_layer, hd = s_.head_dim;
    COMB_CHECK(static_cast<int64_t>(s_.layers.size()) == L && (hd == 32 || hd == 64 || hd == 128 || hd == 256),
               "the decoding step: {} layers of weights for {}, head_dim {} (32, 64, 128 or 256)", s_.layers.size(), L,
               hd);
    auto check = [&](const at::Tensor& t, const char* what) {
      COMB_CHECK(t.device() == device_ && t.scalar_type() == e.scalar_type() && t.is_contiguous(),
                 "the decoding step: {} should be contiguous {} on {}", what, c10::toString(e.scalar_type()),
                 device_.str());
    };
    check(s_.output_norm, "output_norm");
    check(s_.output, "output");
    check(s_.rope_cos, "rope_cos");
    check(s_.rope_sin, "rope_sin");
    for (const auto& l : s_.layers)
      for (const at::Tensor& t : l) check(t, "a layer weight");
    c10::cuda::CUDAGuard guard(device_);
    const auto opts = e.options();
    const int64_t q_dim = s_.n_head * hd, qkv_dim = q_dim + 2 * s_.n_head_kv * hd;
    params_ = at::zeros({comb::detail::cuda::kParamCaches + 2 * L}, opts.dtype(at::kLong));
    x_ = at::empty({1, s_.n_embd}, opts);
    normed_ = at::empty({1, s_.n_embd}, opts);
    qkv_ = at::empty({1, qkv_dim}, opts);
    q_ = at::empty({1, q_dim}, opts);
    attn_ = at::empty({1, q_dim}, opts);
    o_ = at::empty({1, s_.n_embd}, opts);
    gate_up_ = at::empty({1, 2 * s_.n_ff}, opts);
    act_ = at::empty({1, s_.n_ff}, opts);
    down_ = at::empty({1, s_.n_embd}, opts);
    logits_ = at::empty({1, s_.n_vocab}, opts);
    logits_f32_ = at::empty({1, s_.n_vocab}, opts.dtype(at::kFloat));
    // NOTE: the graph's grid is fixed: as many splits as fill the device, whatever the length
    // (splits past a short context find no key and end at once).
    n_split_ = split_count(e, s_.n_head_kv, 1, int64_t(1) << 20);
    partial_ = at::empty({s_.n_head, n_split_, hd + 2}, opts.dtype(at::kFloat));
    // NOTE: comb's GEMV took 5.18 ms a token at the 8B shape on an H200 against cuBLAS's 4.82
    // (docs/benchmarks.md): cuBLAS by default, comb's with COMB_CUDA_GEMV=1.
    const char* gemv_env = std::getenv("COMB_CUDA_GEMV");
    gemv_ = gemv_env != nullptr && std::string(gemv_env) == "1";
    gemv_blocks_ = gemv_blocks(e);
  }

  at::Tensor run(int64_t token, int64_t position, const std::vector<at::Tensor>& keys,
                 const std::vector<at::Tensor>& values) override {
    const int64_t L = s_.n_layer;
    COMB_CHECK(static_cast<int64_t>(keys.size()) == L && static_cast<int64_t>(values.size()) == L,
               "the decoding step: caches of {} and {} layers for {}", keys.size(), values.size(), L);
    COMB_CHECK(token >= 0 && token < s_.n_vocab, "the decoding step: token {} outside [0, {})", token, s_.n_vocab);
    const int64_t capacity = keys[0].size(2);
    COMB_CHECK(position >= 0 && position < capacity && position < s_.rope_cos.size(0),
               "the decoding step: position {} past the cache's capacity {}", position, capacity);
    std::vector<int64_t> p(comb::detail::cuda::kParamCaches + 2 * L);
    p[comb::detail::cuda::kParamPosition] = position;
    p[comb::detail::cuda::kParamCapacity] = capacity;
    p[comb::detail::cuda::kParamToken] = token;
    for (int64_t l = 0; l < L; ++l) {
      for (const at::Tensor* t : {&keys[l], &values[l]}) {
        COMB_CHECK(t->device() == device_ && t->scalar_type() == x_.scalar_type() && t->is_contiguous() &&
                       t->dim() == 4 && t->size(0) == 1 && t->size(1) == s_.n_head_kv && t->size(2) == capacity &&
                       t->size(3) == s_.head_dim,
                   "the decoding step: layer {}'s cache should be contiguous [1, {}, {}, {}] {} on {}, found [{}]", l,
                   s_.n_head_kv, capacity, s_.head_dim, c10::toString(x_.scalar_type()), device_.str(),
                   fmt::join(t->sizes(), ", "));
      }
      p[comb::detail::cuda::kParamCaches + l] = reinterpret_cast<int64_t>(keys[l].data_ptr());
      p[comb::detail::cuda::kParamCaches + L + l] = reinterpret_cast<int64_t>(values[l].data_ptr());
    }
    c10::cuda::CUDAGuard guard(device_);
    // From pageable memory: the copy has read `p` when it returns.
    params_.copy_(at::from_blob(p.data(), {static_cast<int64_t>(p.size())}, at::kLong));
    if (!graph_wanted_) {
      body();
    } else {
      if (!graph_) capture();
      graph_->replay();
    }
    return logits_f32_.clone().view({1, 1, s_.n_vocab});
  }

 private:
  // out [1, n] = in [1, k] times w [n, k] transposed: cuBLAS, or with COMB_CUDA_GEMV=1 comb's GEMV
  // where it takes the shapes.
  void linear(const at::Tensor& out, const at::Tensor& in, const at::Tensor& w, cudaStream_t stream) {
    if (gemv_ && k::gemv(type_, w.data_ptr(), in.data_ptr(), out.data_ptr(), w.size(0), w.size(1), gemv_blocks_,
                         stream) == cudaSuccess)
      return;
    (void)cudaGetLastError();  // a refused launch leaves no error behind
    at::mm_out(const_cast<at::Tensor&>(out), in, w.t());
  }

  // The step's launches, every one over the static buffers.
  void body() {
    namespace ck = comb::detail::cuda;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const float eps = static_cast<float>(s_.rms_eps);
    const int64_t L = s_.n_layer;
    int64_t* params = params_.data_ptr<int64_t>();
    at::index_select_out(x_, s_.tok_embd, 0, params_.narrow(0, ck::kParamToken, 1));
    check_launch(ck::add_rms_norm(type_, x_.data_ptr(), nullptr, s_.layers[0][0].data_ptr(), normed_.data_ptr(), 1,
                                  s_.n_embd, eps, stream),
                 "the decoding step");
    for (int64_t l = 0; l < L; ++l) {
      const auto& w = s_.layers[l];
      linear(qkv_, normed_, w[1], stream);
      check_launch(ck::rope_store(type_, qkv_.data_ptr(), s_.rope_cos.data_ptr(), s_.rope_sin.data_ptr(), params, l, L,
                                  q_.data_ptr(), 1, s_.n_head, s_.n_head_kv, s_.head_dim, stream),
                   "the decoding step");
      ck::RowsAttention a;
      a.q = q_.data_ptr(), a.params = params, a.layer = l, a.n_layer = L, a.out = attn_.data_ptr();
      a.partial = partial_.data_ptr<float>(), a.n_rows = 1, a.n_split = n_split_, a.n_head = s_.n_head;
      a.n_head_kv = s_.n_head_kv, a.head_dim = s_.head_dim;
      check_launch(ck::rows_attention(type_, a, stream), "the decoding step");
      linear(o_, attn_, w[2], stream);
      check_launch(ck::add_rms_norm(type_, x_.data_ptr(), o_.data_ptr(), w[3].data_ptr(), normed_.data_ptr(), 1,
                                    s_.n_embd, eps, stream),
                   "the decoding step");
      linear(gate_up_, normed_, w[4], stream);
      check_launch(ck::silu_mul(type_, gate_up_.data_ptr(), act_.data_ptr(), 1, s_.n_ff, stream), "the decoding step");
      linear(down_, act_, w[5], stream);
      // The residual add, then the next layer's norm (or the output norm).
      const at::Tensor& next_norm = l + 1 < L ? s_.layers[l + 1][0] : s_.output_norm;
      check_launch(ck::add_rms_norm(type_, x_.data_ptr(), down_.data_ptr(), next_norm.data_ptr(), normed_.data_ptr(),
                                    1, s_.n_embd, eps, stream),
                   "the decoding step");
    }
    linear(logits_, normed_, s_.output, stream);
    logits_f32_.copy_(logits_);
  }

  // NOTE: captured on a side stream after one plain run there (cuBLAS sets up its workspace for a
  // stream on first use, which a capture may not do); the caller's stream then waits for it.
  void capture() {
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device_.index());
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device_.index());
    side.synchronize();
    caller.synchronize();
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      body();  // writes the same K/V at the same position as the replay after it
      side.synchronize();
      auto graph = std::make_unique<at::cuda::CUDAGraph>();
      graph->capture_begin();
      body();
      graph->capture_end();
      side.synchronize();
      graph_ = std::move(graph);
    }
  }

  comb::detail::DecodeStepSpec s_;
  bool graph_wanted_;
  k::Half type_ = k::Half::bf16;
  c10::Device device_{c10::kCUDA};
  int64_t n_split_ = 1;
  bool gemv_ = false;
  int gemv_blocks_ = 1;
  at::Tensor params_;  // int64 [kParamCaches + 2 n_layer]
  at::Tensor x_, normed_, o_, down_;  // [1, n_embd]
  at::Tensor qkv_, q_, attn_, gate_up_, act_, logits_, logits_f32_, partial_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
};

std::unique_ptr<comb::detail::DecodeStep> make_decode_step(const comb::detail::DecodeStepSpec& spec, bool graph) {
  return std::make_unique<GraphDecodeStep>(spec, graph);
}

const comb::detail::CudaLayerOps kLayerOps{&add_rms_norm, &rope_append, &place_keys, &silu_mul, &rows_attention};

// Registered when the module loads (comb::load_cuda_backend).
[[maybe_unused]] const bool registered = (comb::detail::set_decode_step_factory(&make_decode_step),
                                          comb::detail::set_cuda_layer_ops(&kLayerOps), true);

}  // namespace

}  // namespace comb::ops

TORCH_LIBRARY_IMPL(comb, CUDA, m) {
  m.impl("add_rms_norm", &comb::ops::add_rms_norm_op);
  m.impl("rope_append", &comb::ops::rope_append);
  m.impl("place_keys", &comb::ops::place_keys);
  m.impl("gemv", &comb::ops::gemv);
  m.impl("silu_mul", &comb::ops::silu_mul);
  m.impl("rows_attention", &comb::ops::rows_attention_op);
}
