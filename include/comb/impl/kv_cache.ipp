// comb::KVCache, comb::BlockPool and the RoPE tables (see comb/kv_cache.hpp).
// Compiled into libcomb (src/kv_cache.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "comb/detail/upload.hpp"
#include "comb/error.hpp"
#include "comb/kv_cache.hpp"

namespace comb {

COMB_INLINE KVCache::KVCache(const ModelConfig& c, int64_t batch, int64_t capacity, c10::ScalarType dtype, c10::Device device)
    : batch_(batch), capacity_(capacity) {
  COMB_CHECK(batch > 0 && capacity > 0, "KV cache needs a positive batch and capacity, found {} and {}", batch,
             capacity);
  auto options = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    k_.push_back(at::empty({batch, c.n_head_kv, capacity, c.head_dim}, options));
    v_.push_back(at::empty({batch, c.n_head_kv, capacity, c.head_dim}, options));
  }
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> KVCache::append(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  int64_t n = k.size(2);
  COMB_CHECK(length_ + n <= capacity_, "KV cache full: {} positions held, {} more asked, capacity {}", length_, n,
             capacity_);
  write(layer, length_, k, v);
  return {k_[layer].narrow(2, 0, length_ + n), v_[layer].narrow(2, 0, length_ + n)};
}

COMB_INLINE void KVCache::advance(int64_t n) {
  COMB_CHECK(length_ + n <= capacity_, "KV cache: cannot advance {} past capacity {}", length_ + n, capacity_);
  length_ += n;
}

COMB_INLINE void KVCache::set_length(int64_t n) {
  COMB_CHECK(n >= 0 && n <= capacity_, "KV cache: length {} outside [0, {}]", n, capacity_);
  length_ = n;
}

COMB_INLINE void KVCache::write(int64_t layer, int64_t pos, const at::Tensor& k, const at::Tensor& v) {
  const int64_t n = k.size(2);
  COMB_CHECK(pos >= 0 && pos + n <= capacity_, "KV cache: writing [{}, {}) past capacity {}", pos, pos + n, capacity_);
  k_[layer].narrow(2, pos, n).copy_(k);
  v_[layer].narrow(2, pos, n).copy_(v);
}

COMB_INLINE void KVCache::truncate(int64_t n) {
  COMB_CHECK(n >= 0 && n <= length_, "KV cache: cannot truncate to {} (length {})", n, length_);
  length_ = n;
}

COMB_INLINE at::Tensor rope_inv_freq(const ModelConfig& c, const at::Tensor& rope_freqs) {
  // inv_freq[i] = theta^(-2i / head_dim), computed as Hugging Face does (fp32 powers of int64 steps).
  at::Tensor exponent = at::arange(0, c.head_dim, 2, at::kLong).to(at::kFloat) / static_cast<float>(c.head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(c.rope_theta, exponent);
  if (rope_freqs.defined()) return inv_freq / rope_freqs.to(at::kCPU, at::kFloat);
  if (c.rope_scaling.type == "llama3") {
    const auto& s = c.rope_scaling;
    double low_wavelen = s.original_max_position / s.low_freq_factor;
    double high_wavelen = s.original_max_position / s.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq);
    at::Tensor smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq = at::where(medium, smoothed, scaled);
  }
  return inv_freq;
}

COMB_INLINE std::pair<at::Tensor, at::Tensor> rope_tables(const ModelConfig& c, const at::Tensor& rope_freqs, int64_t n_pos,
                                              c10::ScalarType dtype, c10::Device device) {
  at::Tensor inv_freq = rope_inv_freq(c, rope_freqs);                          // [head_dim / 2]
  at::Tensor freqs = at::outer(at::arange(n_pos, at::kFloat), inv_freq);       // [n_pos, head_dim / 2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);                                // [n_pos, head_dim]
  return {emb.cos().to(device, dtype), emb.sin().to(device, dtype)};
}

// ---- BlockPool ------------------------------------------------------------------------------

COMB_INLINE BlockPool::BlockPool(const ModelConfig& c, int64_t n_blocks, int64_t block_tokens, c10::ScalarType dtype,
                                 c10::Device device)
    : n_blocks_(n_blocks), block_tokens_(block_tokens) {
  COMB_CHECK(block_tokens > 0, "block size must be > 0 tokens, found {}", block_tokens);
  COMB_CHECK(n_blocks > 0 && n_blocks < (int64_t(1) << 31), "a pool of {} blocks (expected 1 to 2^31 - 1)", n_blocks);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t l = 0; l < c.n_layer; ++l) {
    k_.push_back(at::zeros({n_blocks, c.n_head_kv, block_tokens, c.head_dim}, opts));
    v_.push_back(at::zeros({n_blocks, c.n_head_kv, block_tokens, c.head_dim}, opts));
  }
  free_.reserve(n_blocks);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

COMB_INLINE std::vector<int32_t> BlockPool::allocate(int64_t n) {
  if (n <= 0 || n > n_free()) return {};
  std::vector<int32_t> out(free_.end() - n, free_.end());
  free_.resize(free_.size() - n);
  return out;
}

COMB_INLINE void BlockPool::release(const std::vector<int32_t>& blocks) {
  free_.insert(free_.end(), blocks.begin(), blocks.end());
}

COMB_INLINE int64_t BlockPool::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += 2 * k_[l].numel() * static_cast<int64_t>(k_[l].element_size());
  return b;
}

COMB_INLINE int64_t BlockPool::block_bytes(const ModelConfig& c, int64_t block_tokens, c10::ScalarType dtype) {
  return 2 * c.n_layer * c.n_head_kv * block_tokens * c.head_dim * static_cast<int64_t>(c10::elementSize(dtype));
}

COMB_INLINE void BlockPool::load(const KVCache& cache, int64_t n, const std::vector<int32_t>& blocks) {
  COMB_CHECK(cache.batch() == 1 && n <= cache.capacity() && blocks_for(n) <= static_cast<int64_t>(blocks.size()),
             "block pool: {} positions of a cache of batch {} into {} blocks of {}", n, cache.batch(), blocks.size(),
             block_tokens_);
  if (k_[0].device().is_cpu()) {  // block by block: each copied once
    for (int64_t l = 0; l < cache.n_layers(); ++l) {
      at::Tensor k = cache.keys(l)[0], v = cache.values(l)[0];  // [n_head_kv, capacity, head_dim]
      for (int64_t p0 = 0, j = 0; p0 < n; p0 += block_tokens_, ++j) {
        const int64_t len = std::min(block_tokens_, n - p0);
        k_[l][blocks[j]].narrow(1, 0, len).copy_(k.narrow(1, p0, len));
        v_[l][blocks[j]].narrow(1, 0, len).copy_(v.narrow(1, p0, len));
      }
    }
    return;
  }
  // On a GPU, the whole blocks in one copy a layer (not a launch a block), the last part-filled
  // block apart.
  const int64_t whole = n / block_tokens_, tail = n - whole * block_tokens_;
  at::Tensor index;
  if (whole > 0)
    index = detail::upload(at::tensor(std::vector<int64_t>(blocks.begin(), blocks.begin() + whole), at::kLong),
                           k_[0].device());
  for (int64_t l = 0; l < cache.n_layers(); ++l) {
    at::Tensor k = cache.keys(l)[0], v = cache.values(l)[0];
    const int64_t h = k.size(0), hd = k.size(2);
    if (whole > 0) {
      auto as_blocks = [&](const at::Tensor& t) {  // -> [whole, n_head_kv, block_tokens, head_dim]
        return t.narrow(1, 0, whole * block_tokens_)
            .reshape({h, whole, block_tokens_, hd})
            .permute({1, 0, 2, 3})
            .to(k_[l].scalar_type());
      };
      k_[l].index_copy_(0, index, as_blocks(k));
      v_[l].index_copy_(0, index, as_blocks(v));
    }
    if (tail > 0) {
      k_[l][blocks[whole]].narrow(1, 0, tail).copy_(k.narrow(1, whole * block_tokens_, tail));
      v_[l][blocks[whole]].narrow(1, 0, tail).copy_(v.narrow(1, whole * block_tokens_, tail));
    }
  }
}

}  // namespace comb
